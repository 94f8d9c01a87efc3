"""PPO's critic for the RL stage (docs/design.md, The loss): a value model trained beside
the policy.

The critic is the policy's architecture with a scalar head (``ModelConfig.head="value"``,
started from the policy's backbone with a zero head unless ``path`` names a trained value
model), sharded by a second ``TrainerCore`` on the same trainer ranks with its own
optimizer. Each RL step calls, in order (through ``CriticAdvantages`` in
``asyncrl.loop.advantages``): ``values`` (V_t of the batch before any update, no
grad), ``advantages`` (GAE on the reward of each trajectory's last completion token,
optionally whitened with global statistics), the policy step, then ``train`` (the
clipped value loss). Its checkpoint is a companion of the policy's
(``step_N/critic/``). The math lives in ``asyncrl.algorithms``; this module is plumbing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from asyncrl.algorithms.advantages import gae, masked_whiten
from asyncrl.algorithms.losses import token_values, value_loss
from asyncrl.models import ModelConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import DistInfo, all_reduce_sum
from asyncrl.trainer.packing import MicroBatch


@dataclass
class CriticConfig:
    path: str = ""
    """HF directory the value model starts from; empty means the policy's ``model.path``
    (its backbone under a zero value head). A saved value model keeps its head."""
    gamma: float = 1.0
    """Discount of GAE. 1 is usual for completions with one terminal reward."""
    lam: float = 0.95
    """λ of GAE: 1 gives Monte-Carlo returns (no critic bias), 0 one-step TD."""
    value_clip: float = 0.2
    """ε of the clipped value loss, around the values the advantages were computed with;
    0 is off. It binds only from the second step on a batch (``steps_per_batch`` > 1),
    since the first starts from exactly those values."""
    whiten_advantages: bool = True
    """Shift and scale advantages to zero mean, unit std over the global batch (all ranks)."""
    steps_per_batch: int = 1
    """Critic optimizer steps on each batch (the policy takes one)."""
    warmup_steps: int = 0
    """First steps in which only the critic trains (veRL's ``critic_warmup``): the policy
    keeps its weights, so a zero-initialised value head reaches the returns' scale before
    its advantages move the policy. Versions still advance, one per batch."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's AdamW and schedule; ``total_steps`` 0 means ``max_steps × steps_per_batch``."""


def reward_on_last_token(loss_mask: list[int], reward: float) -> list[float]:
    """Token rewards of one trajectory: its score on the last completion token, else 0."""
    last = max((i for i, m in enumerate(loss_mask) if m), default=len(loss_mask) - 1)
    return [reward if i == last else 0.0 for i in range(len(loss_mask))]


class Critic:
    """The value model on the trainer ranks; every rank calls every method."""

    def __init__(
        self,
        cfg: CriticConfig,
        policy: ModelConfig,
        trainer: TrainerConfig,
        info: DistInfo,
        pad_id: int,
        max_steps: int,
    ) -> None:
        self.cfg = cfg
        model = replace(policy, path=cfg.path or policy.path, head="value")
        total = cfg.optim.total_steps or max_steps * cfg.steps_per_batch
        self.core = TrainerCore(model, trainer, replace(cfg.optim, total_steps=total), info, pad_id)

    def values(self, micro: list[MicroBatch]) -> list[MicroBatch]:
        """Store V_t (``[rows, T]``, aligned like the proximal logprobs) as ``values``;
        returns ``micro``."""
        with torch.no_grad():
            for mb in self.core.align(micro):
                head = self.core.forward(mb.to(self.core.info.device))
                mb.fields["values"] = token_values(head).cpu()
        return micro

    def advantages(self, micro: list[MicroBatch]) -> dict[str, float]:
        """GAE ``advantages`` and ``returns`` from ``rewards`` and ``values``, stored per
        micro-batch; returns metrics of the values against the returns (global batch)."""
        cfg, sums = self.cfg, torch.zeros(8, dtype=torch.float64)
        for mb in micro:
            f, mask = mb.fields, mb.loss_mask
            adv, ret = gae(f["rewards"], f["values"], mask, cfg.gamma, cfg.lam, mb.position_ids)
            f["advantages"], f["returns"] = adv, ret
            err = ret - f["values"]
            parts = [mask, adv, adv.square(), ret, ret.square(), err, err.square(), f["values"]]
            sums += torch.stack([(p * mask).sum().double() for p in parts])
        n, a1, a2, r1, r2, e1, e2, v1 = all_reduce_sum(sums.tolist(), self.core.info.device)
        n = max(n, 1.0)
        adv_std = math.sqrt(max(a2 / n - (a1 / n) ** 2, 0.0))
        if cfg.whiten_advantages:
            for mb in micro:
                f = mb.fields
                f["advantages"] = masked_whiten(f["advantages"], mb.loss_mask, a1 / n, adv_std)
        return_var, error_var = r2 / n - (r1 / n) ** 2, e2 / n - (e1 / n) ** 2
        # 1 − Var(R − V)/Var(R); undefined when every return is equal, logged as 0 then.
        explained = 1.0 - error_var / return_var if return_var > 1e-12 else 0.0
        return {
            "critic/value_mean": v1 / n,
            "critic/return_mean": r1 / n,
            "critic/advantage_std": adv_std,
            "critic/explained_variance": explained,
        }

    def train(self, micro: list[MicroBatch]) -> dict[str, float]:
        """``steps_per_batch`` steps of the clipped value loss toward ``returns``."""
        for _ in range(self.cfg.steps_per_batch):
            stats = self.core.train_step(micro, self._loss)
            if not stats.skipped:  # the critic's step counts its optimizer steps
                self.core.step += 1
        return {
            "critic/value_loss": stats.loss,
            "critic/grad_norm": stats.grad_norm,
            "critic/lr": stats.lr,
            **stats.metrics,
        }

    def _loss(self, head: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        f = mb.fields
        if "returns" not in f:  # padding micro-batch of a rank that got no samples
            return head.sum() * 0.0, {}
        values = token_values(head)
        return value_loss(values, f["values"], f["returns"], mb.loss_mask, self.cfg.value_clip)
