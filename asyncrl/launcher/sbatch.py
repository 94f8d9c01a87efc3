"""A stage's process list as an sbatch script of ``srun`` steps.

Placement, over the allocation's nodes in ``scontrol show hostnames`` order: generators
(restartable processes) round-robin on the first ``gen_nodes``; other single processes
(the buffer) on the first of those (or the first node when there are none); the trainer
ranks as one step of ``torchrun`` per node on the last ``train_nodes``, meeting through
torchrun's c10d rendezvous on the first trainer node. When the job has fewer nodes than
``gen_nodes + train_nodes`` the two groups overlap (one node: everything on it). Each
step asks for its own GPUs (a generator its engine's, with its servers' tensor-parallel
width; a torchrun one per rank; the buffer none) and no node may need more than the job's
``--gpus-per-node`` (``asyncrl.launcher.devices``).

The script resolves the node names when the job starts, then hands the steps, one a line
(``NAME POLICY srun ...``), to ``asyncrl.launcher.slurm_job``, which starts and supervises
them: POLICY (``step_policy``) carries each process's restart group and budget, so a dead
buffer or trainer step is restarted as the local launcher restarts it. Each step's
command writes its own pid file (``asyncrl.launcher.pidfile``). The processes find each
other through the run directory on the shared filesystem (endpoint files), so nothing but
the rendezvous port is chosen here.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from asyncrl.launcher.devices import job_gpus_per_node, slurm_step_gpus, srun_gpu_flags
from asyncrl.launcher.prepare import Prepared
from asyncrl.launcher.supervise import STALL_TIMEOUT_S
from asyncrl.stages.common import ProcessSpec


class LayoutError(ValueError):
    """Options that cannot place this experiment's processes."""


@dataclass
class SlurmOptions:
    gen_nodes: int
    """Nodes for the generators (and the buffer)."""
    train_nodes: int
    """Nodes for the trainer ranks; ``trainer.num_ranks`` is split evenly over them."""
    nodes: int = 0
    """Nodes the job allocates; 0 means ``gen_nodes + train_nodes``. Fewer makes the two
    groups share nodes (a one-node cluster runs everything on its node)."""
    partition: str = ""
    time: str = ""
    account: str = ""
    gpus_per_node: int = 0
    """GPUs per node; 0: none, or what the steps need when a process needs a GPU
    (``asyncrl.launcher.devices``: a generator gets its engine's, with its servers'
    tensor-parallel width, each trainer node one per local rank)."""
    cpus_per_task: int = 0
    """CPUs the job holds on each node (one task per node); 0 takes whole nodes."""
    stall_timeout_s: float = STALL_TIMEOUT_S
    """Seconds a generator's loop may go without marking it turns before the job's
    supervisor kills and restarts it (0: never; see ``asyncrl.launcher.supervise``)."""

    @property
    def total_nodes(self) -> int:
        return self.nodes or self.gen_nodes + self.train_nodes


def heredoc_word(text: str) -> str:
    """``text`` as one shell word inside the script's unquoted here-document, where bash
    still expands ``$`` and backquotes: quoted for ``shlex.split``, escaped for bash."""
    quoted = shlex.quote(text)
    return quoted.replace("\\", "\\\\").replace("$", "\\$").replace("`", "\\`")


def torchrun_path() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.exists() else "torchrun"


def step_policy(spec: ProcessSpec, final: bool = False) -> str:
    """How the job's supervisor treats a step, as one word of comma-separated options
    (``asyncrl.launcher.slurm_job.parse_policy`` reads it back): ``restart`` (started
    again alone when it dies: a generator), ``group=G`` (restarted with its restart
    group, from saved state), ``max_restarts=N`` (its budget), ``final`` (the job ends
    when it exits 0); ``once`` when none applies (a death ends the job)."""
    options = ["final"] * final + ["restart"] * spec.restartable
    options += [f"group={spec.group}"] if spec.group else []
    if spec.restartable or spec.group:
        options.append(f"max_restarts={spec.max_restarts}")
    return ",".join(options) or "once"


def named_command(python: str, pid_file: str, spec: ProcessSpec) -> list[str]:
    """``python -m MODULE ARGS`` through ``asyncrl.launcher.pidfile``: under ``srun`` the
    supervisor's child is srun, so the task writes its own pid file."""
    wrapper = [python, "-m", "asyncrl.launcher.pidfile", pid_file]
    return [*wrapper, python, "-m", spec.module, *spec.args]


def check_layout(
    stage: Prepared, opts: SlurmOptions
) -> tuple[list[ProcessSpec], list[ProcessSpec]]:
    """The stage's trainer ranks and its other processes, after checking they fit."""
    ranks = [p for p in stage.processes if p.rank is not None]
    others = [p for p in stage.processes if p.rank is None]
    # Generators and reward servers: each holds CPUs (and GPUs) of its own on a gen node.
    generators = [p for p in others if p.restartable]
    if not ranks:
        raise LayoutError("the experiment starts no trainer ranks, so nothing would end the job")
    if opts.train_nodes < 1 or opts.gen_nodes < 0:
        raise LayoutError("--train-nodes must be at least 1 and --gen-nodes at least 0")
    if max(opts.train_nodes, opts.gen_nodes) > opts.total_nodes:
        raise LayoutError(
            f"{opts.total_nodes} nodes cannot hold {opts.gen_nodes} generator "
            f"and {opts.train_nodes} trainer nodes"
        )
    if len(ranks) % opts.train_nodes:
        raise LayoutError(
            f"trainer.num_ranks={len(ranks)} does not split evenly over "
            f"{opts.train_nodes} trainer nodes"
        )
    if generators and opts.gen_nodes == 0:
        raise LayoutError(
            f"{len(generators)} generator(s) and reward server(s) need --gen-nodes of at least 1"
        )
    if opts.gen_nodes > max(len(generators), 1 if others else 0):  # a node would sit idle
        raise LayoutError(
            f"--gen-nodes {opts.gen_nodes} but the experiment starts {len(generators)} "
            "generator(s) and reward server(s)"
        )
    if len({(p.module, tuple(p.args), p.threads) for p in ranks}) != 1:
        raise LayoutError(
            "trainer ranks differ in module, arguments or threads; one torchrun cannot start them"
        )
    return ranks, others


def process_steps(stage: Prepared, opts: SlurmOptions, python: str) -> list[str]:
    """One ``NAME POLICY srun ...`` line per step, with the node variables of the prologue."""
    ranks, others = check_layout(stage, opts)
    pids = stage.run_dir.resolve() / "pids"
    gpus = slurm_step_gpus(stage.cfg, stage.processes, opts)  # raises when a node is short
    lines, generator_cpus = side_steps(others, opts, python, pids, gpus)
    head = opts.total_nodes - opts.train_nodes  # the first trainer node's index in the allocation
    if opts.cpus_per_task and stage.cfg.trainer.threads_per_rank > 0:
        check_cpus(generator_cpus, len(ranks) // opts.train_nodes * max(ranks[0].threads, 1), opts)
    shared = generator_cpus[head] if head < opts.gen_nodes else 0
    return lines + [trainer_step(stage, ranks, opts, shared, python, gpus.get("trainer", 0))]


def side_steps(
    others: list[ProcessSpec], opts: SlurmOptions, python: str, pids: Path, gpus: dict[str, int]
) -> tuple[list[str], list[int]]:
    """The steps of the buffer and the generators, and the CPUs generators hold per node;
    ``gpus``: each step's GPUs (``slurm_step_gpus``)."""
    lines, generators, generator_cpus = [], 0, [0] * opts.gen_nodes
    for spec in others:
        threads = max(spec.threads, 1)
        if spec.restartable:
            index, generators = generators % opts.gen_nodes, generators + 1  # round-robin
            node = f"${{GEN_NODES[{index}]}}"
            generator_cpus[index] += threads
            # Each generator holds its own CPUs (and GPUs: its engine's) for decoding.
            resources = [f"--cpus-per-task={threads}"]
        else:
            node = "${GEN_NODES[0]}" if opts.gen_nodes else "${NODES[0]}"
            # The buffer is an event loop: it shares its node's CPUs instead of taking one
            # from a generator (a node's CPUs are often all spoken for).
            resources = [f"--cpus-per-task={threads}", "--overlap"]
        resources += srun_gpu_flags(gpus.get(spec.name, 0), opts.gpus_per_node)
        srun = [
            "srun",
            f"--job-name={spec.name}",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={node}",
            "--exact",
            *resources,
            f"--export=ALL,OMP_NUM_THREADS={threads}",
        ]
        command = named_command(python, str(pids / f"{spec.name}.pid"), spec)
        lines.append(" ".join([spec.name, step_policy(spec), *srun, *map(heredoc_word, command)]))
    return lines, generator_cpus


def check_cpus(generator_cpus: list[int], trainer_cpus: int, opts: SlurmOptions) -> None:
    """With ``--cpus-per-task`` the job holds that many CPUs a node; a step that does not
    fit would wait inside the job forever, so refuse the layout here instead."""
    head = opts.total_nodes - opts.train_nodes
    for node in range(opts.total_nodes):
        want = (generator_cpus[node] if node < opts.gen_nodes else 0) + (
            trainer_cpus if node >= head else 0
        )
        if want > opts.cpus_per_task:
            raise LayoutError(
                f"node {node} of the job needs {want} CPUs for its steps but "
                f"--cpus-per-task is {opts.cpus_per_task}"
            )


def trainer_step(
    stage: Prepared,
    ranks: list[ProcessSpec],
    opts: SlurmOptions,
    shared_cpus: int,
    python: str,
    gpus: int = 0,
) -> str:
    """The trainer ranks: one torchrun per trainer node, ``shared_cpus`` of whose CPUs
    generators already hold (when the groups overlap), with ``gpus`` GPUs (its ranks')."""
    per_node = len(ranks) // opts.train_nodes
    if stage.cfg.trainer.threads_per_rank > 0:
        threads: int | str = max(ranks[0].threads, 1)
        cpus: int | str = per_node * threads
    else:
        # threads_per_rank=0 means "the node's cores": those of the compute node, counted
        # when the job starts, not those of the machine that wrote this script.
        node_cpus = opts.cpus_per_task or "$SLURM_CPUS_ON_NODE"
        cpus = f"$(({node_cpus} - {shared_cpus}))"
        threads = f"$((({node_cpus} - {shared_cpus}) / {per_node}))"
    srun = [
        "srun",
        "--job-name=trainer",
        f"--nodes={opts.train_nodes}",
        f"--ntasks={opts.train_nodes}",
        "--ntasks-per-node=1",
        "--nodelist=$TRAIN_NODELIST",
        "--exact",
        f"--cpus-per-task={cpus}",
        *srun_gpu_flags(gpus, opts.gpus_per_node),
        *(["--label"] if opts.train_nodes > 1 else []),
        # One torchrun dying takes the step down rather than leaving its peers waiting.
        "--kill-on-bad-exit=1",
        f"--export=ALL,OMP_NUM_THREADS={threads}",
    ]
    torchrun = [
        heredoc_word(torchrun_path()),
        f"--nnodes={opts.train_nodes}",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$TRAIN_HEAD:$RDZV_PORT",
        "--rdzv-id=$SLURM_JOB_ID",
        "--max-restarts=0",
    ]
    # torchrun runs "python -m" + this: the pid file wrapper, which becomes the rank.
    pid_file = str(stage.run_dir.resolve() / "pids" / "trainer_{rank}.pid")
    command = named_command(python, pid_file, ranks[0])[1:]
    policy = step_policy(ranks[0], final=True)
    return " ".join(["trainer", policy, *srun, *torchrun, *map(heredoc_word, command)])


def job_header(stage: Prepared, opts: SlurmOptions, workdir: Path) -> list[str]:
    run_dir = stage.run_dir.resolve()
    lines = [
        f"--job-name=asyncrl-{stage.cfg.name}",
        f"--nodes={opts.total_nodes}",
        "--ntasks-per-node=1",
    ]
    lines += [f"--cpus-per-task={opts.cpus_per_task}"] if opts.cpus_per_task else ["--exclusive"]
    lines += [f"--partition={opts.partition}"] if opts.partition else []
    lines += [f"--time={opts.time}"] if opts.time else []
    lines += [f"--account={opts.account}"] if opts.account else []
    lines += [f"--gpus-per-node={opts.gpus_per_node}"] if opts.gpus_per_node else []
    lines += [f"--output={run_dir}/slurm-%j.out", f"--chdir={workdir}"]
    return [f"#SBATCH {line}" for line in lines]


def sbatch_script(
    stage: Prepared,
    opts: SlurmOptions,
    workdir: Path,
    python: str = sys.executable,
    before: list[tuple[Prepared, SlurmOptions]] = (),
) -> str:
    """The whole batch script for ``stage`` (raises ``LayoutError`` when it cannot fit).
    ``before``: stages that run first in the same allocation, one after another, each
    with its own placement over the job's nodes (a chain on one allocation: SFT and the
    reward model on every node, then RL split between generators and trainer)."""
    opts = replace(opts, gpus_per_node=job_gpus_per_node(stage.cfg, stage.processes, opts))
    blocks = [
        stage_block(first, replace(o, gpus_per_node=opts.gpus_per_node), python, final=False)
        for first, o in before
    ]
    blocks.append(stage_block(stage, opts, python, final=True))
    k = opts.total_nodes
    prologue = f"""set -euo pipefail
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${{#NODES[@]}}" -ne {k} ]; then
  echo "expected {k} nodes, got: ${{NODES[*]:-none}}" >&2
  exit 1
fi
# torchrun's c10d rendezvous store listens on the first trainer node. The port follows from
# the job id (below Linux's ephemeral range), so jobs sharing a node do not collide.
RDZV_PORT=$((10000 + SLURM_JOB_ID % 20000))
export PYTHONUNBUFFERED=1
# Each step line: step name, policy (comma-separated: restart: a generator, started again
# when it dies | group=G: restarted with its group from saved state | max_restarts=N |
# final: the stage ends when it exits 0 | once: a death ends the job), then the srun command."""
    header = [
        "#!/bin/bash",
        f"# asyncrl: {stage.cfg.name} in {stage.run_dir.resolve()} (written by launch/slurm.py)",
        *job_header(stage, opts, workdir),
    ]
    return "\n".join([*header, prologue, *blocks, ""])


def stage_block(stage: Prepared, opts: SlurmOptions, python: str, final: bool) -> str:
    """One stage's part of the script: its node groups over the allocation, then its
    steps handed to the job's supervisor (``exec`` for the job's last stage; an earlier
    one must end well for the script to go on)."""
    steps = process_steps(stage, opts, python)
    n, m, k = opts.gen_nodes, opts.train_nodes, opts.total_nodes
    run_dir = stage.run_dir.resolve()
    run = "exec " if final else ""
    return "\n".join(
        [
            f"""# {stage.cfg.name}: generators (and the buffer) on the first {n} nodes, trainer ranks
# on the last {m}; the groups overlap when the job has fewer nodes.
GEN_NODES=("${{NODES[@]:0:{n}}}")
TRAIN_NODES=("${{NODES[@]:{k - m}:{m}}}")
TRAIN_NODELIST=$(IFS=,; echo "${{TRAIN_NODES[*]}}")
TRAIN_HEAD=${{TRAIN_NODES[0]}}
echo "[slurm] job $SLURM_JOB_ID, {stage.cfg.name}: generator nodes: ${{GEN_NODES[*]:-none}};" \\
  "trainer nodes: ${{TRAIN_NODES[*]}}; rendezvous $TRAIN_HEAD:$RDZV_PORT"
{run}{shlex.quote(python)} -m asyncrl.launcher.slurm_job {shlex.quote(str(run_dir))} \\
  --stall-timeout-s {opts.stall_timeout_s:g} <<STEPS""",
            *steps,
            "STEPS",
        ]
    )
