"""Direct preference optimization: the offline alternative to RL in the chain (SFT → DPO).

The policy trains on (prompt, chosen, rejected) pairs (``stages/pairs.py``) with the DPO
loss (sigmoid with β, optional label smoothing, or IPO) against a frozen reference, by
default the starting policy. The reference's per-token logprobs are computed once for
every pair at the start (``reference="precompute"``, after which the reference model is
freed) or for each batch as it comes (``"on_the_fly"``, which keeps it in memory); both
use the same function, a plain padded forward of the unsharded reference. Held-out
figures: the implicit-reward accuracy and margins of the eval pairs, and the policy's
greedy accuracy on the task. Run it with ``python launch/local.py experiments/tiny_dpo.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

import torch

from asyncrl.algorithms.preference import DPOLossConfig, dpo_loss
from asyncrl.logprobs import token_logprobs
from asyncrl.models import forward_padded, load_model
from asyncrl.stages.common import stage_main
from asyncrl.stages.pairs import (
    PairData,
    PairStage,
    PairStageExperiment,
    run_pair_stage,
    split_pairs,
)
from asyncrl.stages.sft import Evaluator
from asyncrl.tasks import build_task
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import DistInfo
from asyncrl.trainer.packing import MicroBatch, TokenSequence


@dataclass
class DPOExperiment(PairStageExperiment):
    name: str = "dpo"
    """Experiment name; names the default run directory."""
    loss: DPOLossConfig = field(default_factory=DPOLossConfig)
    """The DPO loss: β, label smoothing, sigmoid or IPO, RPO's NLL term."""
    reference: Literal["precompute", "on_the_fly"] = "precompute"
    """When the reference's logprobs are computed: once for every pair at the start (then
    the reference model is freed), or for each batch (the model stays in memory)."""
    reference_path: str = ""
    """HF directory of the frozen reference; empty means ``model.path`` (the start)."""

    entry: ClassVar[str] = "asyncrl.stages.dpo"
    """Module whose ``main`` runs one trainer rank of this stage."""


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, seqs: list[TokenSequence], chunk: int = 64
) -> list[list[float]]:
    """Per-token logprobs (aligned with ``input_ids``, 0 at position 0) of each sequence
    under ``model``: right-padded chunks with an attention mask, in order."""
    out: list[list[float]] = []
    for start in range(0, len(seqs), chunk):
        part = seqs[start : start + chunk]
        logits, ids = forward_padded(model, [s.input_ids for s in part], pad_id=0)
        logprobs = token_logprobs(logits, ids).cpu()
        out += [logprobs[i, : len(s)].tolist() for i, s in enumerate(part)]
    return out


class DPOStage(PairStage):
    def __init__(
        self, cfg: DPOExperiment, info: DistInfo, data: PairData, held_out: PairData
    ) -> None:
        self.cfg, self.info, self.splits = cfg, info, {"train": data, "eval": held_out}
        ref_cfg = replace(cfg.model, path=cfg.reference_path or cfg.model.path, head="lm")
        self.reference: torch.nn.Module | None = load_model(ref_cfg, info.device).eval()
        self.cached: dict[str, list[tuple[list[float], list[float]]]] = {}
        if cfg.reference == "precompute":
            self.cached = {split: self._compute(d.pairs) for split, d in self.splits.items()}
            self.reference = None  # every pair has its reference logprobs now
        self.task_eval = Evaluator(cfg, build_task(cfg.task), info)

    def _compute(
        self, pairs: list[tuple[TokenSequence, TokenSequence]]
    ) -> list[tuple[list[float], list[float]]]:
        assert self.reference is not None
        flat = reference_logprobs(self.reference, [s for p in pairs for s in p])
        return list(zip(flat[0::2], flat[1::2]))

    def with_fields(
        self, split: str, indices: list[int]
    ) -> list[tuple[TokenSequence, TokenSequence]]:
        pairs = [self.splits[split].pairs[i] for i in indices]
        if self.cached:
            refs = [self.cached[split][i] for i in indices]
        else:
            refs = self._compute(pairs)
        return [
            (replace(c, fields={"ref_logprobs": rc}), replace(r, fields={"ref_logprobs": rr}))
            for (c, r), (rc, rr) in zip(pairs, refs)
        ]

    def loss(
        self, logits: torch.Tensor, mb: MicroBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        policy = mb.sequence_sums(token_logprobs(logits, mb.input_ids) * mb.loss_mask)
        reference = mb.sequence_sums(mb.fields["ref_logprobs"] * mb.loss_mask)
        chosen, rejected, anchor = split_pairs(policy, mb)
        ref_chosen, ref_rejected, _ = split_pairs(reference, mb)
        chosen_tokens = split_pairs(mb.sequence_sums(mb.loss_mask), mb)[0]
        loss_sum, metrics = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, self.cfg.loss, chosen_tokens
        )
        return loss_sum + anchor, metrics

    def evaluate(self, core: TrainerCore) -> dict[str, float]:
        return self.task_eval(core)


def run(cfg: DPOExperiment, info: DistInfo) -> dict:
    return run_pair_stage(
        cfg, info, cfg.model, lambda data, held_out: DPOStage(cfg, info, data, held_out)
    )


def main(argv: list[str] | None = None) -> None:
    stage_main(run, argv)


if __name__ == "__main__":
    main()
