"""Weights rolled back in place, for the RL guard (``asyncrl.loop.guard``): a good
checkpoint's or the run's start, with the step counters and schedule positions kept (the
version never goes back) and the learning rate lowered."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from asyncrl.models import load_model
from asyncrl.trainer.checkpoint import load_checkpoint
from asyncrl.trainer.core import TrainerCore


def restore_good_weights(
    core: TrainerCore, path: Path, companions: dict[str, TrainerCore], lr_factor: float
) -> None:
    """Load the weights and optimizer state of ``core`` and ``companions`` from ``path``,
    but keep their step counters (the version never goes back) and their schedulers'
    positions; then multiply the policy's learning rate by ``lr_factor``, in the optimizer
    and in the schedule's base rates, so the schedule goes on at the lower level."""
    cores = [core, *companions.values()]
    steps = [c.step for c in cores]
    schedules = [c.scheduler.state_dict() for c in cores]
    for c in cores:
        c.readout.wait()  # a publish still reading the weights
    load_checkpoint(core, path, companions)  # sets the steps and schedules of the checkpoint
    for c, step, schedule in zip(cores, steps, schedules):
        c.step = step
        c.scheduler.load_state_dict(schedule)
        c.set_base_lrs(schedule["base_lrs"])  # the optimizer's came from the checkpoint
    scale_learning_rate(core, lr_factor)


def restore_start_weights(
    core: TrainerCore, companions: dict[str, TrainerCore], lr_factor: float
) -> None:
    """Load the run's starting weights (each core's ``model.path``) with a fresh optimizer
    state; the step counters and schedules stay; the policy's rate × ``lr_factor``."""
    for c in [core, *companions.values()]:
        c.readout.wait()  # a publish still reading the weights
        full = load_model(c.model_cfg).state_dict()
        set_model_state_dict(c.model, full, options=StateDictOptions(full_state_dict=True))
        c.optimizer.state.clear()
    scale_learning_rate(core, lr_factor)


def scale_learning_rate(core: TrainerCore, factor: float) -> None:
    """Multiply the schedule's base rates by ``factor`` and set the optimizer's rates to
    the schedule's value at its current position."""
    core.set_base_lrs([b * factor for b in core.scheduler.base_lrs])
