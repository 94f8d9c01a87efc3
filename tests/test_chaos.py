"""``tools/chaos.py`` on the tiny test model: real processes, real SIGKILLs, books checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.envs.calculator import write_calculator_data
from asyncrl.models import build_tiny_model
from tests.conftest import TEST_MODEL

ROOT = Path(__file__).resolve().parents[1]


CHAOS_RUN = [
    "task.train_size=200",
    "task.rl_split=train",
    "buffer.prompts_per_batch=2",
    "buffer.samples_per_prompt=4",
    "buffer.dynamic_sampling=false",
    "buffer.heartbeat_timeout_s=2",
    "buffer.checkpoint_s=5",
    "engine.embedded.max_slots=8",
    "transport.heartbeat_s=0.2",
    "eval.every_steps=0",
    "rl.max_steps=100000",
    "num_generators=1",
]
"""tiny_grpo small enough for a chaos run of a minute on 2 cores (the model is the test's)."""


def launcher_output(run_dir: Path) -> str:
    """What the launcher printed: ``launch.log``, then a Slurm job's output."""
    paths = [run_dir / "launch.log", *sorted(run_dir.glob("slurm-*.out"))]
    return "".join(path.read_text(errors="replace") for path in paths if path.exists())


def run_chaos(
    run_dir: Path, chaos_args: list[str], overrides: list[str], env: dict | None = None
) -> tuple[dict, str]:
    """``tools/chaos.py`` to its end: its figures (after asserting it passed its own
    checks) and, for assertion messages, them with the launcher's last lines."""
    cmd = [sys.executable, "tools/chaos.py", *chaos_args, "--out", str(run_dir)]
    cmd += ["--set", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    log = launcher_output(run_dir)
    assert done.stdout.strip(), done.stderr[-3000:] + log[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(done.stdout.strip().splitlines()[-1])  # the JSON line, shown with -s
    context = json.dumps(figures) + "\n" + log[-3000:]
    assert done.returncode == 0 and figures["failed"] == [], context
    return figures, context


def assert_repaired_and_balanced(figures: dict, context: str, kills: dict[str, int]) -> None:
    """Every kill landed and was repaired by a restart, the run went on past the last one
    and ended well, and the buffer's counters and the trainer's ledger agree that every
    consumed sample was trained on exactly once."""
    assert figures["launcher_exit"] == 0, context
    assert figures["kills"] == kills, context
    for role, count in kills.items():
        assert figures["restarts"][role] >= count, context
    assert all("restarted_after_s" in k for k in figures["kill_log"]), context
    assert figures["samples_consumed"] > 0 and figures["accounting_holds"], context
    assert figures["lost"] == 0 and figures["duplicated"] == 0, context
    assert figures["lineage_samples"] == figures["samples_consumed"], context
    assert figures["missing_steps"] == [], context
    assert figures["steps"] > figures["step_at_last_kill"], context
    # Every step a restarted trainer redid got the batch the dead one had trained on.
    assert figures["steps_not_replayable"] == 0, context


def test_a_chaos_run_loses_nothing_and_counts_nothing_twice(tmp_path, tiny_model_dir):
    """Three generator kills, one trainer kill and one buffer kill in a 60 s run, none in
    its last 35 s (a restarted trainer takes up to ~20 s to its next step on a busy
    2-core machine; a run that ends before it would leave its last batch untrained):
    every death is repaired by a restart, the trainer goes on past the last kill, and the buffer's counters and the
    trainer's ledger agree that every consumed sample was trained on exactly once. A
    buffer that came back without its state, or a trainer served fresh batches for the
    steps it redid, would fail the accounting or lineage."""
    chaos_args = [
        *["--experiment", "experiments/tiny_grpo.py", "--minutes", "1", "--calm-s", "35"],
        *["--generator-kills", "3", "--trainer-kills", "1", "--buffer-kills", "1"],
        *["--generator-gap", "6", "--other-gap", "8", "--checkpoint-every", "3"],
        *["--target", "0", "--seed", "1"],
    ]
    overrides = [f"model.path={tiny_model_dir}", *CHAOS_RUN]
    figures, context = run_chaos(tmp_path / "chaos", chaos_args, overrides)
    assert_repaired_and_balanced(figures, context, {"buffer": 1, "generator": 3, "trainer": 1})


@pytest.mark.slow  # CI keeps the single-turn chaos run above
def test_a_generator_killed_mid_episode_loses_no_episode(tmp_path, tiny_model_dir):
    """``tools/chaos.py --experiment experiments/tiny_agent.py``: generators killed while
    they hold multi-turn episodes. No episode is lost or trained twice, episodes are
    continued by the restarted generator after their whole turns, and every rebuilt
    environment answered those turns as recorded (``episode_replay_mismatches``). The
    untrained test model would end every calculator episode at its first turn, so the
    environment is one that always takes three (``tests.episode_envs.Lines``)."""
    run_dir = tmp_path / "chaos"
    texts = calculator_texts(tmp_path / "data")
    model = build_tiny_model(tmp_path / "agent-model", texts, TEST_MODEL)
    overrides = [
        f"model.path={model}",
        "task.environment=tests.episode_envs:Lines",
        "buffer.prompts_per_batch=4",
        "buffer.samples_per_prompt=4",
        "buffer.dynamic_sampling=false",
        "buffer.heartbeat_timeout_s=2",
        "transport.heartbeat_s=0.2",
        "eval.every_steps=0",
        "rl.max_steps=100000",
    ]
    chaos_args = [
        *["--experiment", "experiments/tiny_agent.py"],
        *["--minutes", "0.6", "--calm-s", "12", "--generator-kills", "3"],
        *["--trainer-kills", "0", "--buffer-kills", "0", "--generator-gap", "5"],
        *["--checkpoint-every", "5", "--target", "0", "--seed", "2"],
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the launcher imports tests.episode_envs
    figures, context = run_chaos(run_dir, chaos_args, overrides, env)
    assert figures["kills"]["generator"] == 3 and figures["restarts"]["generator"] >= 3, context
    assert figures["samples_consumed"] > 0 and figures["accounting_holds"], context
    assert figures["lost"] == 0 and figures["duplicated"] == 0, context
    assert figures["episodes_continued"] >= 1, context
    assert figures["episode_replay_mismatches"] == 0, context


def calculator_texts(out_dir: Path) -> list[str]:
    """Every text of the calculator task's files: the char tokenizer must cover them."""
    data = write_calculator_data(out_dir)
    return [line for path in data.values() for line in Path(path).read_text().splitlines()]
