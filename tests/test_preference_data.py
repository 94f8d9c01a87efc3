"""Tests for asyncrl.stages.preference_data and its CLI: pairs are graded the right way
round, eval pairs are held out, the data is a pure function of the seed, the stored text
tokenizes back to the generated ids, and the rows load as the jsonl preference kind.

A random-init tiny model almost never answers arithmetic correctly, so the runs grade
with ``_ParityVerifier``: the real task, except that a completion of even length earns
full marks. Random completions then split into both grades, and a pair the wrong way
round fails the tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.engine.base import SamplingParams
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.models import load_tokenizer
from asyncrl.stages import preference_data
from asyncrl.stages.preference_data import (
    PreferenceDataConfig,
    make_preference_data,
    preference_pairs,
    sample_completions,
)
from asyncrl.tasks import DataError, TaskConfig, build_task, load_jsonl

ROOT = Path(__file__).resolve().parents[1]
TASK_CFG = TaskConfig(train_size=200, eval_size=6, unseen_candidates=300)


class _ParityVerifier:
    """The task of ``cfg``, graded on the completion's length: even earns full marks."""

    def __init__(self, cfg: TaskConfig) -> None:
        self.task = build_task(cfg)
        self.config, self.name = cfg, self.task.name

    def examples(self, split):
        return self.task.examples(split)

    def score(self, example, completion: str) -> float:
        return 1.0 if len(completion) % 2 == 0 else 0.25  # partial credit is not correct


def _config(tmp_path: Path, seed: int = 0) -> PreferenceDataConfig:
    return PreferenceDataConfig(
        train_path=str(tmp_path / "prefs" / "train.jsonl"),
        eval_path=str(tmp_path / "prefs" / "eval.jsonl"),
        train_prompts=5,
        samples_per_prompt=6,
        max_new_tokens=6,
        max_pairs_per_prompt=2,
        seed=seed,
        max_slots=7,  # fewer than a split's requests: they go through the engine in waves
    )


@pytest.fixture
def parity(monkeypatch):
    monkeypatch.setattr(preference_data, "build_task", _ParityVerifier)


def test_pairs_zip_distinct_correct_with_distinct_incorrect():
    texts = ["a", "b", "a", "c", "d", "e", "b"]
    scores = [1.0, 0.0, 1.0, 1.0 - 1e-7, 0.9, 1.0, 0.0]
    # correct: a, c, e (a repeated once); incorrect: b, d (b repeated once)
    assert preference_pairs(texts, scores, 5) == [("a", "b"), ("c", "d")]
    assert preference_pairs(texts, scores, 1) == [("a", "b")]
    assert preference_pairs(["a", "b"], [1.0, 1.0], 3) == []  # nothing to prefer against
    assert preference_pairs(["a", "b"], [0.0, 0.5], 3) == []


def test_all_pairing_meets_each_correct_with_each_incorrect():
    texts = ["a", "b", "a", "c", "d", "e", "b"]
    scores = [1.0, 0.0, 1.0, 1.0 - 1e-7, 0.9, 1.0, 0.0]
    # correct: a, c, e; incorrect: b, d
    pairs = [("a", "b"), ("c", "b"), ("e", "b"), ("a", "d"), ("c", "d"), ("e", "d")]
    assert preference_pairs(texts, scores, 10, "all") == pairs
    assert preference_pairs(texts, scores, 4, "all") == pairs[:4]
    assert preference_pairs(["a", "b"], [1.0, 1.0], 3, "all") == []


def test_rows_are_graded_pairs_with_held_out_eval_prompts(parity, tiny_model_dir, tmp_path):
    cfg = _config(tmp_path)
    stats = make_preference_data(tiny_model_dir, TASK_CFG, cfg)
    verifier, task = _ParityVerifier(TASK_CFG), build_task(TASK_CFG)
    train_rows, eval_rows = load_jsonl(cfg.train_path), load_jsonl(cfg.eval_path, "eval")
    assert train_rows and eval_rows
    by_prompt = {ex.prompt: ex for split in ("unseen", "eval") for ex in task.examples(split)}
    for row in train_rows + eval_rows:
        example = by_prompt[row.prompt]
        assert row.answer == example.answer and row.chosen != row.rejected
        assert verifier.score(example, row.chosen) == 1.0
        assert verifier.score(example, row.rejected) < 1.0
    unseen = [ex.prompt for ex in task.examples("unseen")[:5]]
    assert {r.prompt for r in train_rows} <= set(unseen)
    assert {r.prompt for r in eval_rows} <= {ex.prompt for ex in task.examples("eval")}
    assert not {r.prompt for r in eval_rows} & {r.prompt for r in train_rows}
    assert not set(unseen) & {ex.prompt for ex in task.examples("eval")}
    for name, rows, prompts in (("train", train_rows, 5), ("eval", eval_rows, 6)):
        s = stats[name]
        assert (s["prompts"], s["samples"], s["pairs"]) == (prompts, prompts * 6, len(rows))
        assert 0.0 < s["correct_fraction"] < 1.0
        per_prompt = max(sum(r.prompt == p for r in rows) for p in {r.prompt for r in rows})
        assert per_prompt <= cfg.max_pairs_per_prompt
    saved = json.loads((tmp_path / "prefs" / "train.stats.json").read_text())
    assert saved["train"] == stats["train"] and saved["eval"] == stats["eval"]
    assert not list((tmp_path / "prefs").glob("*.tmp*"))  # written through a rename


def test_same_seed_same_data_other_seed_other_data(parity, tiny_model_dir, tmp_path):
    files = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        cfg = _config(tmp_path / name, seed)
        make_preference_data(tiny_model_dir, TASK_CFG, cfg)
        files[name] = (Path(cfg.train_path).read_text(), Path(cfg.eval_path).read_text())
    assert files["a"] == files["b"]
    assert files["a"] != files["c"]


def test_stored_text_tokenizes_back_to_the_generated_ids(tiny_model_dir):
    """The RM stage trains on tokenize(text) + [eos], the buffer's RM scores the ids as
    generated: the two agree whenever no special token was generated mid-completion (the
    decode skips those), and the stats count the completions where they cannot."""
    tokenizer = load_tokenizer(tiny_model_dir)
    task = build_task(TASK_CFG)
    examples = list(task.examples("eval"))
    prompts = [tokenizer(ex.prompt, add_special_tokens=False)["input_ids"] for ex in examples] * 8
    params = [
        SamplingParams(max_new_tokens=8, temperature=1.0, seed=i) for i in range(len(prompts))
    ]
    engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=16, max_seq_len=64))
    try:
        completions = sample_completions(engine, prompts, params, max_queued=16)
    finally:
        engine.close()
    eos, special = tokenizer.eos_token_id, set(tokenizer.all_special_ids)
    graded = [preference_data.Graded(examples[0], [], [], [])]
    clean = 0
    for ids in completions:
        text = preference_data.completion_text(tokenizer, ids)
        graded[0].completions.append(ids)
        graded[0].texts.append(text)
        body = ids[:-1] if ids and ids[-1] == eos else ids
        if not special & set(body):
            assert tokenizer(text, add_special_tokens=False)["input_ids"] == body
            clean += 1
    assert clean >= len(completions) // 4 and any(ids[-1] == eos for ids in completions)
    assert preference_data._retokenize_mismatches(tokenizer, graded) == len(completions) - clean


def test_preference_rows_with_an_answer_load_and_other_mixes_still_fail(tmp_path):
    path = tmp_path / "prefs.jsonl"
    row = {"prompt": "1+1=", "chosen": " 2", "rejected": " 3", "answer": "2", "id": 4}
    path.write_text(json.dumps(row) + "\n")
    (example,) = load_jsonl(path)
    assert (example.chosen, example.rejected, example.answer, example.meta) == (
        " 2",
        " 3",
        "2",
        {"id": 4},
    )
    for extra in ({"completion": " 2"}, {"completion": " 2", "answer": None}):
        bad = {k: v for k, v in {**row, **extra}.items() if v is not None}
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(
            DataError, match=r"match no row kind; expected .*chosen, rejected\[, answer\]"
        ):
            load_jsonl(path)


def test_cli_writes_the_files_and_prints_the_counts(tiny_model_dir, tmp_path):
    out = tmp_path / "prefs"
    cmd = [
        sys.executable,
        "tools/make_preference_data.py",
        "--policy",
        tiny_model_dir,
        "--experiment",
        "experiments/tiny_sft.py",
        "--out-dir",
        str(out),
        "--train-prompts",
        "3",
        "--samples-per-prompt",
        "3",
        "--max-new-tokens",
        "4",
        "--threads",
        "1",
        "task.train_size=200",
        "task.eval_size=4",
        "task.unseen_candidates=300",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (stats["train"]["samples"], stats["eval"]["samples"]) == (9, 12)
    assert (out / "train.jsonl").exists() and (out / "eval.jsonl").exists()
    assert json.loads((out / "train.stats.json").read_text())["train"] == stats["train"]
