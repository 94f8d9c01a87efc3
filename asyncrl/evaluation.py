"""Held-out evaluation: greedy accuracy of a policy on a task's eval split.

Runs on one process (trainer rank 0) through an embedded engine of its own (docs/design.md,
Engines), so sharded trainer ranks never step a decode loop in lockstep. The stages' engine
holds no weights and no KV cache between evaluations; each evaluation lends it the gathered
weights (``holding_weights``: the engine adopts the tensors, so rank 0 holds one unsharded
copy, only while it evaluates), then submits every prompt at temperature 0 (greedy) and lets
continuous batching run them through ``batch_size`` slots. Prompts are tokenized as the
generators tokenize them (no special tokens added). The test pins it to transformers' greedy
``generate``, its former path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerFast

from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.stops import text_until_stop
from asyncrl.interfaces import SharedEngine
from asyncrl.models import ModelConfig
from asyncrl.tasks import Example, Task, TaskConfig
from asyncrl.tasks.base import score_or_error
from asyncrl.tasks.prompts import PromptRenderer

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    every_steps: int = 50
    """Evaluate every this many optimizer steps (and at the start and the end); 0 disables."""
    num_examples: int = 200
    """Held-out examples per evaluation (the first N of the eval split)."""
    max_new_tokens: int = 16
    """Generation budget per completion."""
    batch_size: int = 100
    """Prompts decoded together (the evaluation engine's KV-cache slots)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, as ``SamplingConfig.stop``: a completion ends at the first token whose
    text contains one, and the text scored is cut at it. Set here, like ``max_new_tokens``,
    since SFT and DPO have no sampling config; an RL experiment evaluates as it samples by
    giving it the same strings as ``sampling.stop``."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion besides EOS, as ``SamplingConfig.stop_token_ids``."""
    keep_stop_text: bool = False
    """Whether the text scored keeps the stop string or stop token's text, as
    ``SamplingConfig.keep_stop_text``."""


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerFast, task_cfg: TaskConfig, examples: Sequence[Example]
) -> list[list[int]]:
    """The examples' prompts rendered as every stage renders them (``PromptRenderer``)."""
    renderer = PromptRenderer.for_task(task_cfg, tokenizer)
    return [renderer.prompt_ids(ex) for ex in examples]


def make_eval_engine(
    model: ModelConfig,
    cfg: EvalConfig,
    longest_prompt: int,
    device: torch.device,
    budget: int | None = None,
    *,
    released: bool = False,
) -> SharedEngine:
    """An engine sized for evaluation: ``batch_size`` slots, each as long as the longest
    prompt plus the generation budget (``cfg.max_new_tokens``, or a whole episode's), so
    no completion is cut short by the cache. ``released``: with no weights or cache until
    ``holding_weights`` lends them (else with the weights at ``model.path``)."""
    engine_cfg = EmbeddedEngineConfig(
        max_slots=cfg.batch_size,
        max_seq_len=longest_prompt + (cfg.max_new_tokens if budget is None else budget),
        device="cuda" if device.type == "cuda" else "cpu",
        dtype=model.dtype,
    )
    return EmbeddedEngine(model.path, engine_cfg, released=released)


@contextmanager
def holding_weights(
    engine: SharedEngine, state_dict: Mapping[str, torch.Tensor], version: int
) -> Iterator[SharedEngine]:
    """``engine`` with the weights of ``state_dict`` (its tensors adopted, not copied) and
    its KV cache for the span of the block, both released after it."""
    engine.load_weights(state_dict, version)
    engine.resume_memory()
    try:
        yield engine
    finally:
        engine.release_memory()


def greedy_completions(
    engine: SharedEngine, prompts: Sequence[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy completion token ids of each prompt, without the final EOS."""
    return greedy_generate(engine, prompts, max_new_tokens)[0]


def greedy_generate(
    engine: SharedEngine,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    *,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
) -> tuple[list[list[int]], list[str]]:
    """Greedy completion token ids of each prompt (without the final EOS; with the token
    that completed a stop string or was a stop token), and each one's finish reason
    ("length" when it was cut at ``max_new_tokens``, "stop" at a stop)."""
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
    )
    requests = [Request(f"eval-{i}", list(p), params) for i, p in enumerate(prompts)]
    tokens, reasons = decode_all(engine, requests)
    for ids, reason in zip(tokens, reasons):
        if reason == "eos":
            ids.pop()
    return tokens, reasons


def decode_all(
    engine: SharedEngine, requests: Sequence[Request]
) -> tuple[list[list[int]], list[str]]:
    """Submit ``requests`` and step ``engine`` until each has finished; each one's
    generated token ids (a final EOS included) and finish reason, in request order."""
    for request in requests:
        engine.submit(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str] = {}
    while len(reasons) < len(tokens):
        out = engine.step()
        for t in out.tokens:
            tokens[t.request_id].append(t.token_id)
        for f in out.finished:
            reasons[f.request_id] = f.reason
    return [tokens[r.request_id] for r in requests], [reasons[r.request_id] for r in requests]


def greedy_accuracy(
    engine: SharedEngine,
    tokenizer: PreTrainedTokenizerFast,
    task: Task,
    examples: Sequence[Example],
    max_new_tokens: int,
    *,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    keep_stop_text: bool = False,
) -> dict[str, float]:
    """Fraction of greedy completions with full marks, mean reward, completion length in
    tokens (mean and p10/p50/p90/p99) and the fraction cut at ``max_new_tokens``, under the
    weights ``engine`` holds now. Completions end at the stop strings and tokens
    (``EvalConfig.stop``…), and the text scored is cut there as the buffer's scoring cuts
    it (``asyncrl.engine.stops``)."""
    prompts = tokenize_prompts(tokenizer, task.config, examples)
    completions, reasons = greedy_generate(
        engine, prompts, max_new_tokens, stop=stop, stop_token_ids=stop_token_ids
    )

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    texts = [
        text_until_stop(decode, ids, stop, stop_token_ids, keep_stop_text) for ids in completions
    ]
    # A reward that raises scores 0, counted, as in the reward pool (logged once a call).
    scored = [score_or_error(task, ex, text) for ex, text in zip(examples, texts)]
    scores = [reward for reward, _ in scored]
    errors = [(ex.uid, error) for ex, (_, error) in zip(examples, scored) if error]
    if errors:
        log.warning(
            "eval reward failed on %d completions, first on %s: %s", len(errors), *errors[0]
        )
    n = max(len(scores), 1)
    # Some verifiers give partial credit to well-formed wrong answers; accuracy counts
    # only full marks, the mean reward keeps the partial credit.
    correct = sum(1 for s in scores if s >= 1.0 - 1e-6)
    return {
        "eval/accuracy": correct / n,
        "eval/reward": sum(scores) / n,
        "eval/completion_tokens": sum(len(c) for c in completions) / n,
        "eval/truncated_frac": sum(r == "length" for r in reasons) / n,
        "eval/reward_errors": float(len(errors)),
    } | length_percentiles("eval/length", [len(c) for c in completions])


def length_percentiles(prefix: str, lengths: Sequence[int]) -> dict[str, float]:
    """``{prefix}/p10`` … ``{prefix}/p99`` of ``lengths`` (nearest-rank); empty when none."""
    if not lengths:
        return {}
    ordered = sorted(lengths)
    last = len(ordered) - 1
    return {f"{prefix}/p{q}": float(ordered[round(q / 100 * last)]) for q in (10, 50, 90, 99)}
