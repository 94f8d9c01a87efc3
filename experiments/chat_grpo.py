"""Asynchronous GRPO/DAPO of the chat-format tiny Qwen2 (``chat_sft``: a BPE tokenizer and
Qwen's chat template, LM head tied to the embedding) on the demo's addition task. The
same recipe as ``tiny_grpo`` (see its docstring for why each value), so its figures set
the chat form and the demo's side by side; ``chat_grpo_vllm`` runs it with a real vLLM
server as the engine.

Measured figures: docs/results.md."""

from dataclasses import replace
from pathlib import Path

from asyncrl.config import load_experiment

SFT_FILE = Path(__file__).with_name("chat_sft.py")
sft = load_experiment(SFT_FILE)
demo = load_experiment(Path(__file__).with_name("tiny_grpo.py"))

config = replace(
    demo,
    name="chat_grpo",
    init_from_experiment=str(SFT_FILE),
    model=replace(demo.model, path=sft.sft.export_dir),
    task=replace(sft.task, full_marks_only=True, rl_split="unseen"),
)
