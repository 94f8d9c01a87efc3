"""The guard against NaN/inf in training: a step whose loss or gradient norm is not finite
changes nothing, and too many in a row stop the run. ``TrainerCore`` holds one; the
stages that drive their own optimizer (the image stages) hold their own."""

from __future__ import annotations

import math


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a NaN or infinite loss or gradient."""


class FiniteSteps:
    """The guard against NaN/inf: a step whose loss or gradient norm is not finite is to be
    skipped (its gradients dropped), and the ``limit``-th such step in a row stops the run
    with ``NonFiniteError``. ``TrainerCore`` holds one; stages that drive their own
    optimizer (the image stages) hold their own."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0

    def finite(self, loss: float, grad_norm: float, step: int | None = None) -> bool:
        """Whether the step may update the weights; raises at the limit. ``step`` names
        the stage's step in the error."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            at = "" if step is None else f" (the last at step {step})"
            raise NonFiniteError(
                f"{self.in_a_row} consecutive steps had a non-finite loss or gradient{at} "
                f"(last: loss={loss}, grad_norm={grad_norm}); stopping. Each was skipped "
                "without touching the weights. Lower optim.lr (or lengthen "
                "optim.warmup_steps), check rewards, advantages and data for NaN/inf, "
                "or resume from the last checkpoint; trainer.max_nonfinite_steps sets "
                "how many in a row are tolerated."
            )
        return False

    def step(self, opt, schedule, loss: float, grad_norm: float, step: int) -> bool:
        """For a stage that drives its own optimizer: ``opt`` and ``schedule`` step when
        ``finite``, else the gradients are dropped; whether they stepped."""
        if self.finite(loss, grad_norm, step):
            opt.step()
            schedule.step()
            return True
        opt.zero_grad(set_to_none=True)
        return False
