"""Asynchronous GRPO/DAPO of the tiny BPE Qwen2 (``bpe_sft``: a Qwen-style BPE tokenizer,
LM head tied to the embedding) on the demo's addition task. The
same recipe as ``tiny_grpo`` (see its docstring for why each value), so its figures set
the BPE model and the demo's side by side; ``bpe_grpo_vllm`` runs it with a real vLLM
server as the engine.

Measured figures: docs/results.md."""

from dataclasses import replace
from pathlib import Path

from asyncrl.config import load_experiment

SFT_FILE = Path(__file__).with_name("bpe_sft.py")
sft = load_experiment(SFT_FILE)
demo = load_experiment(Path(__file__).with_name("tiny_grpo.py"))

config = replace(
    demo,
    name="bpe_grpo",
    init_from_experiment=str(SFT_FILE),
    model=replace(demo.model, path=sft.sft.export_dir),
    task=replace(sft.task, full_marks_only=True, rl_split="unseen"),
)
