"""SFT of a tiny Qwen2 with a Qwen-style byte-level BPE tokenizer and chat template on
two-term addition (reasoning-gym's basic_arithmetic, numbers up to 99), prompts rendered
as chat turns: the demo's task in the form real servers serve. The tokenizer is trained
on the task's text with Qwen's special tokens (``asyncrl.chat_tokenizers``); the model
ties its LM head to the embedding, as the small Qwen releases do, and its heads are 32
wide, the smallest vLLM's CPU kernels take. Stopped early so RL has accuracy to add;
the export at ``runs/models/chat-sft`` is where ``chat_grpo`` starts."""

from dataclasses import replace
from pathlib import Path

from asyncrl.config import load_experiment
from asyncrl.evaluation import EvalConfig
from asyncrl.models import ModelConfig, TinyModelConfig
from asyncrl.stages.sft import SFTConfig, SFTExperiment
from asyncrl.tasks import TaskConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig

TINY = load_experiment(Path(__file__).with_name("tiny_sft.py")).task  # the demo's task

TASK = TaskConfig(
    dataset="basic_arithmetic",
    dataset_kwargs=TINY.dataset_kwargs,
    prompt_format="chat",
    # A short system turn: Qwen's default one would triple every prompt.
    system_prompt="Answer with the number only.",
)

config = SFTExperiment(
    name="chat_sft",
    model=ModelConfig(
        path="runs/models/tiny-chat-qwen2",
        make_if_missing=True,
        tiny=replace(TinyModelConfig(), tokenizer="qwen", tie_embeddings=True),
    ),
    task=TASK,
    trainer=TrainerConfig(num_ranks=1, micro_batch_tokens=4096, row_tokens=256),
    optim=OptimConfig(lr=1e-3, warmup_steps=20, min_lr_ratio=0.05),
    sft=SFTConfig(batch_size=64, max_steps=400, export_dir="runs/models/chat-sft"),
    eval=EvalConfig(every_steps=100, num_examples=200),
)
