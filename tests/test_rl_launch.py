"""The asynchronous loop end to end through the real launcher: buffer, generator and
trainer processes for a few steps. Versions advance at the trainer, at the generators
and on the consumed tokens, and the loss is finite."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics
from asyncrl.models import ModelConfig, load_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("max_staleness", ["2", "0"])
def test_launcher_runs_tiny_grpo(tmp_path, tiny_model_dir, max_staleness):
    """η = 2 also runs the KL-to-reference and entropy terms and checks the HF export."""
    run_dir = tmp_path / "run"
    extra = ["rl.loss.kl_coef=0.05", "rl.loss.entropy_coef=0.01"] if max_staleness == "2" else []
    cmd = [
        sys.executable, "launch/local.py", "experiments/tiny_grpo.py", f"run_dir={run_dir}",
        f"model.path={tiny_model_dir}", "rl.max_steps=4", "eval.every_steps=2", "eval.num_examples=8",
        "task.train_size=200", "buffer.prompts_per_batch=2", "buffer.samples_per_prompt=4",
        "buffer.dynamic_sampling=false", f"buffer.max_staleness={max_staleness}", "engine.max_slots=8",
        "transport.heartbeat_s=0.2",
    ] + extra  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    records = [r for r in read_metrics(run_dir) if r["process"] == "trainer" and "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # trainer versions
    assert all(math.isfinite(r["train/loss"]) for r in records)
    counters = json.loads((run_dir / "buffer_counters.json").read_text())
    assert counters["buffer/version"] == 4
    assert counters["buffer/generator_version_max"] >= 2  # generators flipped to published weights
    assert (
        counters["buffer/newest_consumed_version"] >= 1
    )  # tokens made by updated weights were trained on
    assert counters["buffer/samples_consumed"] == 4 * 2 * 4
    if max_staleness == "0":
        # The synchronous baseline: every consumed token is exactly as old as its step.
        assert {k for k in counters if k.startswith("buffer/staleness_")} == {"buffer/staleness_0"}
    if extra:
        assert all("train/kl_reference" in r and "train/entropy" in r for r in records)
        assert load_model(ModelConfig(path=summary["export_dir"])).config.model_type == "qwen2"
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "buffer.log",
        "generator_0.log",
        "trainer_0.log",
    ]
