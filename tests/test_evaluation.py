"""Held-out evaluation through the embedded engine equals transformers' greedy
``generate`` (the evaluator's previous path, kept here as the reference): the same
completions token for token, hence the same accuracy, reward and lengths."""

from __future__ import annotations

import torch

from asyncrl.evaluation import (
    EvalConfig,
    greedy_accuracy,
    greedy_completions,
    make_eval_engine,
    tokenize_prompts,
)
from asyncrl.models import ModelConfig, load_model, load_tokenizer


@torch.no_grad()
def hf_greedy_completions(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int
) -> list[list[int]]:
    """Left-padded static batches through ``generate``, cut at the first EOS."""
    out_all = []
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        for row in out[:, width:].tolist():
            out_all.append(row[: row.index(eos)] if eos in row else row)
    return out_all


def test_engine_greedy_accuracy_equals_hf_generate(tiny_model_dir, task):
    examples = task.examples("eval")[:40]
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = tokenize_prompts(tokenizer, task.config, examples)
    cfg = EvalConfig(max_new_tokens=12, batch_size=16)  # 40 prompts through 16 slots
    engine = make_eval_engine(
        ModelConfig(path=tiny_model_dir), cfg, max(map(len, prompts)), torch.device("cpu")
    )
    # Weights other than the engine's starting ones, so the evaluation must load them.
    torch.manual_seed(3)
    hf = load_model(ModelConfig(path=tiny_model_dir)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    engine.load_weights({k: v.clone() for k, v in hf.state_dict().items()}, version=7)
    assert engine.version == 7

    ours = greedy_completions(engine, prompts, cfg.max_new_tokens)
    ref = hf_greedy_completions(hf, tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size)
    assert ours == ref
    # Some completions stop at EOS and some run to the budget, so both endings are checked.
    lengths = {len(c) for c in ours}
    assert cfg.max_new_tokens in lengths and len(lengths) > 1

    accuracy = greedy_accuracy(engine, tokenizer, task, examples, cfg.max_new_tokens)
    scores = [
        task.score(ex, tokenizer.decode(r, skip_special_tokens=True))
        for ex, r in zip(examples, ref)
    ]
    # A completion without EOS has all max_new_tokens tokens (EOS is stripped): truncated.
    truncated = sum(len(r) == cfg.max_new_tokens for r in ref) / len(ref)
    lengths = sorted(map(len, ref))
    assert accuracy == {
        "eval/accuracy": sum(s >= 1.0 - 1e-6 for s in scores) / len(scores),
        "eval/reward": sum(scores) / len(scores),
        "eval/completion_tokens": sum(lengths) / len(ref),
        "eval/truncated_frac": truncated,
        "eval/length/p10": lengths[round(0.1 * (len(ref) - 1))],
        "eval/length/p50": lengths[round(0.5 * (len(ref) - 1))],
        "eval/length/p90": lengths[round(0.9 * (len(ref) - 1))],
        "eval/length/p99": lengths[round(0.99 * (len(ref) - 1))],
        "eval/reward_errors": 0.0,
    }
    assert not engine.running and engine.free_slots == cfg.batch_size  # nothing left behind

    # A reward function that raises scores 0 and is counted; the evaluation goes on.
    class Failing:
        config = task.config

        def score(self, example, completion):
            raise ZeroDivisionError("a user's reward term")

    errors = greedy_accuracy(engine, tokenizer, Failing(), examples, cfg.max_new_tokens)
    assert errors["eval/reward_errors"] == len(examples) and errors["eval/reward"] == 0.0
    engine.close()
