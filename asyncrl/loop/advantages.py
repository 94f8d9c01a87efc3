"""Where the RL step's advantages come from: a strategy the loop in ``asyncrl.stages.rl``
calls at named points of every step, so the loop has no branch per algorithm.

- ``GroupRelative`` (GRPO, Dr.GRPO, RLOO): each group's rewards become per-token
  advantages when the batch turns into sequences (``asyncrl.loop.batch.to_sequences``); every hook
  does nothing.
- ``CriticAdvantages`` (PPO): the critic (``asyncrl.loop.critic``) on the same ranks.
  Before the update: the values of the batch, the KL penalty taken off the token rewards
  (``rl.loss.kl_in_reward``), GAE. During its warmup the policy keeps its weights. After
  the publish (generators never wait for it): the value training. Its core is
  checkpointed beside the policy's.

The math is in ``asyncrl.algorithms``; this module only says when it runs.
"""

from __future__ import annotations

from typing import Protocol

from asyncrl.algorithms.losses import PPOLossConfig
from asyncrl.loop.batch import penalize_kl_in_rewards
from asyncrl.loop.config import RLConfig
from asyncrl.loop.critic import Critic
from asyncrl.models import ModelConfig
from asyncrl.trainer.config import TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import DistInfo
from asyncrl.trainer.packing import MicroBatch


class Advantages(Protocol):
    """What the RL loop asks of an advantage estimator, in the order it asks."""

    def before_update(self, micro: list[MicroBatch]) -> dict[str, float]:
        """After the proximal and reference logprobs, before the policy's update: make
        sure every micro-batch has its ``advantages`` ``[rows, T]``. Returns metrics."""
        ...

    def updates_policy(self, step: int) -> bool:
        """Whether the policy takes its update at ``step``; if not, it keeps its weights
        and the version still advances."""
        ...

    def after_publish(self, micro: list[MicroBatch]) -> dict[str, float]:
        """After the new weights are published and announced: any training of its own.
        Returns metrics."""
        ...

    @property
    def companions(self) -> dict[str, TrainerCore]:
        """Cores checkpointed beside the policy's, by subdirectory name."""
        ...


class GroupRelative:
    """GRPO, Dr.GRPO, RLOO: the advantages arrive with the batch; nothing to do here."""

    def before_update(self, micro: list[MicroBatch]) -> dict[str, float]:
        return {}

    def updates_policy(self, step: int) -> bool:
        return True

    def after_publish(self, micro: list[MicroBatch]) -> dict[str, float]:
        return {}

    @property
    def companions(self) -> dict[str, TrainerCore]:
        return {}


class CriticAdvantages:
    """PPO: GAE over the critic's values; ``kl`` is the loss config when the KL penalty
    goes in the token rewards, else None."""

    def __init__(self, critic: Critic, kl: PPOLossConfig | None) -> None:
        self.critic, self.kl = critic, kl

    def before_update(self, micro: list[MicroBatch]) -> dict[str, float]:
        if self.kl is not None:
            penalize_kl_in_rewards(micro, self.kl)
        return self.critic.advantages(self.critic.values(micro))

    def updates_policy(self, step: int) -> bool:
        return step >= self.critic.cfg.warmup_steps

    def after_publish(self, micro: list[MicroBatch]) -> dict[str, float]:
        return self.critic.train(micro)

    @property
    def companions(self) -> dict[str, TrainerCore]:
        return {"critic": self.critic.core}


def make_advantages(
    rl: RLConfig, model: ModelConfig, trainer: TrainerConfig, info: DistInfo, pad_id: int
) -> Advantages:
    """The strategy of ``rl.algorithm``; for PPO this builds the critic's core (on the
    policy's ``model``, placed as the policy's ``trainer``)."""
    if rl.algorithm != "ppo":
        return GroupRelative()
    critic = Critic(rl.critic, model, trainer, info, pad_id, rl.max_steps)
    # The penalty needs the reference's logprobs, loaded only when kl_coef is set.
    kl = rl.loss if rl.loss.kl_in_reward and rl.loss.kl_coef else None
    return CriticAdvantages(critic, kl)
