"""What the collapse guard watches and how it judges (``asyncrl.loop.guard`` acts on
the verdict): the guard's settings (``GuardConfig``), the rules per metric (``RULES``), an
exponential moving mean and variance per metric over healthy steps and the verdict on a
step's values (``Monitor``, ``Flag``), and the entropy the policy loss computes for it
when the loss itself has no entropy term (``entropy_for_the_guard``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

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
