"""The Slurm launcher and the supervision it shares with ``launch/local.py``.

Without Slurm: the supervisor restarts, reports and stops real processes; the sbatch
script of a dry run places steps on the right node lists; bad layouts are refused.
With Slurm (marker ``slurm``; ``tools/slurm_cluster.sh start`` boots a one-node cluster,
``.ci/run`` does it for CI): the script's node placement as bash resolves it, a real
submitted tiny GRPO run that trains and ends cleanly, a run whose generator is frozen
(found stalled, restarted) and which ``scancel`` then stops with every process gone, and a chaos run
(``tools/chaos.py --launcher slurm``) whose generator, buffer and trainer are killed and
restarted with nothing lost or counted twice.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.launcher.prepare import Prepared
from asyncrl.launcher.sbatch import LayoutError, SlurmOptions, process_steps, step_policy
from asyncrl.launcher.slurm_job import parse_policy, parse_steps
from asyncrl.launcher.supervise import Supervised, supervise
from asyncrl.metrics import read_metrics
from asyncrl.stages.common import ProcessSpec
from tests.test_chaos import CHAOS_RUN, assert_repaired_and_balanced, launcher_output, run_chaos

ROOT = Path(__file__).resolve().parents[1]
# A short asynchronous run of the tiny model, as tests/test_rl_launch.py runs it locally.
SHORT_RUN = [
    "eval.every_steps=0",
    "task.train_size=200",
    "buffer.prompts_per_batch=2",
    "buffer.samples_per_prompt=4",
    "buffer.dynamic_sampling=false",
    "engine.embedded.max_slots=8",
    "transport.heartbeat_s=0.2",
    "metrics.tensorboard=false",
    "num_generators=1",
]


# ---- the supervisor (no Slurm) -------------------------------------------------------
def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SLEEP = _python("import time; time.sleep(600)")


def test_supervisor_restarts_generators_and_stops_the_rest_when_the_trainer_ends(tmp_path, capfd):
    marker, restarted = tmp_path / "died_once", tmp_path / "restarted"
    # Dies the first time (as a killed generator would), runs until stopped the second.
    flaky = _python(
        f"import pathlib, sys, time\nm = pathlib.Path({str(marker)!r})\n"
        "if not m.exists(): m.touch(); print('dying now', flush=True); sys.exit(3)\n"
        f"pathlib.Path({str(restarted)!r}).touch()\ntime.sleep(600)"
    )
    # The trainer ends once the generator runs again (a fixed sleep would race the restart
    # on a loaded machine); the 120 s limit only keeps a broken supervisor from hanging.
    trainer = _python(
        f"import pathlib, time\nr, t = pathlib.Path({str(restarted)!r}), time.monotonic()\n"
        "while not r.exists() and time.monotonic() - t < 120: time.sleep(0.05)\n"
        "print('trained')"
    )
    buffer = Supervised("buffer", SLEEP, tmp_path / "buffer.log")
    generator = Supervised("generator_0", flaky, tmp_path / "generator_0.log", restartable=True)
    procs = [
        buffer,
        generator,
        Supervised("trainer", trainer, tmp_path / "trainer.log", final=True),
    ]
    assert supervise(procs, grace_s=5) == 0
    assert generator.restarts == 1
    assert buffer.proc.returncode == generator.proc.returncode == -signal.SIGTERM
    err = capfd.readouterr().err
    assert "generator_0 exited with code 3; restart 1" in err
    assert "dying now" in err  # the tail of its log
    assert (tmp_path / "trainer.log").read_text() == "trained\n"


def test_supervisor_reports_a_death_with_its_log_and_stops_everything(tmp_path, capfd):
    failing = _python(
        "import time; print('scoring failed: boom', flush=True); time.sleep(1); exit(1)"
    )
    trainer = Supervised("trainer", SLEEP, tmp_path / "trainer.log", final=True)
    procs = [Supervised("buffer", failing, tmp_path / "buffer.log"), trainer]
    assert supervise(procs, grace_s=5, stop=threading.Event()) == 1
    assert trainer.proc.returncode == -signal.SIGTERM
    err = capfd.readouterr().err
    assert f"buffer exited with code 1; last lines of {tmp_path / 'buffer.log'}" in err
    assert "scoring failed: boom" in err


# ---- the sbatch script (no Slurm) ----------------------------------------------------
def dry_run(*args: str) -> subprocess.CompletedProcess:
    """``launch/slurm.py --dry-run`` on tiny_grpo, as a user runs it: in a subprocess."""
    cmd = [sys.executable, "launch/slurm.py", "experiments/tiny_grpo.py", "--dry-run", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def dry_run_here(capsys, *args: str) -> tuple[str, str]:
    """The same in this process (torch is imported already: seconds faster); (out, err)."""
    spec = importlib.util.spec_from_file_location("slurm_launcher", ROOT / "launch" / "slurm.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    code = launcher.main([str(ROOT / "experiments/tiny_grpo.py"), "--dry-run", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def script_steps(script: str) -> dict[str, list[str]]:
    """The lines handed to the job's supervisor, by step name (policy and srun words)."""
    lines = script.split("<<STEPS\n")[1].split("\nSTEPS\n")[0].splitlines()
    return {line.split()[0]: line.split() for line in lines}


def four_node_dry_run(tmp_path: Path) -> tuple[str, Path]:
    run_dir = tmp_path / "run"
    proc = dry_run(
        "--gen-nodes",
        "2",
        "--train-nodes",
        "2",
        "--partition",
        "gpu",
        "--time",
        "0:30:00",
        "--account",
        "rl",
        "--gpus-per-node",
        "2",
        f"run_dir={run_dir}",
        f"model.path={tmp_path}",
        "num_generators=2",
        "trainer.num_ranks=4",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, run_dir


def test_dry_run_places_steps_on_generator_and_trainer_nodes(tmp_path):
    script, run_dir = four_node_dry_run(tmp_path)
    assert "submitted" not in script
    assert (run_dir / "slurm_job.sbatch").read_text() == script
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    for want in [
        "--nodes=4",
        "--ntasks-per-node=1",
        "--exclusive",
        "--partition=gpu",
        "--time=0:30:00",
        "--account=rl",
        "--gpus-per-node=2",
        f"--output={run_dir}/slurm-%j.out",
        f"--chdir={ROOT}",
    ]:
        assert f"#SBATCH {want}" in header
    # Node lists come from the allocation when the job starts.
    assert 'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in script
    assert 'GEN_NODES=("${NODES[@]:0:2}")' in script and 'TRAIN_NODES=("${NODES[@]:2:2}")' in script
    steps = script_steps(script)
    assert sorted(steps) == ["buffer", "generator_0", "generator_1", "trainer"]
    placement = {
        "buffer": "${GEN_NODES[0]}",
        "generator_0": "${GEN_NODES[0]}",
        "generator_1": "${GEN_NODES[1]}",
    }
    for name, node in placement.items():
        words = steps[name]
        assert words[2] == "srun"
        assert {"--nodes=1", "--ntasks=1", f"--nodelist={node}", "--exact"} <= set(words)
        module = "asyncrl.buffer.server" if name == "buffer" else "asyncrl.generator.worker"
        # The task writes its own pid file, then becomes the process (srun's pid is not it).
        command = words[words.index("-m") + 1 :]
        assert command[:2] == ["asyncrl.launcher.pidfile", str(run_dir / "pids" / f"{name}.pid")]
        assert command[3:7] == ["-m", module, "--config", str(run_dir / "rollout.json")]
    # The buffer is restarted alone from its saved state, as the local launcher does it.
    assert steps["buffer"][1] == "group=buffer,max_restarts=5" and "--overlap" in steps["buffer"]
    assert steps["generator_1"][1] == "restart,max_restarts=20"
    assert "--gpus-per-task=1" in steps["generator_1"]
    assert steps["generator_1"][-2:] == ["--worker-id", "g1"]
    assert "--export=ALL,OMP_NUM_THREADS=1" in steps["generator_0"]
    trainer = steps["trainer"]
    assert trainer[1] == "final,group=trainer,max_restarts=5"
    assert {
        "--nodes=2",
        "--ntasks-per-node=1",
        "--nodelist=$TRAIN_NODELIST",
        "--exact",
        "--gpus-per-task=2",
        "--kill-on-bad-exit=1",
    } <= set(trainer)
    torchrun = trainer[next(i for i, w in enumerate(trainer) if w.endswith("torchrun")) :]
    assert {
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$TRAIN_HEAD:$RDZV_PORT",
        "--rdzv-id=$SLURM_JOB_ID",
    } <= set(torchrun)
    assert torchrun[-3:] == ["asyncrl.stages.rl", "--config", str(run_dir / "config.json")]
    pid_file = str(run_dir / "pids" / "trainer_{rank}.pid")
    wrapper = ["-m", "asyncrl.launcher.pidfile", shlex.quote(pid_file)]
    assert torchrun[torchrun.index("-m") :][:3] == wrapper
    assert "--stall-timeout-s 60" in script
    # Processes on different nodes meet over TCP on every interface, through the run directory.
    config = json.loads((run_dir / "config.json").read_text())
    assert config["transport"]["scheme"] == "tcp" and config["transport"]["host"] == "*"
    assert json.loads((run_dir / "rollout.json").read_text())["transport"]["host"] == "*"


def test_dry_run_with_a_missing_start_checkpoint_submits_that_stage_first(
    tmp_path, monkeypatch, capsys
):
    """tiny_grpo starts from tiny_sft's export (relative to the working directory):
    missing here, so that stage's job comes first."""
    monkeypatch.chdir(tmp_path)
    out, err = dry_run_here(capsys, "--gen-nodes", "1", "--train-nodes", "2", "trainer.num_ranks=2")
    assert "tiny_sft runs first, as its own job" in err
    assert re.findall(r"#SBATCH --job-name=(\S+)", out) == ["asyncrl-tiny_sft", "asyncrl-tiny_grpo"]
    sft_script = out.split("#!/bin/bash")[1]
    # tiny_sft has one rank, so one of the two trainer nodes; the RL job keeps both.
    assert "#SBATCH --nodes=1" in sft_script and "asyncrl.stages.sft" in sft_script
    assert 'GEN_NODES=("${NODES[@]:0:0}")' in sft_script
    assert list(script_steps(sft_script)) == ["trainer"]


def _stage(ranks: int, generators: int) -> Prepared:
    specs = [ProcessSpec("buffer", "asyncrl.buffer.server", [])]
    specs += [
        ProcessSpec(f"generator_{i}", "asyncrl.generator.worker", [], restartable=True)
        for i in range(generators)
    ]
    specs += [ProcessSpec(f"trainer_{r}", "asyncrl.stages.rl", [], rank=r) for r in range(ranks)]
    # All the steps read of it.
    cfg = SimpleNamespace(run_dir="run", trainer=SimpleNamespace(threads_per_rank=1))
    return Prepared(cfg=cfg, config_path=Path("config.json"), processes=specs)


@pytest.mark.parametrize(
    "ranks, generators, opts, message",
    [
        (3, 1, SlurmOptions(1, 2), "does not split evenly"),
        (2, 1, SlurmOptions(2, 1), "starts 1 generator"),
        (2, 1, SlurmOptions(0, 1), "need --gen-nodes"),
        (2, 2, SlurmOptions(1, 3, nodes=2), "cannot hold"),
        (2, 1, SlurmOptions(1, 1, nodes=1, cpus_per_task=2), "needs 3 CPUs"),
    ],
)
def test_layouts_that_cannot_place_the_processes_are_refused(ranks, generators, opts, message):
    with pytest.raises(LayoutError, match=message):
        process_steps(_stage(ranks, generators), opts, "python")
    assert len(process_steps(_stage(2, 2), SlurmOptions(2, 2), "python")) == 4
    assert (
        len(process_steps(_stage(2, 1), SlurmOptions(1, 1, nodes=1, cpus_per_task=3), "python"))
        == 3
    )


@pytest.mark.parametrize(
    "spec, final, word, options",
    [
        (
            ProcessSpec("buffer", "m", [], group="buffer", max_restarts=5),
            False,
            "group=buffer,max_restarts=5",
            {"group": "buffer", "max_restarts": 5},
        ),
        (
            ProcessSpec("generator_0", "m", [], restartable=True),
            False,
            "restart,max_restarts=20",
            {"restartable": True, "max_restarts": 20},
        ),
        (
            ProcessSpec("trainer_0", "m", [], rank=0, group="trainer", max_restarts=5),
            True,
            "final,group=trainer,max_restarts=5",
            {"final": True, "group": "trainer", "max_restarts": 5},
        ),
        (ProcessSpec("reward", "m", []), False, "once", {}),
    ],
)
def test_a_step_line_carries_its_restart_group_and_budget(spec, final, word, options):
    """What the script writes is what the job's supervisor builds its steps from."""
    assert step_policy(spec, final) == word
    assert parse_policy(word) == options
    assert parse_steps(f"{spec.name} {word} srun python -m {spec.module}") == [
        (spec.name, options, ["srun", "python", "-m", spec.module])
    ]


def test_a_bad_step_line_is_refused():
    with pytest.raises(ValueError, match="unknown step option 'restrat'"):
        parse_steps("generator_0 restrat srun python")
    with pytest.raises(ValueError, match="unknown step option 'max_restarts=many'"):
        parse_steps("buffer group=buffer,max_restarts=many srun python")
    with pytest.raises(ValueError, match="no command"):
        parse_steps("buffer once")


def test_a_task_names_itself_in_its_pid_file_then_becomes_the_process(tmp_path):
    """A step's command as the script writes it: the pid in the file is the process's
    own, after exec (a trainer rank's file is named by its RANK)."""
    pid_file = tmp_path / "pids" / "trainer_{rank}.pid"
    command = [sys.executable, "-c", "import os; print(os.getpid())"]
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.launcher.pidfile", str(pid_file), *command],
        cwd=ROOT,
        env=dict(os.environ, RANK="3"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (tmp_path / "pids" / "trainer_3.pid").read_text() == out


# ---- with a Slurm cluster ------------------------------------------------------------
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


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


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
def test_a_slurm_job_repairs_killed_generator_buffer_and_trainer_losing_nothing(
    tmp_path, tiny_model_dir, slurm_cluster
):
    """tests/test_chaos.py's run as a one-node job: a generator, the buffer and a trainer
    rank SIGKILLed by the pids their tasks wrote (not srun's); the job's supervisor
    restarts the generator step, the buffer step (from its state) and the whole trainer
    step (from its checkpoint); the job exits 0 and the books balance."""
    chaos_args = [
        *["--launcher", "slurm", "--experiment", "experiments/tiny_grpo.py"],
        # 40 s calm: a restarted trainer step takes ~20 s to its first step on a busy machine.
        *["--minutes", "1.25", "--calm-s", "40", "--generator-kills", "1"],
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


# ---- GPUs (no Slurm: a stand-in scontrol resolves the node list) -----------------------
GPU_RUN = [
    "trainer.num_ranks=2",
    "num_generators=2",
    "engine.backend=remote",
    "engine.remote.server=sglang",
    "engine.remote.tp_size=2",
]


def resolved_steps(script: Path, tmp_path: Path, nodes: list[str]) -> dict[str, list[str]]:
    """The steps as bash resolves ``script`` on an allocation of ``nodes``, printed by the
    job's supervisor instead of started (``ASYNCRL_PRINT_STEPS``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(nodes) + "\n")
    scontrol.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST=",".join(nodes),
        SLURM_JOB_ID="7",
        ASYNCRL_PRINT_STEPS="1",
    )
    out = subprocess.run(
        ["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {s["name"]: s["argv"] for s in json.loads(out.stdout[out.stdout.index("[\n") :])}


def test_a_gpu_job_gives_each_step_its_gpus_and_servers_their_tensor_parallel_width(
    tmp_path, capsys
):
    """8 GPUs a node, one generator node and one trainer node: each generator's step holds
    the GPUs of its tp=2 sglang server, the trainer's torchrun one per rank, the buffer none."""
    run_dir = tmp_path / "run"
    script, _ = dry_run_here(
        capsys,
        *("--gen-nodes", "1", "--train-nodes", "1", "--gpus-per-node", "8"),
        f"run_dir={run_dir}",
        f"model.path={tmp_path}",
        *GPU_RUN,
    )
    assert "#SBATCH --gpus-per-node=8" in script.splitlines()
    steps = resolved_steps(run_dir / "slurm_job.sbatch", tmp_path, ["g1", "t1"])
    for name in ("generator_0", "generator_1"):
        assert {"--nodelist=g1", "--exact", "--gpus-per-task=2"} <= set(steps[name])
    assert {"--nodelist=g1", "--overlap", "--gres=none"} <= set(steps["buffer"])
    assert {"--nodelist=t1", "--gpus-per-task=2", "--nproc-per-node=2"} <= set(steps["trainer"])
    # Without --gpus-per-node the servers still need GPUs: the job asks for the busiest
    # node's (two generators of 2 on the generator node).
    script, _ = dry_run_here(
        capsys,
        *("--gen-nodes", "1", "--train-nodes", "1"),
        f"run_dir={tmp_path / 'asked'}",
        f"model.path={tmp_path}",
        *GPU_RUN,
    )
    assert "#SBATCH --gpus-per-node=4" in script.splitlines()
    # On one node of 4 GPUs, 2 × 2 for the servers and 2 for the ranks do not fit.
    proc = dry_run(
        *("--gen-nodes", "1", "--train-nodes", "1", "--nodes", "1", "--gpus-per-node", "4"),
        f"run_dir={tmp_path / 'short'}",
        f"model.path={tmp_path}",
        *GPU_RUN,
    )
    assert proc.returncode == 2
    assert "node 0 of the job needs 6 GPUs for its steps and --gpus-per-node is 4" in proc.stderr
