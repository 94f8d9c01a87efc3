"""The pair losses of the preference stages, with tensor shapes in the signatures: the
reward model's Bradley–Terry loss and DPO's. Each returns a sum over pairs plus metric
sums; the trainer core divides by the global pair count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reward model's pairwise loss, summed over pairs (the core divides by the pair
    count): ``Σ_p −log σ(r_c − r_r − margin)``.

    Args:
        chosen: ``[P]`` scores of the preferred completions (with grad).
        rejected: ``[P]`` scores of the dispreferred ones.
        margin: how far the chosen score must clear the rejected one before the loss
            stops pushing (Llama 2's margin loss; 0 is plain Bradley–Terry).

    Metric sums: pairs ranked right (``r_c > r_r``), the score gap, the mean score.
    """
    diff = chosen.float() - rejected.float()
    loss_sum = -torch.nn.functional.logsigmoid(diff - margin).sum()
    with torch.no_grad():
        metrics = {
            "rm/accuracy": (diff > 0).float().sum(),
            "rm/margin": diff.sum(),
            "rm/score": 0.5 * (chosen + rejected).float().sum(),
        }
    return loss_sum, metrics


@dataclass
class DPOLossConfig:
    beta: float = 0.1
    """β: the inverse temperature of the implicit reward β·log(π/π_ref); larger keeps the
    policy closer to the reference."""
    label_smoothing: float = 0.0
    """ε of conservative DPO: the probability that a pair's label is flipped (sigmoid loss)."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """``sigmoid`` (DPO) or ``ipo`` (the squared loss of IPO, which regresses the margin of
    log-ratios to 1/(2β) instead of pushing it without bound)."""
    nll_coef: float = 0.0
    """α of RPO: adds α × the chosen completion's per-token NLL. DPO alone can lower the
    likelihood of both completions while widening their gap; this keeps the chosen one up."""


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    cfg: DPOLossConfig,
    chosen_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (or IPO) summed over pairs (the core divides by the pair count).

    Every argument is ``[P]``: the summed completion-token logprobs of the chosen and the
    rejected completion under the policy (with grad) and under the frozen reference. With
    ``h = (π_c − ref_c) − (π_r − ref_r)``:

        sigmoid: −(1 − ε)·log σ(β·h) − ε·log σ(−β·h)
        ipo:     (h − 1/(2β))²

    plus ``nll_coef · (−π_c / chosen_tokens)`` when ``nll_coef`` > 0, where
    ``chosen_tokens`` (``[P]``) counts each chosen completion's target tokens.
    Metric sums: the implicit rewards β·(π − ref) of chosen and rejected, their margin,
    and pairs whose chosen reward exceeds the rejected one.
    """
    chosen_ratio = policy_chosen.float() - ref_chosen.float()
    rejected_ratio = policy_rejected.float() - ref_rejected.float()
    h = chosen_ratio - rejected_ratio
    if cfg.loss_type == "ipo":
        per_pair = (h - 1.0 / (2.0 * cfg.beta)).square()
    elif cfg.loss_type == "sigmoid":
        eps = cfg.label_smoothing
        logsig = torch.nn.functional.logsigmoid
        per_pair = -(1.0 - eps) * logsig(cfg.beta * h) - eps * logsig(-cfg.beta * h)
    else:
        raise ValueError(f"unknown DPO loss_type {cfg.loss_type!r}")
    if cfg.nll_coef > 0:
        if chosen_tokens is None:
            raise ValueError("nll_coef needs the chosen completions' token counts")
        per_pair = per_pair - cfg.nll_coef * policy_chosen.float() / chosen_tokens.clamp(min=1)
    with torch.no_grad():
        chosen_reward, rejected_reward = cfg.beta * chosen_ratio, cfg.beta * rejected_ratio
        metrics = {
            "dpo/chosen_reward": chosen_reward.sum(),
            "dpo/rejected_reward": rejected_reward.sum(),
            "dpo/margin": (chosen_reward - rejected_reward).sum(),
            "dpo/accuracy": (chosen_reward > rejected_reward).float().sum(),
        }
    return per_pair.sum(), metrics
