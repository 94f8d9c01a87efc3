"""Held-out evaluation: greedy accuracy of a policy on a task's eval split.

Runs on one process with a plain (unsharded) copy of the weights, so sharded trainer
ranks never have to step through ``generate`` in lockstep. Uses ``transformers``'
``generate`` until the embedded engine takes over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from asyncrl.tasks import Example, Task


@dataclass
class EvalConfig:
    every_steps: int = 50
    """Evaluate every this many optimizer steps (and at the start and the end); 0 disables."""
    num_examples: int = 200
    """Held-out examples per evaluation (the first N of the eval split)."""
    max_new_tokens: int = 16
    """Generation budget per completion."""
    batch_size: int = 100
    """Prompts generated together."""


@torch.no_grad()
def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    task: Task,
    examples: Sequence[Example],
    max_new_tokens: int,
    batch_size: int,
) -> dict[str, float]:
    """Fraction of greedy completions with full marks, mean reward, mean length in tokens."""
    model.eval()
    tokenizer.padding_side = "left"
    scores, lengths = [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        enc = tokenizer([ex.prompt for ex in chunk], return_tensors="pt", padding=True)
        enc = {k: v.to(model.device) for k, v in enc.items()}
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        new_tokens = out[:, enc["input_ids"].shape[1] :]
        for ex, row in zip(chunk, new_tokens.tolist()):
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            text = tokenizer.decode(row, skip_special_tokens=True)
            scores.append(task.score(ex, text))
            lengths.append(len(row))
    n = max(len(scores), 1)
    # Some verifiers give partial credit to well-formed wrong answers; accuracy counts
    # only full marks, the mean reward keeps the partial credit.
    correct = sum(1 for s in scores if s >= 1.0 - 1e-6)
    return {
        "eval/accuracy": correct / n,
        "eval/reward": sum(scores) / n,
        "eval/completion_tokens": sum(lengths) / n,
    }
