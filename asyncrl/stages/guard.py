"""The collapse guard of the RL stage: each step's statistics (policy entropy, reward,
gradient norm, clip fraction, importance weight) judged against their own running
history, and an action when one is out of line.

Who talks to it. ``asyncrl.stages.rl``'s loop calls ``Guard.start_step`` with the batch
before the update and ``Guard.end_step`` after it, before the weights are published. The
policy's ``TrainerCore`` calls ``Guard.check`` (its ``step_check``) between the backward
pass and the optimizer step with the update's loss, gradient norm and loss metrics;
``policy_loss`` computes the entropy for it (no grad) when the guard watches entropy.

What it owns. ``Monitor``: an exponential moving mean and variance per metric over
healthy steps, and the rules that flag a value (``RULES``, ``GuardConfig``). Its own
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

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

ENTROPY = "train/entropy"

RULES: dict[str, tuple[Literal["high", "low", "both"], float, float]] = {
    ENTROPY: ("high", 0.0, 0.0),  # a blow-up; a collapse has its own rule (entropy_fraction)
    "rollout/reward": ("low", 0.0, 0.0),
    "train/grad_norm": ("high", 0.0, 3.0),
    "train/clip_fraction": ("high", 0.05, 0.0),
    "train/importance_weight": ("both", 0.05, 0.0),
}
"""Per metric: which way a deviation counts (``both`` for any metric not named here), the
least absolute deviation that counts, and a ratio to the level in place of
``GuardConfig.min_ratio`` (0: that one). The fractions and weights are bounded quantities
that sit near a constant (clip fraction 0 when the first update's own forward is the
proximal policy): without a least deviation, a blip over a level of variance zero would
count. Gradient norms are heavy-tailed (2.5× the level occurs in healthy runs), hence 3×."""


def entropy_for_the_guard(
    logits: torch.Tensor, loss_mask: torch.Tensor, temperature: float, chunk: int = 512
) -> torch.Tensor:
    """``token_entropy``'s values ``[rows, T]`` at the loss positions (0 elsewhere), with no
    grad, ``chunk`` positions at a time: the float32 softmax of a 150k-token vocabulary
    over a whole micro-batch at once would take gigabytes, for a metric alone."""
    out = torch.zeros(loss_mask.shape, dtype=torch.float32, device=logits.device)
    # Token t's distribution is the logits at t − 1; t = 0 has none (and is no loss token).
    rows, cols = torch.nonzero(loss_mask[:, 1:] > 0, as_tuple=True)
    with torch.no_grad():
        for start in range(0, rows.numel(), chunk):
            r, c = rows[start : start + chunk], cols[start : start + chunk]
            logp = torch.log_softmax(logits[r, c].float() / temperature, dim=-1)
            out[r, c + 1] = -(logp.exp() * logp).sum(-1)
    return out


class GuardError(RuntimeError):
    """The guard acted too often (``GuardConfig.max_actions``)."""


@dataclass
class GuardConfig:
    action: Literal["off", "warn", "skip", "rollback"] = "warn"
    """What a flagged step does: ``warn`` logs it; ``skip`` refuses the update before the
    optimizer step; ``rollback`` restores the last good checkpoint and lowers the rate;
    ``off`` watches nothing (and the loss computes no entropy for it). Default ``warn``:
    it changes no update, and a collapse shows in the log and in ``guard/*`` metrics."""
    metrics: list[str] = field(
        default_factory=lambda: [ENTROPY, *[k for k in RULES if k != ENTROPY]]
    )
    """Step scalars watched: the five that show a policy collapsing or diverging."""
    warmup_steps: int = 10
    """Steps of history before any verdict: the first levels are a few batches' noise."""
    decay: float = 0.9
    """Per-step decay of the moving mean and variance: a value's weight falls to 1/e in
    about 10 steps, long enough to average a batch's noise, short enough to follow the
    drift of a run that learns (entropy falls and reward rises as it does)."""
    z_threshold: float = 4.0
    """A value is out of line when it is this many running standard deviations from its
    level (and ``min_ratio`` too): 4σ is about once in 16,000 steps for Gaussian noise."""
    min_ratio: float = 2.0
    """...and also this factor from the level: above level × r or below level / r. The
    z-score alone flags small moves of a metric whose variance is tiny."""
    entropy_fraction: float = 0.25
    """Entropy collapse: below this fraction of its running level. A run that sharpens its
    policy lowers entropy gradually, and the level follows; a quarter in one step is not
    that."""
    entropy_floor: float = 0.0
    """Entropy collapse too: under this many nats per token, whatever the level (0: no
    floor). Task-dependent, hence off by default; it catches a slow slide to zero."""
    checkpoint_every: int = 10
    """Save the good weights every this many healthy steps (and at the first step), in
    ``RUN_DIR/guard/``: a rollback loses at most this many steps of progress."""
    lr_factor: float = 0.5
    """A rollback multiplies the learning rate (and the schedule's base) by this."""
    max_actions: int = 3
    """Raise ``GuardError`` at this many rollbacks in a run, or skips in a row: a run that
    keeps collapsing at a lower rate needs a person."""

    @property
    def watches_entropy(self) -> bool:
        """Whether the policy loss must compute the entropy for the guard."""
        return self.action != "off" and ENTROPY in self.metrics

    def check(self) -> None:
        """Raise ValueError, naming the key, for a setting the guard cannot work with."""
        bounds = {
            "decay": 0 < self.decay < 1,
            "lr_factor": 0 < self.lr_factor <= 1,
            "entropy_fraction": 0 <= self.entropy_fraction < 1,
            "z_threshold": self.z_threshold > 0,
            "min_ratio": self.min_ratio >= 1,
            "max_actions": self.max_actions >= 1,
            "warmup_steps": self.warmup_steps >= 1,
            "entropy_floor": self.entropy_floor >= 0,
            "checkpoint_every": self.checkpoint_every >= 1,
        }
        bad = [key for key, ok in bounds.items() if not ok]
        if bad:
            raise ValueError(f"rl.guard.{bad[0]}={getattr(self, bad[0])!r} is out of range")


@dataclass
class Flag:
    """One watched metric out of line at a step."""

    metric: str
    value: float
    level: float
    """Its running mean before this step."""
    why: str

    def __str__(self) -> str:
        return f"{self.metric}={self.value:.4g} (running level {self.level:.4g}: {self.why})"


class Monitor:
    """Exponential moving mean and variance of each metric, and the verdict on a step's
    values: ``judge`` (no side effect) then ``observe`` (add them to the history).

    With decay d: ``mean ← d·mean + (1−d)·x``, ``var ← d·(var + (1−d)·(x − mean)²)``.
    Flagged when, in the metric's direction (``RULES``), ``|x − mean|`` exceeds
    ``z_threshold·√var``, the rule's least deviation, and ``(r − 1)·|mean|`` above or
    ``(1 − 1/r)·|mean|`` below (r: ``min_ratio`` or the rule's); the entropy also when
    under ``entropy_fraction·mean`` or ``entropy_floor``. No verdict before
    ``warmup_steps`` values."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.mean: dict[str, float] = {}
        self.var: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def judge(self, values: dict[str, float]) -> list[Flag]:
        flags = []
        for name, x in values.items():
            if self.count.get(name, 0) < self.cfg.warmup_steps or not math.isfinite(x):
                continue
            flag = self.collapse(name, x) or self.deviation(name, x)
            if flag is not None:
                flags.append(flag)
        return flags

    def collapse(self, name: str, x: float) -> Flag | None:
        if name != ENTROPY:
            return None
        level = self.mean[name]
        if x < self.cfg.entropy_fraction * level:
            return Flag(name, x, level, f"collapsed below {self.cfg.entropy_fraction:g}× level")
        if x < self.cfg.entropy_floor:
            return Flag(name, x, level, f"under the floor {self.cfg.entropy_floor:g}")
        return None

    def deviation(self, name: str, x: float) -> Flag | None:
        direction, least, ratio = RULES.get(name, ("both", 0.0, 0.0))
        level, dev = self.mean[name], x - self.mean[name]
        if (direction == "high" and dev <= 0) or (direction == "low" and dev >= 0):
            return None
        std = math.sqrt(self.var[name])
        ratio = ratio or self.cfg.min_ratio
        relative = (ratio - 1) if dev > 0 else (1 - 1 / ratio)
        if abs(dev) <= max(self.cfg.z_threshold * std, relative * abs(level), least):
            return None
        z = abs(dev) / std if std > 0 else math.inf
        side = "above" if dev > 0 else "below"
        return Flag(name, x, level, f"{z:.1f} standard deviations {side}")

    def judging(self, values: dict[str, float]) -> bool:
        """Whether every one of ``values``' metrics is past its warmup."""
        return all(self.count.get(k, 0) >= self.cfg.warmup_steps for k in values)

    def observe(self, values: dict[str, float]) -> None:
        d = self.cfg.decay
        for name, x in values.items():
            if not math.isfinite(x):
                continue
            if name not in self.mean:
                self.mean[name], self.var[name], self.count[name] = x, 0.0, 0
            delta = x - self.mean[name]
            self.mean[name] += (1 - d) * delta
            self.var[name] = d * (self.var[name] + (1 - d) * delta * delta)
            self.count[name] += 1

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean = dict(state.get("mean", {}))
        self.var = dict(state.get("var", {}))
        self.count = dict(state.get("count", {}))


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
