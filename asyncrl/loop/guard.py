"""The collapse guard of the RL stage: each step's statistics (policy entropy, reward,
gradient norm, clip fraction, importance weight) judged against their own running
history, and an action when one is out of line.

Who talks to it. ``asyncrl.stages.rl``'s loop calls ``Guard.start_step`` with the batch
before the update and ``Guard.end_step`` after it, before the weights are published. The
policy's ``TrainerCore`` calls ``Guard.check`` (its ``step_check``) between the backward
pass and the optimizer step with the update's loss, gradient norm and loss metrics;
``policy_loss`` computes the entropy for it (no grad) when the guard watches entropy.

What it owns. ``Monitor`` (``asyncrl.loop.monitor``): an exponential moving mean and
variance per metric over healthy steps, and the rules that flag a value (``RULES``,
``GuardConfig``). Its own
checkpoint of the last good weights under ``RUN_DIR/guard/`` ("good": weights whose own
step statistics passed the guard, saved every ``checkpoint_every`` healthy steps, one
kept; before the first, the run's start, ``model.path``). Its event counts and the
learning-rate scale, logged every step as ``guard/*``.

The actions (``GuardConfig.action``): ``warn`` logs the metric, its value and its running
level; ``skip`` refuses the update before the optimizer applies it (every watched
statistic is known once the backward pass is done), as the core refuses a non-finite
one: nothing changed, nothing to restore; ``rollback`` restores the last good weights and
optimizer state, keeps the step counter (the version only increases: generators and
buffer count staleness by it, and the restored weights go out as the next version) and
the schedule's position, and lowers the learning rate by ``lr_factor``.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

from asyncrl.loop.monitor import Flag, GuardConfig, Monitor
from asyncrl.trainer.checkpoint import latest_checkpoint, save_checkpoint
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import all_reduce_sum
from asyncrl.trainer.restore import (
    restore_good_weights,
    restore_start_weights,
    scale_learning_rate,
)
from asyncrl.wire import Sample

log = logging.getLogger(__name__)


class GuardError(RuntimeError):
    """The guard acted too often (``GuardConfig.max_actions``)."""


class Guard:
    """The RL stage's guard (see the module docstring): judges each step through the
    policy core's ``step_check`` and acts in ``end_step``. With ``action="off"`` every
    method is a no-op that returns nothing."""

    def __init__(
        self,
        cfg: GuardConfig,
        run_dir: str,
        max_staleness: int | None,
        core: TrainerCore,
        companions: dict[str, TrainerCore],
    ) -> None:
        self.cfg = cfg
        self.core, self.companions = core, companions
        self.monitor = Monitor(self.cfg)
        self.root = Path(run_dir) / "guard"
        # After a rollback, the batches of the next max_staleness steps may hold tokens of
        # the rolled-back versions (step i's are of version i − max_staleness or newer):
        # their reward and importance weights judge those, not the restored weights, so the
        # guard neither judges nor learns from them (unbounded staleness: a warmup's worth).
        self.cooldown = cfg.warmup_steps if max_staleness is None else max_staleness
        self.quiet_until = 0
        self.counts = {"events": 0, "warnings": 0, "skips": 0, "rollbacks": 0}
        self.skips_in_a_row = 0
        self.lr_scale = 1.0
        self.since_saved: int | None = None  # healthy steps since the last good checkpoint
        self.reward = math.nan
        self.values: dict[str, float] = {}
        self.flags: list[Flag] | None = None  # this step's verdict; None: not judged yet
        if self.cfg.action != "off":
            core.step_check = self.check

    def start_step(self, samples: list[Sample]) -> None:
        """Before the step's update: the batch's mean reward over every rank's share."""
        self.flags, self.values = None, {}
        if self.cfg.action == "off":
            return
        if self.since_saved is None and self.core.info.is_main:
            forget_after(self.root, self.core.step)
        total, n = all_reduce_sum([sum(s.reward for s in samples), len(samples)], self.device)
        self.reward = total / max(n, 1.0)

    def check(self, loss: float, grad_norm: float, metrics: dict[str, float]) -> bool:
        """The core's ``step_check``, before each optimizer step: whether to apply the
        update. The step's first update is judged (and, when healthy and due, its starting
        weights saved as good); the step's later updates get the same answer."""
        if self.flags is None:
            found = {"train/loss": loss, "train/grad_norm": grad_norm, **metrics}
            found["rollout/reward"] = self.reward
            self.values = {k: found[k] for k in self.cfg.metrics if k in found}
            self.flags = [] if self.quiet else self.monitor.judge(self.values)
            if not self.flags and not self.quiet and self.cfg.action == "rollback":
                self.save_if_due()  # only a rollback needs good weights kept
        return not (self.flags and self.cfg.action == "skip")

    @property
    def quiet(self) -> bool:
        return self.core.step < self.quiet_until

    @property
    def device(self):
        return self.core.info.device

    def save_if_due(self) -> None:
        """Save the weights the step starts from: their own statistics just passed. The
        first step's are the run's start, good by definition; later ones are saved only
        once the monitor judges (past its warmup)."""
        first = self.since_saved is None
        due = first or self.since_saved >= self.cfg.checkpoint_every
        if not due or not (first or self.monitor.judging(self.values)):
            return
        if not self.core.optimizer.state:  # the first update's: the start is model.path
            self.since_saved = 0
            return
        save_checkpoint(self.core, self.root, {}, keep=1, companions=self.companions)
        self.since_saved = 0

    def end_step(self) -> dict[str, float]:
        """After the step's update(s), before the publish: act on the verdict (warn, count
        a skip, or roll back) and learn from a healthy step. Returns the ``guard/*``
        scalars: event counts (cumulative), this step's flag per metric, the lr scale."""
        if self.cfg.action == "off":
            return {}
        flags = self.flags or []
        if flags:
            self.act(flags)
        elif self.flags is not None and not self.quiet:  # judged healthy
            self.monitor.observe(self.values)
            self.skips_in_a_row = 0
            self.since_saved = None if self.since_saved is None else self.since_saved + 1
        flagged = {f.metric for f in flags}
        scalars = {f"guard/{k}": float(v) for k, v in self.counts.items()}
        scalars |= {f"guard/flag/{m}": float(m in flagged) for m in self.cfg.metrics}
        return scalars | {"guard/lr_scale": self.lr_scale}

    def act(self, flags: list[Flag]) -> None:
        self.counts["events"] += 1
        action = self.cfg.action
        what = {"warn": "training on", "skip": "update skipped", "rollback": "rolling back"}
        log.warning(f"[guard] step {self.core.step}: {'; '.join(map(str, flags))}; {what[action]}")
        if action == "warn":
            self.counts["warnings"] += 1
            self.monitor.observe(self.values)  # a lasting shift becomes the new level
        elif action == "skip":
            self.counts["skips"] += 1
            self.skips_in_a_row += 1
            if self.skips_in_a_row >= self.cfg.max_actions:
                raise GuardError(f"{self.skips_in_a_row} steps in a row skipped: {flags[0]}")
        else:
            self.rollback(flags)

    def rollback(self, flags: list[Flag]) -> None:
        if self.counts["rollbacks"] >= self.cfg.max_actions:
            raise GuardError(
                f"{self.counts['rollbacks']} rollbacks already (guard.max_actions); the "
                f"policy collapsed again at lr scale {self.lr_scale:g}: {flags[0]}"
            )
        path = latest_checkpoint(self.root)
        if path is not None:
            restore_good_weights(self.core, path, self.companions, self.cfg.lr_factor)
        else:  # no update had passed yet: the run's start, whose optimizer had no state
            restore_start_weights(self.core, self.companions, self.cfg.lr_factor)
        self.counts["rollbacks"] += 1
        self.lr_scale *= self.cfg.lr_factor
        self.quiet_until = self.core.step + 1 + self.cooldown
        self.since_saved = 0
        restored = path.name if path is not None else "the starting weights"
        log.warning(f"[guard] restored {restored}, learning rate × {self.lr_scale:g}")

    def state_dict(self) -> dict:
        """What a trainer checkpoint keeps of the guard (a restart resumes its history)."""
        return {
            "monitor": self.monitor.state_dict(),
            "counts": self.counts,
            "lr": self.lr_scale,
            "quiet_until": self.quiet_until,
            "since_saved": self.since_saved,
            "skips_in_a_row": self.skips_in_a_row,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from a trainer checkpoint (loaded into the core already, at the config's
        rates): the history, the counts, and the rollbacks' lower rate."""
        self.monitor.load_state_dict(state.get("monitor", {}))
        self.counts.update(state.get("counts", {}))
        self.lr_scale = state.get("lr", 1.0)
        self.quiet_until = state.get("quiet_until", 0)
        self.since_saved = state.get("since_saved")
        self.skips_in_a_row = state.get("skips_in_a_row", 0)
        if self.lr_scale != 1.0:
            scale_learning_rate(self.core, self.lr_scale)


def forget_after(root: Path, step: int) -> None:
    """Delete good-weight checkpoints of steps after ``step``: a trainer restarted from an
    older checkpoint must not roll forward to weights its dead process saved later."""
    for path in root.glob("step_*"):
        if path.is_dir() and path.name[5:].isdigit() and int(path.name[5:]) > step:
            shutil.rmtree(path, ignore_errors=True)
