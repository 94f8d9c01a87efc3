"""The Slurm launcher on a real cluster (marker ``slurm``; ``tools/slurm_cluster.sh start``
boots a one-node cluster, ``.ci/run`` does it for CI): the script's node placement as bash
resolves it, a submitted tiny GRPO run that trains and ends cleanly, a run whose generator
is frozen (found stalled, restarted) and which ``scancel`` then stops with every process
gone, and a chaos run (``tools/chaos.py --launcher slurm``) whose generator, buffer and
trainer are killed and restarted with nothing lost or counted twice. The script and the
supervisor without a cluster: ``test_slurm_script.py``, ``test_supervise.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics
from tests.runs import SHORT_GRPO, assert_drained_and_balanced
from tests.runs import wait_for as _wait_for
from tests.test_chaos import CHAOS_RUN, assert_repaired_and_balanced, launcher_output, run_chaos
from tests.test_slurm_script import dry_run_here

ROOT = Path(__file__).resolve().parents[1]
# The short asynchronous run of the tiny model that the local launcher tests run.
SHORT_RUN = [*SHORT_GRPO, "num_generators=1"]


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    if shutil.which("sinfo") is None:
        pytest.skip(
            "Slurm is not installed (sinfo not found); tools/slurm_cluster.sh start boots one"
        )
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.skip(
            f"no Slurm cluster answers sinfo ({proc.stderr.strip()}); tools/slurm_cluster.sh start"
        )


@pytest.mark.slurm
@pytest.mark.parametrize("nodelist, gen_nodes, train_nodes", [("n[1-4]", 2, 2), ("solo", 1, 1)])
def test_script_resolves_the_allocation_into_node_lists(
    tmp_path, capsys, slurm_cluster, nodelist, gen_nodes, train_nodes
):
    """The script's own prologue, run by bash with ``scontrol`` expanding a node list; the
    supervisor prints the steps instead of starting them."""
    run_dir = tmp_path / "run"
    nodes = ["--nodes", "1"] if nodelist == "solo" else []
    dry_run_here(
        capsys,
        "--gen-nodes",
        str(gen_nodes),
        "--train-nodes",
        str(train_nodes),
        *nodes,
        f"run_dir={run_dir}",
        f"model.path={tmp_path}",
        f"num_generators={gen_nodes}",
        f"trainer.num_ranks={2 * train_nodes}",
    )
    env = dict(
        os.environ, SLURM_JOB_NODELIST=nodelist, SLURM_JOB_ID="4242", ASYNCRL_PRINT_STEPS="1"
    )
    out = subprocess.run(
        ["bash", str(run_dir / "slurm_job.sbatch")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    steps = {s["name"]: s["argv"] for s in json.loads(out[out.index("[\n") :])}
    port = 10000 + 4242 % 20000
    if nodelist == "solo":  # one node: everything on it; its transport stays the experiment's (ipc)
        want = {"buffer": "solo", "generator_0": "solo", "trainer": "solo"}
        head = "solo"
        assert json.loads((run_dir / "config.json").read_text())["transport"]["scheme"] == "ipc"
    else:
        want = {"buffer": "n1", "generator_0": "n1", "generator_1": "n2", "trainer": "n3,n4"}
        head = "n3"
    assert {
        name: next(a for a in argv if a.startswith("--nodelist="))[11:]
        for name, argv in steps.items()
    } == want
    assert (
        f"--rdzv-endpoint={head}:{port}" in steps["trainer"]
        and "--rdzv-id=4242" in steps["trainer"]
    )
    assert "--nproc-per-node=2" in steps["trainer"]


def submit(tmp_path: Path, model_dir: str, *overrides: str) -> tuple[str, Path]:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "launch/slurm.py",
        "experiments/tiny_grpo.py",
        "--gen-nodes",
        "1",
        "--train-nodes",
        "1",
        "--nodes",
        "1",
        f"run_dir={run_dir}",
        f"model.path={model_dir}",
        *SHORT_RUN,
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted batch job (\d+); run directory (\S+);", proc.stdout)
    assert job and Path(job.group(2)) == run_dir, proc.stdout
    return job.group(1), run_dir


# squeue and the metrics file: twice a second is often enough.
wait_for = partial(_wait_for, poll_s=0.5)


def job_gone(job: str) -> bool:
    return not subprocess.run(
        ["squeue", "-h", "-j", job], capture_output=True, text=True
    ).stdout.strip()


def job_state(job: str) -> tuple[str, str]:
    """(JobState, ExitCode) from the controller, which keeps ended jobs for MinJobAge."""
    text = subprocess.run(
        ["scontrol", "show", "job", job], capture_output=True, text=True, check=True
    ).stdout
    return re.search(r"JobState=(\S+)", text).group(1), re.search(r"ExitCode=(\S+)", text).group(1)


def processes_of(run_dir: Path) -> list[tuple[int, str]]:
    """Live processes whose command line names the run directory (steps, sruns, supervisor)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and str(run_dir) in cmdline:
            found.append((int(entry.name), cmdline))
    return found


def trained_steps(run_dir: Path) -> list[dict]:
    if not (run_dir / "metrics.jsonl").exists():
        return []
    return [r for r in read_metrics(run_dir) if r["process"] == "trainer" and "train/loss" in r]


def job_output(run_dir: Path, job: str) -> str:
    path = run_dir / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.slurm
@pytest.mark.slow  # CI submits a job in the join-and-leave test below
def test_submitted_tiny_grpo_trains_and_ends_cleanly(tmp_path, tiny_model_dir, slurm_cluster):
    # transport.host=* is what a multi-node job gets: TCP on every interface, found by hostname.
    job, run_dir = submit(
        tmp_path, tiny_model_dir, "rl.max_steps=4", "transport.scheme=tcp", "transport.host=*"
    )
    wait_for(lambda: job_gone(job), 150, f"job {job} to end")
    output = job_output(run_dir, job)
    assert job_state(job) == ("COMPLETED", "0:0"), output[-3000:]
    assert "[launch] done:" in output and "exited with code" not in output
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    records = [r for r in read_metrics(run_dir) if r["process"] == "trainer" and "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(
        math.isfinite(r["train/loss"]) for r in records
    )
    counters = json.loads(
        (run_dir / "buffer_counters.json").read_text()
    )  # written when the buffer stops
    assert counters["buffer/version"] == 4
    assert counters["buffer/generator_version_max"] >= 2  # generators flipped to published weights
    assert counters["buffer/samples_consumed"] == 4 * 2 * 4
    assert json.loads((run_dir / "endpoints" / "buffer.json").read_text())["leases"].startswith(
        "tcp://"
    )
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "buffer.log",
        "generator_0.log",
        "trainer.log",
    ]
    assert processes_of(run_dir) == []
    assert subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip() == ""


@pytest.mark.slurm
@pytest.mark.slow
def test_frozen_generator_restarts_and_scancel_stops_everything(
    tmp_path, tiny_model_dir, slurm_cluster
):
    """A generator frozen with SIGSTOP (its pid from the file its task wrote) is found
    stalled by the job's supervisor, killed through its step and restarted; ``scancel``
    then stops the job with every process gone."""
    job, run_dir = submit(tmp_path, tiny_model_dir, "rl.max_steps=100000", "--stall-timeout-s", "5")
    try:
        wait_for(lambda: trained_steps(run_dir), 120, "a trained step")

        def generators() -> list[int]:
            return [
                pid
                for pid, cmd in processes_of(run_dir)
                if "asyncrl.generator.worker" in cmd and not cmd.startswith("srun")
            ]

        first = int((run_dir / "pids" / "generator_0.pid").read_text())
        assert generators() == [first]  # the process itself, not srun
        os.kill(first, signal.SIGSTOP)
        wait_for(
            lambda: "generator_0 exited with code -9; restart 1" in job_output(run_dir, job),
            60,
            "the restart",
        )
        assert re.search(r"\[launch\] generator_0 stalled for \d+ s", job_output(run_dir, job))
        wait_for(lambda: [p for p in generators() if p != first], 60, "the restarted generator")
        assert not Path(f"/proc/{first}").exists()
    finally:
        subprocess.run(["scancel", job], check=True)
    wait_for(lambda: job_gone(job), 60, f"job {job} to stop")
    output = job_output(run_dir, job)
    assert job_state(job)[0] == "CANCELLED", output[-3000:]
    assert f"last lines of {run_dir / 'logs' / 'generator_0.log'}" in output
    assert "[launch] asked to stop; stopping every process" in output
    assert (run_dir / "buffer_counters.json").exists()  # the buffer stopped on SIGTERM, not SIGKILL
    wait_for(lambda: processes_of(run_dir) == [], 10, "every process to exit")
    assert subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip() == ""


@pytest.mark.slurm
@pytest.mark.slow  # about two minutes; CI repairs kills in tests/test_chaos.py's local run
def test_a_slurm_job_repairs_killed_generator_buffer_and_trainer_losing_nothing(
    tmp_path, tiny_model_dir, slurm_cluster
):
    """tests/test_chaos.py's run as a one-node job: a generator, the buffer and a trainer
    rank SIGKILLed by the pids their tasks wrote (not srun's); the job's supervisor
    restarts the generator step, the buffer step (from its state) and the whole trainer
    step (from its checkpoint); the job exits 0 and the books balance."""
    chaos_args = [
        *["--launcher", "slurm", "--experiment", "experiments/tiny_grpo.py"],
        # 55 s calm: a restarted trainer step takes ~20 s to its first step on a quiet
        # machine, and over 40 s in a loaded CI run; it must step before the time limit.
        *["--minutes", "1.5", "--calm-s", "55", "--generator-kills", "1"],
        *["--trainer-kills", "1", "--buffer-kills", "1", "--generator-gap", "6"],
        *["--other-gap", "8", "--checkpoint-every", "3", "--target", "0", "--seed", "1"],
    ]
    run_dir = tmp_path / "chaos"
    overrides = [f"model.path={tiny_model_dir}", *CHAOS_RUN]
    figures, context = run_chaos(run_dir, chaos_args, overrides)
    assert_repaired_and_balanced(figures, context, {"buffer": 1, "generator": 1, "trainer": 1})
    output = launcher_output(run_dir)
    for step in ("generator_0", "buffer", "trainer"):
        assert re.search(rf"\[launch\] {step} exited with code \d+; restart 1 of {step}", output)
    wait_for(lambda: processes_of(run_dir) == [], 30, "every process to exit")


@pytest.mark.slurm
def test_a_generator_step_joins_and_leaves_a_slurm_job_losing_nothing(
    tmp_path, tiny_model_dir, slurm_cluster
):
    """Scale-out and scale-in on Slurm: asking the running job for two generators starts a
    second generator step in the job's allocation, which attaches to the buffer and sends
    tokens; asking for one again drains that step (``scancel --signal=USR1`` to its task):
    it hands its leases back, exits drained and is not restarted, and the run trains on.
    The buffer's books, written when ``scancel`` stops the job, balance with 0 lost."""
    job, run_dir = submit(tmp_path, tiny_model_dir, "rl.max_steps=100000", "time_limit_s=600")
    control = run_dir / "control" / "generators"
    try:
        wait_for(lambda: trained_steps(run_dir), 120, "a trained step")
        control.write_text("2\n")
        wait_for(
            lambda: any(
                r["process"] == "generator_g1" and r.get("generator/tokens", 0) > 0
                for r in read_metrics(run_dir)
            ),
            120,
            "the second generator's first tokens",
        )
        control.write_text("1\n")
        wait_for(
            lambda: "generator_1 left the run, drained" in job_output(run_dir, job),
            120,
            "the second generator to leave",
        )
        after = len(trained_steps(run_dir))
        wait_for(lambda: len(trained_steps(run_dir)) >= after + 3, 120, "steps after it left")
    finally:
        subprocess.run(["scancel", job], check=True)
    wait_for(lambda: job_gone(job), 60, f"job {job} to stop")
    output = job_output(run_dir, job)
    assert "generators: started generator_1 (wanted: 2)" in output, output[-3000:]
    assert "generators: draining generator_1 (wanted: 1)" in output
    assert not re.search(r"; restart \d+ of", output), output[-3000:]  # nothing died
    assert_drained_and_balanced(run_dir, "g1")
    wait_for(lambda: processes_of(run_dir) == [], 30, "every process to exit")


@pytest.mark.slurm
@pytest.mark.slow  # two stages, about two minutes; the dry run is in CI
def test_a_chain_runs_in_one_allocation_sft_first_then_rl(tmp_path, slurm_cluster):
    """tiny_grpo with its SFT start missing, ``--one-allocation``: one job, which trains
    tiny_sft on the allocation, then runs RL from its export, and ends COMPLETED."""
    cmd = [sys.executable, str(ROOT / "launch/slurm.py"), str(ROOT / "experiments/tiny_grpo.py")]
    cmd += ["--gen-nodes", "1", "--train-nodes", "1", "--nodes", "1", "--one-allocation"]
    cmd += [f"run_dir={tmp_path / 'rl'}", "rl.max_steps=4", *SHORT_RUN]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tiny_sft runs first in the same allocation" in proc.stderr
    [job] = re.findall(r"submitted batch job (\d+);", proc.stdout)
    wait_for(lambda: job_gone(job), 400, f"job {job} to end")
    output = job_output(tmp_path / "rl", job)
    assert job_state(job) == ("COMPLETED", "0:0"), output[-3000:]
    assert output.index("tiny_sft: generator nodes: none") < output.index("tiny_grpo: generator")
    assert (tmp_path / "runs" / "models" / "tiny-sft" / "config.json").exists()
    assert json.loads((tmp_path / "rl" / "summary.json").read_text())["steps"] == 4
