"""The asynchronous loop end to end through the real launcher: buffer, generator and
trainer processes for a few steps. Versions advance at the trainer, at the generators
and on the consumed tokens, and the loss is finite. The generator logs its own figures
(tokens/s, idle fraction, step times during weight updates and steady) and
``tools/run_report.py`` turns the run directory into one line of sensible figures."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.launcher.prepare import stage_chain
from asyncrl.metrics import read_metrics
from asyncrl.models import ModelConfig, load_model
from tests.runs import ROOT, short_grpo_command, trained_steps, wait_for


@pytest.mark.parametrize("max_staleness", ["2", pytest.param("0", marks=pytest.mark.slow)])
def test_launcher_runs_tiny_grpo(tmp_path, tiny_model_dir, max_staleness):
    """η = 2 also runs the KL-to-reference and entropy terms and checks the HF export."""
    run_dir = tmp_path / "run"
    extra = ["rl.loss.kl_coef=0.05", "rl.loss.entropy_coef=0.01"] if max_staleness == "2" else []
    cmd = short_grpo_command(
        run_dir,
        tiny_model_dir,
        "rl.max_steps=4",
        "eval.every_steps=2",
        "eval.num_examples=8",
        f"buffer.max_staleness={max_staleness}",
        "metrics.tensorboard=true",  # the generator's own board is checked
        "num_generators=2",
        *extra,
    )
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    records = [r for r in read_metrics(run_dir) if r["process"] == "trainer" and "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # trainer versions
    assert all(math.isfinite(r["train/loss"]) for r in records)
    counters = json.loads((run_dir / "buffer_counters.json").read_text())
    assert counters["buffer/version"] == 4
    # Generators flipped to published weights. Not necessarily past v1: with η = 2 the
    # first versions' tokens may fill all four batches, and an idle generator flips late.
    assert counters["buffer/generator_version_max"] >= 1
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
        "generator_1.log",  # two generator processes, both logged
        "trainer_0.log",
    ]
    check_generator_metrics(run_dir)
    check_run_report(run_dir, consumed=4 * 2 * 4)


GENERATOR_KEYS = {
    f"generator/{k}"
    for k in (
        "window_s",
        "tokens",
        "tokens_per_s",
        "idle_s",
        "idle_fraction",
        "steps",
        "update_steps",
        "weights_received",
        "version",
    )
}


def check_generator_metrics(run_dir: Path) -> None:
    lines = [r for r in read_metrics(run_dir) if r["process"] == "generator_g0"]
    assert lines and all(r.keys() >= GENERATOR_KEYS for r in lines), lines
    assert all(0.0 <= r["generator/idle_fraction"] <= 1.0 for r in lines)
    assert sum(r["generator/tokens"] for r in lines) > 0
    assert any("generator/update_step_ms_p99" in r for r in lines)  # flips happened mid-decode
    assert (run_dir / "tb" / "generator_g0").is_dir()
    summary = json.loads((run_dir / "generator_g0_summary.json").read_text())
    # Published versions reached it; how many by the end is timing (the run stops when
    # the trainer's fourth step ends, and η = 2 lets early versions feed every batch).
    assert summary["weights_received"] >= 1 and summary["version"] >= 1
    # Every flip happens inside an engine step, so at least one update step per flipped
    # version; a version superseded before it was staged is received but never flipped.
    assert summary["update_steps"] >= summary["weights_flipped"] >= 1
    assert summary["steps"] > summary["update_steps"]
    assert 0 < summary["steady_step_ms_p50"] <= summary["steady_step_ms_p99"]
    assert 0 < summary["update_step_ms_p50"] <= summary["update_step_ms_p99"]
    # Means over different sets (a version superseded before its flip is staged, never
    # flipped): no order between them is guaranteed, only that both were measured.
    for key in ("weight_stage_s", "weight_flip_s"):
        assert math.isfinite(summary[key]) and summary[key] >= 0, (key, summary[key])


def check_run_report(run_dir: Path, consumed: int) -> None:
    proc = subprocess.run(
        [sys.executable, "tools/run_report.py", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = proc.stdout.splitlines()
    report = json.loads(line)
    assert report["steps"] == 4 and report["wall_time_s"] >= report["train_time_s"] > 0
    assert report["generated_tokens_per_s"] > 0 and report["train_step_tokens_per_s"] > 0
    assert 0.0 <= report["generator_idle_fraction"] <= 1.0
    assert 0.0 <= report["trainer_idle_fraction"] <= 1.0
    assert report["step_ms_p99_update"] > 0 and report["step_ms_p99_steady"] > 0
    assert sum(report["staleness_histogram"].values()) == consumed
    assert report["accuracy_at_min"]["0"] is not None  # the initial evaluation


@pytest.mark.slow  # CI kills generators in tests/test_chaos.py's run
def test_a_killed_generator_is_restarted_and_catches_up(tmp_path, tiny_model_dir):
    """SIGKILL the only generator mid-run: the launcher restarts it from ``model.path``
    (version 0), the trainer republishes its newest weights while it waits for a batch,
    and the run finishes every step (without the republish it would wait forever)."""
    run_dir = tmp_path / "run"
    steps = 10
    cmd = short_grpo_command(
        run_dir,
        tiny_model_dir,
        f"rl.max_steps={steps}",
        "time_limit_s=600",  # the test waits up to 360 s; the limit only bounds a broken run
        "task.rl_split=train",
        "buffer.max_staleness=1",
        "num_generators=1",
    )
    launcher = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(lambda: trained_steps(run_dir) >= 3, 120, "the trainer's step 3", 0.2)
        pids = subprocess.run(
            ["pgrep", "-f", f"asyncrl.generator.worker --config {run_dir}/"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(pids) == 1, pids
        os.kill(int(pids[0]), signal.SIGKILL)
        out, _ = launcher.communicate(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, out[-3000:]
    assert "restart" in out.lower(), out[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
    counters = json.loads((run_dir / "buffer_counters.json").read_text())
    # The restarted generator received the republished weights and kept up with versions.
    assert counters["buffer/generator_version_min"] >= steps - 2


def test_the_chain_runs_missing_stages_first_and_each_once(tmp_path, monkeypatch):
    """tiny_chain needs the SFT policy and the reward model (which needs the SFT policy
    too); the outputs are relative to the working directory, so an empty one needs all."""
    monkeypatch.chdir(tmp_path)
    chain_file = str(ROOT / "experiments" / "tiny_chain.py")
    # The reward model's backbone (tiny_sft_2k) is another SFT run; its pairs come from
    # tiny_sft, which runs once.
    everything = ["tiny_sft", "tiny_sft_2k", "tiny_rm", "tiny_chain"]
    assert [c.name for c in stage_chain(chain_file, [])] == everything
    Path("runs/models/tiny-sft").mkdir(parents=True)
    assert [c.name for c in stage_chain(chain_file, [])] == ["tiny_sft_2k", "tiny_rm", "tiny_chain"]
    Path("runs/models/tiny-sft-2k").mkdir(parents=True)
    assert [c.name for c in stage_chain(chain_file, [])] == ["tiny_rm", "tiny_chain"]
    Path("runs/models/tiny-rm").mkdir(parents=True)
    assert [c.name for c in stage_chain(chain_file, [])] == ["tiny_chain"]
    # With the verifier as the reward, the reward model is no prerequisite.
    assert [c.name for c in stage_chain(chain_file, ["reward.source=verifier"])] == ["tiny_chain"]


def test_sigterm_to_the_launcher_stops_every_process(tmp_path, tiny_model_dir):
    """A batch system (or ``kill``) ends a run with SIGTERM: the launcher stops the buffer,
    the generator and the trainer too, instead of leaving them running."""
    run_dir = tmp_path / "run"
    cmd = short_grpo_command(
        run_dir,
        tiny_model_dir,
        "rl.max_steps=100000",
        "time_limit_s=600",  # the test stops it
        "task.rl_split=train",
    )
    launcher = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def running() -> list[str]:
        found = subprocess.run(
            ["pgrep", "-f", f"config {run_dir}/"], capture_output=True, text=True
        )
        return found.stdout.split()

    try:
        deadline = time.time() + 120
        while len(running()) < 3 or not (run_dir / "metrics.jsonl").exists():
            assert time.time() < deadline, "the run never started"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, out[-3000:]
    assert running() == []


@pytest.mark.slow
def test_launcher_runs_longtail_grpo(tmp_path, tiny_model_dir):
    """The long-tail experiment end to end, briefly: its length figures reach the metrics,
    and nothing is generated for leases revoked from a live holder."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "launch/local.py",
        "experiments/longtail_grpo.py",
        f"run_dir={run_dir}",
        f"model.path={tiny_model_dir}",
        "rl.max_steps=3",
        "eval.every_steps=3",
        "eval.num_examples=4",
        "eval.max_new_tokens=24",
        "sampling.max_new_tokens=24",
        "task.train_size=200",
        "buffer.prompts_per_batch=2",
        "buffer.dynamic_sampling=false",
        "engine.embedded.max_slots=8",
        "transport.heartbeat_s=0.2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [r for r in read_metrics(run_dir) if r["process"] == "trainer" and "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["length/samples"] == 8 and 0 < r["length/p50"] <= 24 for r in steps)
    assert all("train/overlong_filtered_samples" in r for r in steps)
    counters = json.loads((run_dir / "buffer_counters.json").read_text())
    assert counters["buffer/tokens_revoked_alive"] == 0
    assert counters["buffer/completion_tokens_consumed"] > 0
