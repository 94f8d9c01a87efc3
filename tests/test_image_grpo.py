"""Asynchronous Flow-GRPO through the real processes (``experiments/image_grpo.py`` on a
small image policy): the buffer, an image generator and the trainer, pictures streamed
step by step with their frames, weights published as buckets; and a chaos run whose
generators are killed mid-picture loses no sample and trains none twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.image.frames import prompt_ids, to_bytes
from asyncrl.image.model import ImageModelConfig, ImagePolicy
from asyncrl.launcher.prepare import resolve
from asyncrl.loop.pictures import PictureBatch
from asyncrl.metrics import read_metrics
from asyncrl.report import report
from asyncrl.wire import Sample

from .test_chaos import run_chaos

ROOT = Path(__file__).resolve().parents[1]
SMALL = ImageModelConfig(layers=1, heads=2, head_dim=8, text_dim=16)
QUICK = [
    "image.steps=4",
    "rl.train_steps=2",
    "buffer.prompts_per_batch=2",
    "buffer.samples_per_prompt=2",
    "max_batch=4",
    "eval.num_scenes=8",
    "eval.shown=4",
    "eval.steps=4",
    "transport.heartbeat_s=0.2",
    "buffer.heartbeat_timeout_s=2",
]
"""The experiment small enough for seconds a step on two cores."""


@pytest.fixture(scope="module")
def small_policy(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("image") / "policy"
    ImagePolicy(SMALL).save(path)
    return path


def picture(group: int, index: int, reward: float, steps: int = 3, frames: int = 4) -> Sample:
    prompt = prompt_ids("two red squares")
    return Sample(
        prompt_id=0,
        group_id=group,
        sample_index=index,
        token_ids=prompt + list(range(steps)),
        logprobs=[0.0] * len(prompt) + [-1.0 - k for k in range(steps)],
        versions=[-1] * len(prompt) + [0] * (steps - 1) + [1],
        loss_mask=[0] * len(prompt) + [1] * steps,
        reward=reward,
        frames=to_bytes(torch.full((frames, 3, 32, 32), float(index))),
    )


def test_a_batch_of_pictures_has_its_steps_frames_and_group_advantages():
    samples = [picture(7, 0, 1.0), picture(7, 1, 0.0), picture(9, 0, 0.5), picture(9, 1, 0.5)]
    batch = PictureBatch.of(samples, steps=3)
    assert batch.prompts == ["two red squares"] * 4 and batch.frames.shape == (4, 4, 3, 32, 32)
    assert batch.behavior[0].tolist() == [-1.0, -2.0, -3.0]
    assert batch.versions[0].tolist() == [0, 0, 1] and batch.frames[1, 2, 0, 0, 0] == 1.0
    advantages = batch.advantages(scale_by_std=True)
    assert advantages[0] > 0 > advantages[1] and advantages[2:].abs().max() < 1e-6
    with pytest.raises(ValueError, match="sample 1 of group 3: 3 steps and 3 frames"):
        PictureBatch.of([picture(3, 1, 0.0, frames=3)], steps=3)
    with pytest.raises(ValueError, match="unequal sizes"):
        PictureBatch.of(samples[:3], steps=3).advantages(scale_by_std=False)


def test_trained_steps_must_lie_in_the_sde_window():
    resolve("experiments/image_grpo.py", ["image.sde_steps=4", "rl.train_steps=4"])
    with pytest.raises(ConfigError, match="rl.train_steps=4 must be 1 to the SDE steps .3"):
        resolve("experiments/image_grpo.py", ["image.sde_steps=3", "rl.train_steps=4"])


def test_async_flow_grpo_trains_on_streamed_pictures(small_policy, tmp_path):
    """Four versions at η = 1, so the generator must take each new version's weights:
    every batch whole groups of whole pictures (steps and frames), the buffer's books
    balanced, held-out success and picture grids at every evaluation."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "launch/local.py", "experiments/image_grpo.py", f"run_dir={run_dir}"]
    cmd += [f"model.path={small_policy}", "rl.max_steps=4", "eval.every_steps=2"]
    cmd += ["time_limit_s=240", "buffer.max_staleness=1", *QUICK]  # needs every version
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    assert (Path(summary["export_dir"]) / "image_model.json").exists()
    records = [r for r in read_metrics(run_dir) if r.get("process") == "trainer"]
    evals = [r["step"] for r in records if "eval/success_counting" in r]
    assert evals == [0, 2, 4]
    steps = [r for r in records if "rollout/reward" in r]
    assert len(steps) == 4 and all(0 <= r["rollout/reward"] <= 1 for r in steps)
    assert all(r["rollout/staleness_max"] <= 1 for r in steps)
    assert len(list((run_dir / "images").glob("*.png"))) == 3
    counters = json.loads((run_dir / "buffer_counters.json").read_text())
    assert counters["buffer/samples_consumed"] == 4 * 4
    assert counters.get("buffer/chunks_malformed", 0) == 0
    assert counters["buffer/completion_tokens_consumed"] == 16 * 4  # steps of 16 pictures
    ended = sum(counters.get(f"buffer/samples_{k}", 0) for k in ("consumed", "stale", "filtered"))
    assert counters["buffer/samples_created"] == ended + counters["buffer/in_flight_samples"]
    assert counters["buffer/newest_consumed_version"] >= 2  # the generator took new weights
    ledger = (run_dir / "ledger" / "rank0.jsonl").read_text().splitlines()
    assert len(ledger) == 4
    figures = report(str(run_dir), [0.0])  # tools/run_report.py reads image runs too
    assert figures["steps"] == 4 and sum(figures["staleness_histogram"].values()) == 16


def test_a_generator_killed_mid_picture_loses_nothing(small_policy, tmp_path):
    """``tools/chaos.py`` on the image chain: generators killed while they hold pictures
    part-way through their steps; the pictures are continued by the restarted generator
    from their streamed frames, and the ledger and the buffer agree that every consumed
    picture was trained on exactly once."""
    chaos_args = [
        *["--experiment", "experiments/image_grpo.py", "--minutes", "0.8", "--calm-s", "15"],
        *["--generator-kills", "2", "--trainer-kills", "0", "--buffer-kills", "0"],
        *["--generator-gap", "6", "--target", "0", "--seed", "3"],
    ]
    overrides = [f"model.path={small_policy}", "rl.max_steps=100000", "eval.every_steps=1000"]
    # A picture of many steps, each sent as it is taken: a kill lands mid-picture.
    longer = ["image.steps=16", "transport.chunk_tokens=1"]
    figures, context = run_chaos(tmp_path / "chaos", chaos_args, overrides + QUICK + longer)
    assert figures["kills"]["generator"] == 2 and figures["restarts"]["generator"] >= 2, context
    assert figures["samples_consumed"] > 0 and figures["accounting_holds"], context
    assert figures["lost"] == 0 and figures["duplicated"] == 0, context
    assert figures["leases_continued"] >= 1, context
