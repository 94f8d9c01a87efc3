"""The trainer changes its number of ranks at a checkpoint boundary: relaunched on the
same run directory with another ``trainer.num_ranks``, it reshards the model and the
optimizer from the checkpoint and goes on. Trained 2 → 1 → 2 ranks through the real
launcher, the weights match a run on 2 ranks throughout to float rounding: each step
trains the same global batch, only the order of the sums differs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def _sft(run_dir: Path, model_dir: str, ranks: int, steps: int) -> str:
    cmd = [
        sys.executable,
        "launch/local.py",
        "experiments/tiny_sft.py",
        f"run_dir={run_dir}",
        f"model.path={model_dir}",
        f"sft.export_dir={run_dir / 'hf'}",
        f"trainer.num_ranks={ranks}",
        f"sft.max_steps={steps}",
        "sft.batch_size=32",
        "trainer.checkpoint_every=2",
        "trainer.keep_checkpoints=0",
        "eval.every_steps=0",
        "task.train_size=200",
        "metrics.tensorboard=false",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_a_trainer_resized_2_1_2_matches_one_never_resized(tmp_path, tiny_model_dir):
    _sft(tmp_path / "fixed", tiny_model_dir, ranks=2, steps=6)
    resized = tmp_path / "resized"
    _sft(resized, tiny_model_dir, ranks=2, steps=2)
    assert "resharding from 2 to 1 ranks" in _sft(resized, tiny_model_dir, ranks=1, steps=4)
    assert "resharding from 1 to 2 ranks" in _sft(resized, tiny_model_dir, ranks=2, steps=6)
    fixed = load_file(tmp_path / "fixed" / "hf" / "model.safetensors")
    moved = load_file(resized / "hf" / "model.safetensors")
    start = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert fixed.keys() == moved.keys()
    diff = max((fixed[k].float() - moved[k].float()).abs().max().item() for k in fixed)
    trained = max((fixed[k].float() - start[k].float()).abs().max().item() for k in fixed)
    assert diff < 1e-5 < trained, (diff, trained)  # rounding, against what training moved
