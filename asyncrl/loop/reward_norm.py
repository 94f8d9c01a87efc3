"""Running reward normalization for the RL step (``RLConfig.reward_norm``): rewards whose
scale drifts (a reward model's) become (r − mean) / std before the advantages, with a
mean and variance that follow the run's batches.

One per trainer rank, all ranks agreeing: each step's moments are summed over every
rank's share. The state is three floats, saved in the trainer's checkpoints, so a
restarted trainer normalizes as the straight run would. Samples carry no task name, so
there is one normalizer per run (a mixture of tasks shares it).
"""

from __future__ import annotations

import math

import msgspec
import torch

from asyncrl.trainer.dist import all_reduce_sum
from asyncrl.wire import Sample

EPS = 1e-6
"""Added to the std: a batch of equal rewards divides by this, not by zero."""


class RewardNormalizer:
    """``normalize(samples)`` updates the moving moments with the step's batch, then maps
    each reward r to (r − mean) / (std + EPS). With decay d and the batch's mean m_b and
    variance v_b: ``mean ← d·mean + (1−d)·m_b``, ``var ← d·var + (1−d)·(v_b + (m_b −
    mean_old)·(m_b − mean_new))``; the first batch sets both. Mode ``none`` returns the
    samples as they are, with no collective."""

    def __init__(self, mode: str, decay: float, device: torch.device) -> None:
        self.mode, self.decay, self.device = mode, decay, device
        self.mean, self.var, self.batches = 0.0, 0.0, 0

    def normalize(self, samples: list[Sample]) -> list[Sample]:
        if self.mode == "none":
            return samples
        self.update([s.reward for s in samples])
        std = math.sqrt(self.var) + EPS
        return [msgspec.structs.replace(s, reward=(s.reward - self.mean) / std) for s in samples]

    def update(self, rewards: list[float]) -> None:
        """Fold one step's rewards (this rank's share; every rank calls it) into the
        moving mean and variance."""
        n, total, squares = all_reduce_sum(
            [len(rewards), sum(rewards), sum(r * r for r in rewards)], self.device
        )
        if not n:
            return
        mean = total / n
        var = max(squares / n - mean * mean, 0.0)
        if self.batches == 0:
            self.mean, self.var = mean, var
        else:
            d, old = self.decay, self.mean
            self.mean = d * old + (1 - d) * mean
            self.var = d * self.var + (1 - d) * (var + (mean - old) * (mean - self.mean))
        self.batches += 1

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.mean = state.get("mean", 0.0)
        self.var = state.get("var", 0.0)
        self.batches = state.get("batches", 0)
