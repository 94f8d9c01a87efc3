"""Preference data from a policy: sample it on a task's prompts, grade the samples with
the task's verifier, and pair correct completions (chosen) against incorrect ones
(rejected), for the reward-model and DPO stages.

Sampling goes through asyncrl's ``EmbeddedEngine`` with the generators' tokenization
(prompt ids without special tokens), each request seeded from (seed, split, prompt,
sample) so the data does not depend on how requests are batched. A completion's text is
``completion_text``: the buffer's own decode (final EOS dropped, special tokens skipped),
so the RM stage, which trains on ``tokenize(text) + [eos]``, sees what the buffer's
reward model will score. Train pairs come from ``prompt_split``, eval pairs from the
task's "eval" split, with any eval prompt that also occurs among the train prompts
dropped. Rows ``{"prompt", "chosen", "rejected", "answer"}`` load with
``asyncrl.tasks.jsonl.load_jsonl``.

    python tools/make_preference_data.py --policy runs/models/tiny-sft --out-dir runs/data/tiny-prefs
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from asyncrl.buffer.reward_model import completion_text
from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.evaluation import tokenize_prompts
from asyncrl.models import load_tokenizer
from asyncrl.tasks import Example, Task, TaskConfig, build_task

log = logging.getLogger(__name__)

FULL_MARKS = 1.0 - 1e-6
"""A completion is correct at this score or above (evaluation's accuracy uses the same)."""
_SPLIT_SEED = {"train": 0, "eval": 1, "unseen": 2}


@dataclass
class PreferenceDataConfig:
    train_path: str
    """JSONL output of the train pairs (from ``prompt_split``)."""
    eval_path: str
    """JSONL output of the eval pairs (from the task's "eval" split)."""
    policy: str = ""
    """HF directory of the policy the pairs are sampled from; empty means the stage's
    ``model.path``. A reward model may start from another backbone than the policy whose
    samples it will score."""
    policy_experiment: str = ""
    """Experiment file whose run writes ``policy``; the launchers run it first when the
    pairs and ``policy`` are both missing."""
    prompt_split: Literal["train", "unseen"] = "unseen"
    """Task split the train pairs' prompts come from. "unseen" (reasoning_gym) keeps them
    off the SFT problems, which the policy may have memorized; jsonl tasks need "train"."""
    train_prompts: int = 0
    """Prompts taken from ``prompt_split`` (its first N); 0 takes all of it."""
    samples_per_prompt: int = 8
    """Completions sampled per prompt, in both splits."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy, which makes every sample of a prompt the same."""
    max_new_tokens: int = 8
    """Tokens generated per completion at most."""
    max_pairs_per_prompt: int = 2
    """Pairs kept per prompt at most."""
    train_pairing: Literal["zip", "all"] = "zip"
    """How a train prompt's distinct correct and incorrect completions pair up: ``zip``
    uses each completion once; ``all`` pairs every correct one with every incorrect one
    (InstructGPT's all comparisons of a prompt), so the one right answer of a prompt meets
    each distinct wrong one. Eval pairs are always zipped: one pair per prompt, mostly."""
    seed: int = 0
    """Seed of the samples."""
    threads: int = 0
    """torch intra-op threads (``torch.set_num_threads``, process-wide); 0 leaves torch's."""
    max_slots: int = 64
    """Sequences the engine decodes together (KV-cache slots)."""


@dataclass
class Graded:
    """The samples of one prompt, graded; lists line up by sample."""

    example: Example
    completions: list[list[int]]
    """Generated ids, ending with EOS when generation did."""
    texts: list[str]
    scores: list[float]


def preference_pairs(
    texts: Sequence[str], scores: Sequence[float], max_pairs: int, pairing: str = "zip"
) -> list[tuple[str, str]]:
    """(chosen, rejected) pairs of one prompt, at most ``max_pairs``, from its distinct
    correct texts (full marks) and its distinct incorrect texts, each in sample order.
    ``zip`` pairs them in order, using each completion once, so pairs of a prompt are not
    near copies of each other; ``all`` takes every (correct, incorrect) combination, in
    sample order of the incorrect one first. A prompt with no correct or no incorrect
    sample gives none."""
    correct = list(dict.fromkeys(t for t, s in zip(texts, scores) if s >= FULL_MARKS))
    incorrect = list(dict.fromkeys(t for t, s in zip(texts, scores) if s < FULL_MARKS))
    if pairing == "all":
        pairs = [(c, r) for r in incorrect for c in correct]
    else:
        pairs = list(zip(correct, incorrect))
    return pairs[: max(0, max_pairs)]


def sample_seed(seed: int, split: str, prompt: int, sample: int) -> int:
    """The seed of one request: a pure function of where it sits, not of its batch."""
    entropy = [seed, _SPLIT_SEED[split], prompt, sample]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def sample_completions(
    engine: EmbeddedEngine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    max_queued: int,
) -> list[list[int]]:
    """Generated ids of request i = (prompts[i], params[i]), with the final EOS kept.
    Requests are fed as slots free up (at most ``max_queued`` waiting), so a split of
    many thousands of prompts never sits in the engine's queue at once."""
    todo = deque(range(len(prompts)))
    tokens: dict[str, list[int]] = {}
    running = 0
    while todo or running:
        while todo and len(engine.waiting) < max_queued:
            i = todo.popleft()
            engine.submit(Request(str(i), list(prompts[i]), params[i]))
            tokens[str(i)] = []
            running += 1
        out = engine.step()
        for t in out.tokens:
            tokens[t.request_id].append(t.token_id)
        running -= len(out.finished)
    return [tokens[str(i)] for i in range(len(prompts))]


def grade_split(
    engine: EmbeddedEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: Sequence[Example],
    split: str,
    cfg: PreferenceDataConfig,
) -> list[Graded]:
    """Sample ``cfg.samples_per_prompt`` completions of each example and grade each one
    with the task's verifier."""
    n = cfg.samples_per_prompt
    prompt_ids = tokenize_prompts(tokenizer, task.config, examples)
    prompts = [prompt_ids[i] for i in range(len(examples)) for _ in range(n)]
    params = [
        SamplingParams(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            seed=sample_seed(cfg.seed, split, i, j),
        )
        for i in range(len(examples))
        for j in range(n)
    ]
    completions = sample_completions(engine, prompts, params, cfg.max_slots)
    graded = []
    for i, ex in enumerate(examples):
        ids = completions[i * n : (i + 1) * n]
        texts = [completion_text(tokenizer, c) for c in ids]
        graded.append(Graded(ex, ids, texts, [float(task.score(ex, t)) for t in texts]))
    return graded


def _rows(graded: list[Graded], max_pairs: int, pairing: str) -> list[dict[str, str]]:
    rows = []
    for g in graded:
        for chosen, rejected in preference_pairs(g.texts, g.scores, max_pairs, pairing):
            row = {"prompt": g.example.prompt, "chosen": chosen, "rejected": rejected}
            if g.example.answer is not None:  # a (prompt, chosen, rejected) row without it
                row["answer"] = g.example.answer
            rows.append(row)
    return rows


def _retokenize_mismatches(tokenizer: PreTrainedTokenizerBase, graded: list[Graded]) -> int:
    """Completions whose text does not tokenize back to their ids (EOS aside): where the
    RM stage would train on other ids than the buffer scores (e.g. a generated special
    token that the decode skips)."""
    eos = tokenizer.eos_token_id
    bad = 0
    for g in graded:
        for ids, text in zip(g.completions, g.texts):
            ids = ids[:-1] if ids and ids[-1] == eos else ids
            bad += tokenizer(text, add_special_tokens=False)["input_ids"] != ids
    return bad


def split_stats(tokenizer: PreTrainedTokenizerBase, graded: list[Graded], rows: list) -> dict:
    scores = [s for g in graded for s in g.scores]
    return {
        "prompts": len(graded),
        "samples": len(scores),
        "correct_fraction": sum(s >= FULL_MARKS for s in scores) / max(len(scores), 1),
        "pairs": len(rows),
        "prompts_with_pairs": len({r["prompt"] for r in rows}),
        "retokenize_mismatches": _retokenize_mismatches(tokenizer, graded),
    }


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Write ``rows`` to ``path`` atomically (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def stats_path(cfg: PreferenceDataConfig) -> Path:
    """Where the counts go: beside the train file, ``<name>.stats.json``."""
    return Path(cfg.train_path).with_suffix(".stats.json")


def make_preference_data(policy_dir: str, task_cfg: TaskConfig, cfg: PreferenceDataConfig) -> dict:
    """Sample ``policy_dir`` on the task, write the train and eval pairs, and return the
    counts per split (also written to ``stats_path(cfg)``)."""
    start = time.time()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    task = build_task(task_cfg)
    tokenizer = load_tokenizer(policy_dir)
    train = task.examples(cfg.prompt_split)
    train = [train[i] for i in range(min(cfg.train_prompts or len(train), len(train)))]
    # Held out must be held out: an eval prompt among the train prompts is dropped.
    train_prompts = {ex.prompt for ex in train}
    evals = [ex for ex in task.examples("eval") if ex.prompt not in train_prompts]
    longest = max(len(ids) for ids in tokenize_prompts(tokenizer, task_cfg, [*train, *evals]))
    engine_cfg = EmbeddedEngineConfig(
        max_slots=cfg.max_slots, max_seq_len=longest + cfg.max_new_tokens
    )
    engine = EmbeddedEngine(policy_dir, engine_cfg)
    stats: dict = {"policy": policy_dir, "task": task.name, "prompt_split": cfg.prompt_split}
    try:
        for name, split, examples, path in (
            ("train", cfg.prompt_split, train, cfg.train_path),
            ("eval", "eval", evals, cfg.eval_path),
        ):
            graded = grade_split(engine, tokenizer, task, examples, split, cfg)
            rows = _rows(
                graded, cfg.max_pairs_per_prompt, cfg.train_pairing if name == "train" else "zip"
            )
            if not rows:
                log.warning(
                    "no %s pairs: no prompt had both a correct and an incorrect sample", name
                )
            write_jsonl(path, rows)
            stats[name] = split_stats(tokenizer, graded, rows)
    finally:
        engine.close()
    stats["seconds"] = round(time.time() - start, 3)
    out = stats_path(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stats, indent=2) + "\n")
    return stats
