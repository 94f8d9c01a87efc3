"""Run an experiment on a Slurm cluster.

    python launch/slurm.py experiments/NAME.py --gen-nodes N --train-nodes M
        [--nodes K] [--partition P] [--time T] [--account A] [--gpus-per-node G]
        [--cpus-per-task C] [--stall-timeout-s S] [--dry-run] [key.sub=value ...]

The same experiment files and overrides as ``launch/local.py``, resolved the same way
(``asyncrl.launcher.prepare``): the config is saved as ``RUN_DIR/config.json``, then the
experiment's ``processes()`` become the ``srun`` steps of an sbatch script,
``RUN_DIR/slurm_job.sbatch`` (``asyncrl.launcher.sbatch`` places them on nodes), which
is submitted; the job id and the run directory are printed, and the job's output goes to
``RUN_DIR/slurm-JOBID.out``. ``--dry-run`` writes the run directory and prints the
script but submits nothing (``sbatch RUN_DIR/slurm_job.sbatch`` submits it later). The
job repairs itself as the local launcher does: a dead generator, buffer or trainer step
(all its ranks) is restarted, and a generator stalled for ``--stall-timeout-s`` too.

The run directory must be on a filesystem every node sees: the processes find each other
through the endpoint files in it. A job spanning several nodes therefore talks TCP on
every interface (``transport.scheme=tcp transport.host=*``); a one-node job keeps the
experiment's transport.

Missing inputs (an experiment's ``prerequisites()``, e.g. the SFT policy) are made on the
cluster, not on this (login) machine: the experiments that make them are submitted first,
as a trainer-only job on the trainer nodes, and this job waits for it to succeed
(``--dependency=afterok``). With ``--one-allocation`` the chain is one job instead: each
missing stage runs first in the job's own allocation, its trainer ranks on every node
that splits them evenly (SFT and reward-model training take the whole allocation), then
the experiment splits the same nodes between generators and trainer; no second wait in
the queue, and a stage that fails ends the job.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.launcher.prepare import Prepared, prepare, stage_chain
from asyncrl.launcher.sbatch import LayoutError, SlurmOptions, sbatch_script
from asyncrl.launcher.supervise import add_stall_option

SCRIPT_NAME = "slurm_job.sbatch"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, SlurmOptions]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("experiment", help="experiments/NAME.py, a file that defines `config`")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    parser.add_argument(
        "--gen-nodes", type=int, required=True, help="nodes for generators and the buffer"
    )
    parser.add_argument(
        "--train-nodes", type=int, required=True, help="nodes for the trainer ranks"
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="nodes to allocate (default: gen + train; fewer makes the groups share)",
    )
    parser.add_argument("--partition", default="")
    parser.add_argument("--time", default="", help="time limit, as sbatch --time takes it")
    parser.add_argument("--account", default="")
    parser.add_argument("--gpus-per-node", type=int, default=0)
    parser.add_argument(
        "--cpus-per-task",
        type=int,
        default=0,
        help="CPUs the job holds per node (one task per node); default: whole nodes",
    )
    add_stall_option(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the script; submit nothing")
    parser.add_argument(
        "--one-allocation",
        action="store_true",
        help="run missing prerequisite stages inside this job's allocation, not as jobs of their own",
    )
    args = parser.parse_intermixed_args(argv)
    opts = SlurmOptions(
        args.gen_nodes,
        args.train_nodes,
        args.nodes,
        args.partition,
        args.time,
        args.account,
        args.gpus_per_node,
        args.cpus_per_task,
        args.stall_timeout_s,
    )
    return args, opts


def across_nodes(cfg) -> None:
    """Processes on different nodes cannot share ipc sockets or loopback: bind TCP on
    every interface and advertise the node's name (see ``asyncrl.transport.bind``)."""
    transport = getattr(cfg, "transport", None)
    if transport is not None and (transport.scheme, transport.host) != ("tcp", "*"):
        print(
            f"[slurm] processes span nodes: transport {transport.scheme} -> tcp on every interface",
            file=sys.stderr,
        )
        transport.scheme, transport.host = "tcp", "*"


def init_options(cfg, opts: SlurmOptions, one_allocation: bool = False) -> SlurmOptions:
    """A trainer-only stage that runs first: its ranks on as many of the trainer nodes as
    split them evenly, in a job of its own; or, in the experiment's allocation, on as many
    of all its nodes."""
    ranks = cfg.trainer.num_ranks
    most = opts.total_nodes if one_allocation else min(opts.train_nodes, opts.total_nodes)
    nodes = max(n for n in range(1, most + 1) if ranks % n == 0)
    return SlurmOptions(
        0,
        nodes,
        opts.total_nodes if one_allocation else nodes,
        opts.partition,
        opts.time,
        opts.account,
        opts.gpus_per_node,
        opts.cpus_per_task,
        opts.stall_timeout_s,
    )


def submit(script: Path, after: str | None) -> str:
    """``sbatch --parsable``; returns the job id (raises CalledProcessError)."""
    cmd = ["sbatch", "--parsable"]
    if after is not None:
        cmd += [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
    out = subprocess.run([*cmd, str(script)], capture_output=True, text=True, check=True).stdout
    return out.strip().split(";")[0]  # "ID" or "ID;CLUSTER"


def main(argv: list[str] | None = None) -> int:
    args, opts = parse_args(argv)
    try:
        chain = stage_chain(args.experiment, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for cfg in chain[:-1]:
        where = "first in the same allocation" if args.one_allocation else "first, as its own job"
        print(
            f"[slurm] an input of {chain[-1].name} is missing: {cfg.name} runs {where}",
            file=sys.stderr,
        )
    try:
        jobs = scripts(chain, opts, args.one_allocation)
    except (ConfigError, LayoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    after = None
    for stage, text in jobs:
        script = stage.run_dir / SCRIPT_NAME
        script.write_text(text)
        if args.dry_run:
            print(text, end="")
            continue
        try:
            after = submit(script, after)
        except FileNotFoundError:
            print("error: sbatch not found; is this a Slurm login node?", file=sys.stderr)
            return 1
        except subprocess.CalledProcessError as e:
            print(f"error: sbatch failed: {e.stderr.strip()}", file=sys.stderr)
            return 1
        out = stage.run_dir.resolve() / f"slurm-{after}.out"
        print(
            f"[slurm] submitted batch job {after}; run directory {stage.run_dir.resolve()}; output {out}"
        )
    return 0


def scripts(chain: list, opts: SlurmOptions, one_allocation: bool) -> list[tuple[Prepared, str]]:
    """Each job to submit, in order, with its script: one per stage, or with
    ``one_allocation`` one job that runs the whole chain."""
    prepared = []
    for cfg in chain:
        stage_opts = opts if cfg is chain[-1] else init_options(cfg, opts, one_allocation)
        stage = prepare(cfg, across_nodes if stage_opts.total_nodes > 1 else None)
        prepared.append((stage, stage_opts))
    if one_allocation:
        (stage, stage_opts), before = prepared[-1], prepared[:-1]
        return [(stage, sbatch_script(stage, stage_opts, Path.cwd(), before=before))]
    return [(stage, sbatch_script(stage, o, Path.cwd())) for stage, o in prepared]


if __name__ == "__main__":
    sys.exit(main())
