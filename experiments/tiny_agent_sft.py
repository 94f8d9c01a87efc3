"""SFT of the tiny Qwen2 model (1M parameters, char tokenizer) on demonstrations of the
calculator agent task (``asyncrl.envs.calculator``): multiply a three-digit number by a
two-digit one by calling the ``calc`` tool and copying its result into the answer. The
exported HF checkpoint at ``runs/models/tiny-agent-sft`` is where ``tiny_agent`` starts.

The target is each demonstration's whole text after the prompt: the call line, the tool's
result line and the answer line. The model is also trained to write the results, which
it cannot compute; at RL time that never counts, since a model turn stops at the "\\n"
after its call and the environment writes the result. The data files are written (or
found already written) under ``runs/data/tiny-agent`` when this file is loaded.
"""

from asyncrl.envs.calculator import STOP, write_calculator_data
from asyncrl.evaluation import EvalConfig
from asyncrl.models import ModelConfig
from asyncrl.stages.sft import SFTConfig, SFTExperiment
from asyncrl.tasks import TaskConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig

DATA = write_calculator_data("runs/data/tiny-agent")
# A model turn is one line: "answer 98901\n", the longest, is 13 tokens.
TURN_TOKENS = 16

TASK = TaskConfig(
    source="jsonl",
    train_path=str(DATA["sft"]),
    eval_path=str(DATA["eval"]),
    environment="asyncrl.envs.calculator:Calculator",
    # A call, one retry after an error, an answer: the demonstrations use two.
    max_turns=3,
    # 33 tokens with one call (12 + an observation of at most 8 + 13); 64 hold a retry.
    max_episode_tokens=64,
)

config = SFTExperiment(
    name="tiny_agent_sft",
    # Built from the task's texts: its char tokenizer covers every prompt, demonstration
    # and observation character (the environment's observations use no other).
    model=ModelConfig(path="runs/models/tiny-agent", make_if_missing=True),
    task=TASK,
    trainer=TrainerConfig(num_ranks=1, micro_batch_tokens=4096, row_tokens=256),
    # tiny_sft's rate. The schedule spans a full run of 1000 steps and max_steps stops it
    # early, so a longer run's checkpoint at step k is this run's export at k.
    optim=OptimConfig(lr=1e-3, warmup_steps=20, min_lr_ratio=0.05, total_steps=1000),
    # Stopped early on purpose, leaving held-out success for RL to add (107 steps: 30%).
    # Copying the tool's result into the answer is learned within a few steps around
    # here, so a few steps either way move the start a lot (docs/results.md).
    sft=SFTConfig(batch_size=64, max_steps=107, export_dir="runs/models/tiny-agent-sft"),
    eval=EvalConfig(every_steps=100, num_examples=200, max_new_tokens=TURN_TOKENS, stop=[STOP]),
)
