"""The image chain's SFT stage from the launcher (a short smoke run of the entry point):
per-category held-out success in the metrics at every evaluation, a picture grid as PNG
and in TensorBoard, and an exported policy that loads; a setting it cannot run is refused
before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from asyncrl.config import ConfigError, apply_overrides, load_experiment
from asyncrl.image.model import ImagePolicy
from asyncrl.image.scenes import CATEGORIES
from asyncrl.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.layers=1", "model.heads=2", "model.head_dim=16", "model.text_dim=32"]


def test_a_short_image_sft_run_judges_shows_and_exports(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        *[sys.executable, "launch/local.py", "experiments/image_sft.py", f"run_dir={run_dir}"],
        *["sft.max_steps=4", "sft.batch_size=8", f"sft.export_dir={run_dir}/policy"],
        *["eval.every_steps=2", "eval.num_scenes=8", "eval.steps=4", *TINY],
        "metrics.progress_bar=false",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    evals = [r for r in read_metrics(run_dir) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all({f"eval/success_{c}" for c in CATEGORIES} <= r.keys() for r in evals)
    losses = [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert losses and all(0 < x < 10 for x in losses)
    pngs = sorted((run_dir / "images").glob("trainer_eval_pictures_*.png"))
    assert len(pngs) == 3 and Image.open(pngs[-1]).size == (8 * 129, 129)
    assert list((run_dir / "tb" / "trainer").glob("events.*"))
    ImagePolicy.load(run_dir / "policy")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and "eval/success_position" in summary["final_eval"]


def test_more_than_one_rank_is_refused_before_any_process(tmp_path):
    cfg = load_experiment(ROOT / "experiments" / "image_sft.py")
    cfg = apply_overrides(cfg, [f"run_dir={tmp_path}", "trainer.num_ranks=2"])
    with pytest.raises(ConfigError, match="trainer.num_ranks=2: the image stages train on one"):
        cfg.finalize()


def test_every_seed_and_stage_judges_the_same_held_out_scenes():
    """The held-out scenes are ``eval.seed``'s, not the run's: seeds of a study compare
    policies on one set of scenes."""
    from asyncrl.stages.image_sft import held_out_scenes

    runs = [
        load_experiment(ROOT / "experiments" / f"{name}.py")
        for name in ("image_sft", "image_grpo", "image_dpo")
    ]
    for cfg in runs:
        apply_overrides(cfg, ["seed=7"])
    scenes = [held_out_scenes(cfg.eval) for cfg in runs]
    assert (
        scenes[0]
        == scenes[1]
        == scenes[2]
        == held_out_scenes(load_experiment(ROOT / "experiments" / "image_grpo.py").eval)
    )
    other = load_experiment(ROOT / "experiments" / "image_grpo.py")
    apply_overrides(other, ["eval.seed=1"])
    assert held_out_scenes(other.eval) != scenes[0]
