"""A chaos run: an experiment trained while its processes are killed, then its books checked.

    python tools/chaos.py [--experiment experiments/tiny_grpo.py] [--minutes 10] \
        [--generator-kills 12] [--trainer-kills 1] [--buffer-kills 1] [--seed 0] \
        [--target 0.5] [--checkpoint-every 10] [--calm-s 60] [--out runs/chaos/NAME] \
        [--launcher local|slurm] [--set KEY=VALUE ...]

Starts ``launch/local.py EXPERIMENT run_dir=OUT time_limit_s=MINUTES*60
trainer.checkpoint_every=K`` (its output in ``OUT/launch.log``) or, with ``--launcher
slurm``, submits it with ``launch/slurm.py`` as a one-node job (its output in
``OUT/slurm-JOB.out``; the node must be this machine: the kills go by pid, and each
step's task writes its pid file as a local process does), waits for the first
trainer step, then SIGKILLs on a schedule drawn from ``--seed``: generators (a random one
each time) spread over the run at least ``--generator-gap`` s apart, and the trainer (one
rank) and the buffer from a quarter of the way in, at least ``--other-gap`` s from each
other; none in the last ``--calm-s`` s, so that the last process killed has restarted and
the run has gone on past it before the time limit (a restart imports torch and loads the
model: several seconds on a loaded 2-core machine). A kill takes the pid from
``OUT/pids/NAME.pid`` only after ``/proc`` shows that process alive and running this
run's module (a stale pid file never kills anything else), and waits for the launcher to
start a new one. When the launcher (or the job) has exited, the figures come from the run
directory (read by ``tools/chaos_books.py``):

    launcher_exit, restarts / kills          its (the job's) exit code; restarts it logged per role
    accounting_holds                         created = consumed + stale + filtered + failed
                                             + in flight (buffer_counters.json)
    lost, duplicated, lineage_samples        from the ledger's final lineage (the last line
    missing_steps                            of each (rank, step) below the final step):
                                             consumed samples not in it (less those served
                                             for a step the run ended before training,
                                             samples_served_untrained), samples in it more
                                             than once, steps absent from it
    batches_served_again, steps_not_replayable, leases_reissued   buffer counters
    leases_continued                         buffer counter: leases re-issued with the tokens
                                             (a picture's steps and frames) a dead holder sent
    tokens_revoked_alive                     buffer counter: tokens streamed into leases
                                             taken from live generators (lost chunks)
    episodes_continued                       multi-turn tasks: episodes re-issued after a
                                             whole turn, continued by another holder
    episode_replay_mismatches                observations a rebuilt environment gave
                                             otherwise than recorded (must be 0)
    accuracy_initial/final/peak, seconds_to_target, target_reached, trainer_wall_s
                                             held-out evaluations; seconds from the first
                                             trainer's start (seen by polling metrics.jsonl);
                                             reached: by the time limit + GRACE_S
    kill_log                                 per kill: time_s (after the first step), name,
                                             pid, step, restarted_after_s (a new pid),
                                             recovered_after_s (the trainer past that step)

Ends with one JSON line; exits 1 naming the failed checks when any fails.

Why one file: one tool: it kills, restarts and audits a run, and its report needs all three.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from chaos_books import (
    MetricsTail,
    accuracy,
    books,
    launcher_restarts,
    lineage,
    read_json,
    recovery,
    role_of,
)

ROOT = Path(__file__).resolve().parents[1]
MODULES = {
    "buffer": "asyncrl.buffer.server",
    "generator": "asyncrl.generator.",
    "trainer": "asyncrl.stages.",
}
"""What ``-m`` a process of each role runs (the trainer's module is the stage's)."""
OTHERS_FROM = 0.25
"""Fraction of the run before the first trainer or buffer kill."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--experiment", default="experiments/tiny_grpo.py")
    p.add_argument("--minutes", type=float, default=10.0, help="the run's time limit")
    p.add_argument("--generator-kills", type=int, default=12)
    p.add_argument("--trainer-kills", type=int, default=1)
    p.add_argument("--buffer-kills", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    p.add_argument("--target", type=float, default=0.5, help="held-out accuracy to reach")
    p.add_argument("--checkpoint-every", type=int, default=10, help="trainer.checkpoint_every")
    p.add_argument(
        "--generator-gap", type=float, default=10.0, help="min s between generator kills"
    )
    p.add_argument(
        "--other-gap", type=float, default=30.0, help="min s between trainer/buffer kills"
    )
    p.add_argument(
        "--calm-s", type=float, default=60.0, help="s at the end of the run with no kill"
    )
    p.add_argument("--out", default="", help="run directory (default runs/chaos/NAME-TIME)")
    p.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="run under launch/local.py, or as a one-node job of the Slurm cluster here",
    )
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="experiment overrides")
    args = p.parse_args(argv)
    if args.calm_s >= (1 - OTHERS_FROM) * args.minutes * 60:  # no window for trainer/buffer
        p.error(
            f"--calm-s {args.calm_s:g} leaves no time for kills in a {args.minutes:g}-minute run"
        )
    return args


def spaced(rng: random.Random, n: int, lo: float, hi: float, gap: float) -> list[float]:
    """``n`` sorted uniform times in [lo, hi], consecutive ones at least ``gap`` apart
    (squeezed when the window is too short for that)."""
    gap = min(gap, (hi - lo) / max(n - 1, 1))
    free = hi - lo - gap * max(n - 1, 0)
    return [lo + x + i * gap for i, x in enumerate(sorted(rng.uniform(0, free) for _ in range(n)))]


def schedule(args, rng: random.Random, generators: int, ranks: int) -> list[tuple[float, str]]:
    """(seconds after the first step, process name), in time order."""
    span = args.minutes * 60
    last = span - args.calm_s
    out = [
        (t, f"generator_{rng.randrange(generators)}")
        for t in spaced(rng, args.generator_kills, 0.05 * span, last, args.generator_gap)
    ]
    others = ["buffer"] * args.buffer_kills + ["trainer"] * args.trainer_kills
    rng.shuffle(others)
    for t, role in zip(spaced(rng, len(others), OTHERS_FROM * span, last, args.other_gap), others):
        out.append((t, "buffer" if role == "buffer" else f"trainer_{rng.randrange(ranks)}"))
    return sorted(out)


class LocalRun:
    """``launch/local.py`` in a subprocess, its output in ``OUT/launch.log``."""

    def __init__(self, launch_args: list[str], run_dir: Path) -> None:
        self.log_path = run_dir / "launch.log"
        cmd = [sys.executable, str(ROOT / "launch" / "local.py"), *launch_args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """SIGTERM: the launcher stops every process of the run."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class SlurmRun:
    """``launch/slurm.py`` submits it as a one-node job (what it printed is in
    ``OUT/launch.log``); its state comes from ``scontrol``, asked at most every
    ``every_s`` (each poll would load the controller), its output is ``OUT/slurm-JOB.out``."""

    def __init__(self, launch_args: list[str], run_dir: Path, every_s: float = 2.0) -> None:
        one_node = ["--gen-nodes", "1", "--train-nodes", "1", "--nodes", "1"]
        cmd = [sys.executable, str(ROOT / "launch" / "slurm.py"), *launch_args, *one_node]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        (run_dir / "launch.log").write_text(done.stdout + done.stderr)
        found = re.search(r"submitted batch job (\d+)", done.stdout)
        if done.returncode != 0 or found is None:
            raise RuntimeError(f"launch/slurm.py did not submit:\n{done.stdout}{done.stderr}")
        self.job, self.run_dir, self.every_s = found.group(1), run_dir, every_s
        self.code: int | None = None
        self.asked = 0.0

    def poll(self) -> int | None:
        if self.code is None and time.time() - self.asked >= self.every_s:
            self.asked = time.time()
            self.code = job_exit_code(self.job)
        return self.code

    def stop(self) -> None:
        """``scancel``: the job's supervisor stops every step."""
        subprocess.run(["scancel", self.job], capture_output=True, timeout=30)
        deadline = time.time() + 90
        while self.poll() is None and time.time() < deadline:
            time.sleep(1)

    def log(self) -> str:
        path = self.run_dir / f"slurm-{self.job}.out"
        return path.read_text(errors="replace") if path.exists() else ""


def job_exit_code(job: str) -> int | None:
    """None while the job is pending, runs or completes; then its exit code (128 + the
    signal when one ended it; 255 when the controller no longer knows the job)."""
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True)
    if "Invalid job id" in shown.stderr:
        return 255
    state = re.search(r"JobState=(\S+)", shown.stdout)
    code = re.search(r"ExitCode=(\d+):(\d+)", shown.stdout)
    if state is None or code is None or state.group(1) in ACTIVE_STATES:
        return None
    status, signal_number = int(code.group(1)), int(code.group(2))
    return 128 + signal_number if signal_number else status


ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED"}
"""Job states in which the job's processes may still run."""
Run = LocalRun | SlurmRun


def live_pid(run_dir: Path, name: str) -> int | None:
    """The pid in ``pids/NAME.pid`` if that process is alive and is NAME of this run."""
    try:
        pid = int((run_dir / "pids" / f"{name}.pid").read_text())
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except (OSError, ValueError, IndexError):
        return None
    if state in "ZX" or "-m" not in argv or argv.index("-m") + 1 >= len(argv):
        return None
    module = argv[argv.index("-m") + 1]
    ours = any(a.startswith(str(run_dir) + "/") for a in argv)  # its --config is in this run
    worker = not name.startswith("generator_") or f"g{name.rsplit('_', 1)[1]}" in argv
    return pid if module.startswith(MODULES[role_of(name)]) and ours and worker else None


def kill(run_dir: Path, name: str, launcher: Run, tail: MetricsTail, t0: float) -> dict:
    """SIGKILL NAME once it is alive, then wait for the launcher to start it again."""
    record: dict[str, Any] = {"name": name, "role": role_of(name)}
    deadline = time.time() + 120
    while (
        (pid := live_pid(run_dir, name)) is None
        and time.time() < deadline
        and launcher.poll() is None
    ):
        time.sleep(0.2)  # e.g. still coming back from an earlier kill
    if (run_dir / "summary.json").exists() or launcher.poll() is not None:
        return {**record, "error": "the run had ended"}  # its processes are being stopped
    if pid is None:
        return {**record, "error": "no live process to kill"}
    tail.poll()
    os.kill(pid, signal.SIGKILL)
    record.update(time_s=round(time.time() - t0, 1), pid=pid, step=tail.step())
    print(
        f"[chaos] {record['time_s']:7.1f} s  SIGKILL {name} (pid {pid}) at step {record['step']}",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.time() + 180
    while time.time() < deadline and launcher.poll() is None:
        new = live_pid(run_dir, name)
        if new is not None and new != pid:
            record["restarted_after_s"] = round(time.time() - t0 - record["time_s"], 1)
            break
        time.sleep(0.2)
    return record


def wait_for_first_step(launcher: Run, tail: MetricsTail, timeout_s: float) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline and launcher.poll() is None:
        tail.poll()
        if tail.trainer("train/loss"):
            return True
        time.sleep(0.5)
    return False


def sleep_until(when: float, launcher: Run, tail: MetricsTail) -> None:
    while time.time() < when and launcher.poll() is None:
        tail.poll()
        time.sleep(min(0.5, max(0.0, when - time.time())))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = f"{Path(args.experiment).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.out or f"runs/chaos/{name}").resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        print(f"error: {run_dir} is not empty (a relaunch would resume it)", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    launch_args = [
        args.experiment,
        f"run_dir={run_dir}",
        f"time_limit_s={args.minutes * 60:g}",
        f"trainer.checkpoint_every={args.checkpoint_every}",
        *args.set,
    ]
    try:
        launcher = (SlurmRun if args.launcher == "slurm" else LocalRun)(launch_args, run_dir)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tail, kills, failed, t0 = MetricsTail(run_dir), [], [], time.time()
    try:
        if not wait_for_first_step(launcher, tail, timeout_s=900):
            failed.append("never_started")
        else:
            t0 = time.time()
            cfg = json.loads((run_dir / "config.json").read_text())
            rng = random.Random(args.seed)
            plan = schedule(args, rng, cfg["num_generators"], cfg["trainer"]["num_ranks"])
            for at, target in plan:
                sleep_until(t0 + at, launcher, tail)
                if launcher.poll() is not None:
                    break
                kills.append(kill(run_dir, target, launcher, tail, t0))
        # Room for restarts that come back slowly, and for the final evaluation.
        deadline = time.time() + 2 * args.minutes * 60 + 600
        sleep_until(deadline, launcher, tail)
        failed += ["launcher_timeout"] * (launcher.poll() is None)
    finally:
        if launcher.poll() is None:
            launcher.stop()
    tail.poll()
    recovery(kills, tail, t0)
    return check(args, run_dir, launcher, kills, tail, failed)


def check(
    args, run_dir: Path, launcher: Run, kills: list[dict], tail: MetricsTail, failed: list[str]
) -> int:
    code, summary = launcher.poll(), read_json(run_dir / "summary.json")
    steps = int(summary.get("steps", 0))
    done = [k for k in kills if "pid" in k]
    killed = Counter(k["role"] for k in done)
    restarts = launcher_restarts(launcher.log())
    last_kill_step = max((k["step"] for k in done), default=0)
    figures: dict[str, Any] = {
        "run_dir": str(run_dir),
        "launcher_exit": code,
        "steps": steps,
        "kills": {r: killed[r] for r in MODULES},
        "restarts": {r: restarts[r] for r in MODULES},
        "kills_failed": len(kills) - len(done),
        "kills_not_restarted": sum("restarted_after_s" not in k for k in done),
        "step_at_last_kill": last_kill_step,
        **books(read_json(run_dir / "buffer_counters.json"), lineage(run_dir, steps)),
        **accuracy(tail, summary, args.target, args.minutes * 60),
        "target": args.target,
        "kill_log": kills,
    }
    wanted = {
        "generator": args.generator_kills,
        "trainer": args.trainer_kills,
        "buffer": args.buffer_kills,
    }
    checks = {
        f"launcher_exit_{code}": code != 0,
        **{f"{r}_kills_{killed[r]}_of_{n}": killed[r] < n for r, n in wanted.items()},
        **{f"{r}_restarts": restarts[r] < killed[r] for r in MODULES},
        "kills_not_restarted": figures["kills_not_restarted"] > 0,
        "accounting": not figures["accounting_holds"],
        "lost": figures["lost"] != 0,
        "duplicated": figures["duplicated"] != 0,
        "trained_not_consumed": figures["trained_not_consumed"] != 0,
        "missing_steps": bool(figures["missing_steps"]),
        "replay_mismatches": figures["episode_replay_mismatches"] != 0,
        "no_steps_after_last_kill": steps <= last_kill_step,
        "target_not_reached": not figures["target_reached"],
    }
    figures["failed"] = failed + [name for name, bad in checks.items() if bad]
    print(json.dumps(figures))
    return 1 if figures["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
