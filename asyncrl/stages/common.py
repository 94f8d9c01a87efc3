"""What every stage's process does around its loop: read the resolved config from the run
directory, join the trainer process group, pin threads and seeds, and always leave the
group cleanly. A stage module exposes ``run(cfg, info)`` and calls ``stage_main(run)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.config import load_json
from asyncrl.metrics import MetricsLogger
from asyncrl.trainer.checkpoint import latest_checkpoint, load_checkpoint
from asyncrl.trainer.core import TrainerCore, barrier
from asyncrl.trainer.dist import (
    DistInfo,
    all_reduce_max,
    init_distributed,
    set_malloc_mmap_threshold,
    shutdown_distributed,
)


def threads_for(threads_per_rank: int, num_ranks: int) -> int:
    """``threads_per_rank``, or the machine's cores shared among the ranks when it is 0."""
    if threads_per_rank > 0:
        return threads_per_rank
    return max(1, (os.cpu_count() or 1) // max(num_ranks, 1))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def stage_clock(run_dir: str, info: DistInfo) -> float:
    """When this stage's training began (Unix time), the same for trainer ranks restarted
    by the same launcher: the first trainer process of a launch writes it to
    ``RUN_DIR/clock.json``, restarted ones read it back, so ``time_limit_s`` and the
    ``time`` of logged records count from the first start, not from each restart. A new
    launch (``ASYNCRL_LAUNCH_ID``, set by the launchers) starts a new clock."""
    path, launch = Path(run_dir) / "clock.json", os.environ.get("ASYNCRL_LAUNCH_ID", "")
    now = time.time()
    if launch and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("launch") == launch:
            return float(saved["start"])
    barrier()  # every rank has looked before rank 0 writes
    if info.is_main and launch:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"launch": launch, "start": now}))
        os.replace(tmp, path)
    return now


def out_of_time(start: float, limit_s: float, info: DistInfo) -> bool:
    """Whether the stage's time limit has passed, agreed by all ranks (so all stop together)."""
    late = limit_s > 0 and time.time() - start > limit_s
    return bool(all_reduce_max(int(late), info.device))


def stage_main(run: Callable[[Any, DistInfo], Any], argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run one trainer rank of a stage.")
    parser.add_argument("--config", required=True, help="resolved config JSON in the run directory")
    args = parser.parse_args(argv)
    # The stage's own notes (pairs being made, weights sent) go to its log; libraries' stay
    # at warnings.
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("asyncrl").setLevel(logging.INFO)
    cfg = load_json(args.config)
    torch.set_num_threads(threads_for(cfg.trainer.threads_per_rank, cfg.trainer.num_ranks))
    set_malloc_mmap_threshold(cfg.trainer.malloc_mmap_threshold)
    seed_everything(cfg.seed)
    info = init_distributed(cfg.trainer.device, str(Path(cfg.run_dir) / "rendezvous"))
    try:
        run(cfg, info)
    except BaseException:
        # Leave without the barrier: peers are torn down by the launcher.
        sys.stderr.flush()
        raise
    shutdown_distributed()


@dataclass
class ProcessSpec:
    """One process of a run, as the launchers start it."""

    name: str
    """Also names its log file, ``RUN_DIR/logs/NAME.log``."""
    module: str
    """Run as ``python -m MODULE ARGS``."""
    args: list[str]
    rank: int | None = None
    """Trainer rank (sets RANK / WORLD_SIZE / LOCAL_RANK), or None for other processes."""
    restartable: bool = False
    """A death is repaired by starting it again (generators) rather than ending the run."""
    group: str = ""
    """A restart group: a death of one takes the group down and starts it again, from its
    saved state (the buffer; the trainer ranks together, from their newest checkpoint).
    Empty: a death ends the run (unless ``restartable``)."""
    max_restarts: int = 20
    """Deaths repaired before one ends the run (a process that keeps dying has a bug)."""
    threads: int = 1
    """OMP_NUM_THREADS for it."""


def trainer_ranks(cfg, config_path: str, group: str = "") -> list[ProcessSpec]:
    """The trainer ranks of a stage whose module is ``cfg.entry``; ``group``: restarted
    together from the newest checkpoint when one dies (see ``ProcessSpec.group``)."""
    n = cfg.trainer.num_ranks
    threads = threads_for(cfg.trainer.threads_per_rank, n)
    return [
        ProcessSpec(
            f"trainer_{r}",
            cfg.entry,
            ["--config", config_path],
            rank=r,
            threads=threads,
            group=group,
            max_restarts=5,
        )
        for r in range(n)
    ]


def resume_or_evaluate(
    resume: bool,
    eval_every: int,
    core: TrainerCore,
    ckpt_root: Path,
    evaluate: Callable[[], dict[str, float]],
    log: MetricsLogger,
) -> tuple[int, dict[str, float]]:
    """An offline stage's start (SFT, reward model, DPO): resume from the newest checkpoint
    when ``resume``, or evaluate the starting model when evaluation is on
    (``eval_every``). Returns the data position and the starting evaluation ({} when
    resumed)."""
    resume_from = latest_checkpoint(ckpt_root) if resume else None
    if resume_from is not None:
        position = load_checkpoint(core, resume_from)["position"]
        log.progress(core.step)
        return position, {}
    scalars = {}
    if eval_every:
        scalars = evaluate()
        log.log(0, scalars)
    return 0, scalars
