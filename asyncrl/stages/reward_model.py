"""Reward-model training: the second stage of the chain (SFT → reward model → PPO).

The reward model is the policy's architecture under a scalar head (``ModelConfig.head =
"value"``, started from the SFT backbone with a zero head), trained with the
Bradley–Terry loss on (prompt, chosen, rejected) pairs (``stages/pairs.py``) on the FSDP2
trainer core. A completion's score is the head's output at the last token of prompt +
completion (its EOS): the same definition the buffer's ``RewardModelScorer`` uses when
PPO trains on the learned reward (``RewardConfig.source = "model"``). Held-out pairwise
accuracy is the stage's figure. Run it with ``python launch/local.py experiments/tiny_rm.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from asyncrl.algorithms.preference import bradley_terry_loss
from asyncrl.stages.common import stage_main
from asyncrl.stages.pairs import (
    PairData,
    PairStage,
    PairStageExperiment,
    run_pair_stage,
    split_pairs,
)
from asyncrl.trainer.dist import DistInfo
from asyncrl.trainer.packing import MicroBatch, TokenSequence


@dataclass
class RewardModelExperiment(PairStageExperiment):
    name: str = "rm"
    """Experiment name; names the default run directory."""
    margin: float = 0.0
    """Bradley–Terry margin: the score gap past which a pair stops contributing much."""

    entry: ClassVar[str] = "asyncrl.stages.reward_model"
    """Module whose ``main`` runs one trainer rank of this stage."""


def completion_scores(head: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """``[S]``: each sequence's score, the head (``[rows, T, 1]``) at its last token."""
    return mb.last_token(head[..., 0].float())


class RewardModelStage(PairStage):
    def __init__(self, cfg: RewardModelExperiment, data: PairData, held_out: PairData) -> None:
        self.margin, self.splits = cfg.margin, {"train": data, "eval": held_out}

    def loss(
        self, head: torch.Tensor, mb: MicroBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        chosen, rejected, anchor = split_pairs(completion_scores(head, mb), mb)
        loss_sum, metrics = bradley_terry_loss(chosen, rejected, self.margin)
        return loss_sum + anchor, metrics

    def with_fields(
        self, split: str, indices: list[int]
    ) -> list[tuple[TokenSequence, TokenSequence]]:
        return [self.splits[split].pairs[i] for i in indices]


def run(cfg: RewardModelExperiment, info: DistInfo) -> dict:
    value_model = replace(cfg.model, head="value")  # the SFT backbone under a zero scalar head
    return run_pair_stage(
        cfg, info, value_model, lambda data, held_out: RewardModelStage(cfg, data, held_out)
    )


def main(argv: list[str] | None = None) -> None:
    stage_main(run, argv)


if __name__ == "__main__":
    main()
