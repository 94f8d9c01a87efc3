"""``tools/replay.py`` on a real asynchronous run (two generators, η = 2, the buffer
saving its state often, so its log spans many segments): the replayed trainer ends with
the run's weights bit for bit, and recorded samples decoded again with their seeds give
the same tokens. With a setting changed the weights differ, so the check can fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.loop.recorded import ReplayError, wal_segments

from .conftest import ROOT, launch


def _replay(run_dir: Path, *extra: str) -> dict:
    cmd = [sys.executable, "tools/replay.py", str(run_dir), "--regenerate", "40", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_replayed_run_ends_with_its_weights_bit_for_bit(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    launch(
        "tiny_grpo.py",
        f"run_dir={run_dir}",
        f"model.path={tiny_model_dir}",
        "rl.max_steps=6",
        # Every version kept, so each single-version sample can be decoded again.
        "trainer.checkpoint_every=1",
        "trainer.keep_checkpoints=0",
        "eval.every_steps=3",
        "eval.num_examples=8",
        "task.train_size=200",
        "buffer.prompts_per_batch=2",
        "buffer.samples_per_prompt=4",
        "buffer.checkpoint_s=0.5",
        "engine.embedded.max_slots=8",
        "transport.heartbeat_s=0.2",
        "num_generators=2",
        # The check after each flip rides along: it must not change what is trained.
        "transport.weights.probe_text=12+34=46 and 7*8=56",
    )
    probes = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    probes = [r for r in probes if "weights/probe_max_abs_diff" in r]
    assert probes and max(r["weights/probe_max_abs_diff"] for r in probes) < 1e-4
    # Of the 12 possible (two generators, six versions), a generator that skips a version
    # never scores it, and reports arriving after the last publish are never compared:
    # one run in a suite counted 4.
    assert sum(r["weights/probe_reports"] for r in probes) >= 2
    assert probes[-1]["weights/probe_alarms"] == 0
    assert len(wal_segments(run_dir)) > 2
    same = _replay(run_dir)
    assert same["steps"] == 6
    assert same["bitwise_equal"] is True and same["max_abs_weight_diff"] == 0.0
    assert same["samples_regenerated"] >= 20
    assert same["samples_equal"] == same["samples_regenerated"]
    # From the step-3 checkpoint at another learning rate: other weights.
    changed = _replay(run_dir, "--from-step", "3", "--regenerate", "0", "optim.lr=1e-3")
    assert changed["bitwise_equal"] is False and changed["max_abs_weight_diff"] > 0


def test_a_log_without_its_first_segments_is_refused(tmp_path):
    wal = tmp_path / "buffer_wal"
    wal.mkdir()
    for n in (3, 4):
        (wal / f"{n:08d}.wal").write_bytes(b"")
    with pytest.raises(ReplayError, match="buffer.keep_wal=false"):
        wal_segments(tmp_path)
    for segment in wal.iterdir():
        segment.unlink()
    with pytest.raises(ReplayError, match="holds no log"):
        wal_segments(tmp_path)
