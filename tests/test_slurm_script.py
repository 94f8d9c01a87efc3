"""The Slurm launcher's sbatch script, without Slurm: a dry run places steps on the right
node lists and GPUs, a missing start checkpoint submits its stage first, bad layouts and
step lines are refused, and a stand-in ``scontrol`` resolves a GPU job's steps."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.launcher.prepare import Prepared
from asyncrl.launcher.sbatch import LayoutError, SlurmOptions, process_steps, step_policy
from asyncrl.launcher.slurm_job import parse_policy, parse_steps
from asyncrl.stages.common import ProcessSpec

ROOT = Path(__file__).resolve().parents[1]


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


def test_one_allocation_runs_the_missing_stage_first_inside_the_same_job(
    tmp_path, monkeypatch, capsys
):
    """With --one-allocation the chain is one job: tiny_sft's steps on every node that
    splits its ranks, then tiny_grpo's, split between generators and trainer."""
    monkeypatch.chdir(tmp_path)
    out, err = dry_run_here(
        capsys, "--gen-nodes", "1", "--train-nodes", "2", "trainer.num_ranks=2", "--one-allocation"
    )
    assert "tiny_sft runs first in the same allocation" in err
    assert re.findall(r"#SBATCH --job-name=(\S+)", out) == ["asyncrl-tiny_grpo"]
    assert out.count("#!/bin/bash") == 1 and "#SBATCH --nodes=3" in out
    sft, rl = out.split("<<STEPS\n")[1:]
    # tiny_sft's one rank: one node of the three, the last; its supervisor must end well
    # (no exec) for the script to go on to RL, which the job's supervisor then becomes.
    sft_block, rl_block = out.split("# tiny_sft:")[1], out.split("# tiny_grpo:")[1]
    assert (
        'GEN_NODES=("${NODES[@]:0:0}")' in sft_block
        and 'TRAIN_NODES=("${NODES[@]:2:1}")' in sft_block
    )
    assert "\nexec " not in sft_block.split("<<STEPS")[0] and "asyncrl.stages.sft" in sft
    assert (
        'TRAIN_NODES=("${NODES[@]:1:2}")' in rl_block and "\nexec " in rl_block.split("<<STEPS")[0]
    )
    assert {"buffer", "generator_0", "trainer"} <= set(script_steps("<<STEPS\n" + rl))


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
