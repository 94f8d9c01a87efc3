"""Losses of every stage, in one module, with tensor shapes in the signatures.

Each returns a *sum* over its tokens (or pairs) plus metric sums; the trainer core
divides by the global normalizer so packing and rank count do not change the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from asyncrl.trainer.logprobs import token_logprobs


def sft_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked negative log-likelihood of the completion tokens.

    Args:
        logits: ``[rows, T, V]``.
        input_ids: ``[rows, T]``.
        loss_mask: ``[rows, T]``, 1 on target tokens (completion and EOS), else 0.

    Returns:
        ``(Σ_t mask_t · −log p_t, {"train/token_accuracy": Σ_t mask_t · [argmax = target]})``.
    """
    logprobs = token_logprobs(logits, input_ids)
    nll_sum = -(logprobs * loss_mask).sum()
    with torch.no_grad():
        predicted = logits[:, :-1].argmax(-1)
        correct = torch.nn.functional.pad((predicted == input_ids[:, 1:]).float(), (1, 0))
        accuracy_sum = (correct * loss_mask).sum()
    return nll_sum, {"train/token_accuracy": accuracy_sum}


@dataclass
class PPOLossConfig:
    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − ε_low."""
    clip_high: float = 0.2
    """ε_high: clipped above at 1 + ε_high (DAPO's clip-higher raises it, e.g. 0.28)."""
    dual_clip: float = 0.0
    """c > 1 bounds the loss of negative-advantage tokens at c·|A| (dual-clip PPO); 0 is off."""
    use_decoupled_loss: bool = True
    """Decoupled PPO (AReaL): ratio against the recomputed proximal policy, corrected by
    the behavior importance weight. False: standard PPO with the behavior policy as old."""
    iw_cap: float = 5.0
    """Truncation of the behavior importance weight exp(proximal − behavior)."""
    kl_coef: float = 0.0
    """β of the KL penalty to the reference policy (the starting weights, frozen); 0: off."""
    kl_in_reward: bool = False
    """Put the KL penalty in the reward instead of the loss (InstructGPT, TRL's PPO): each
    completion token's reward loses β·KL(behavior ‖ reference) before GAE, so the critic
    learns the penalized return. Needs ``algorithm="ppo"``: a group estimator sees one
    reward per sample. False: β·KL(π ‖ reference) is a term of the loss (GRPO's way)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(π ‖ π_ref) (Schulman's k1, k2, k3)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 is off."""
    positive_nll_coef: float = 0.0
    """α of an NLL term on the tokens of positive-advantage samples (α · −log π), as RPO
    adds to DPO: it keeps the likelihood of good samples rising while negative
    advantages push others down. 0 is off (plain PPO)."""


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution, aligned like ``token_logprobs``.

    ``logits [rows, T, V]`` → ``[rows, T]``: entry t is the entropy of the distribution
    that token t was drawn from (the logits at t − 1), 0 at t = 0.
    """
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0), value=0.0)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(π ‖ π_ref) estimate from sampled tokens; all tensors ``[rows, T]``.

    With r = ref − log π: k1 = −r, k2 = r²/2, k3 = exp(r) − 1 − r (unbiased, ≥ 0).
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PPOLossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The decoupled PPO objective (DESIGN §6, AReaL Eq. 5), summed over tokens.

    Every tensor is ``[rows, T]``, aligned with the input ids: ``logprobs`` (current policy,
    with grad), ``proximal_logprobs`` (recomputed at the start of the step, no grad),
    ``behavior_logprobs`` (recorded by the generator), ``advantages``, ``loss_mask``, and
    optionally ``ref_logprobs`` (frozen reference) and ``entropy`` (``token_entropy``).

        w = min(exp(prox − behav), iw_cap)       u = exp(logp − prox)
        pg = −w · min(u·A, clip(u, 1−ε_low, 1+ε_high)·A)    [dual clip: ≤ c·|A| when A < 0]
        loss_sum = Σ mask · (pg + β·KL − c_ent·H + α·[A > 0]·(−logp))

    The caller divides by the global number of loss tokens (token-level mean). With
    ``use_decoupled_loss=False`` the behavior logprobs play the proximal role and w = 1.
    """
    if not cfg.use_decoupled_loss:
        proximal_logprobs = behavior_logprobs
    proximal_logprobs = proximal_logprobs.detach()
    weight = torch.exp(proximal_logprobs - behavior_logprobs).clamp(max=cfg.iw_cap).detach()
    ratio = torch.exp(logprobs - proximal_logprobs)
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    if cfg.dual_clip > 1.0:
        objective = torch.where(
            advantages < 0, torch.maximum(objective, cfg.dual_clip * advantages), objective
        )
    per_token = -weight * objective
    if cfg.kl_coef and ref_logprobs is not None and not cfg.kl_in_reward:
        per_token = per_token + cfg.kl_coef * kl_estimate(logprobs, ref_logprobs, cfg.kl_estimator)
    if cfg.entropy_coef and entropy is not None:
        per_token = per_token - cfg.entropy_coef * entropy
    if cfg.positive_nll_coef:
        per_token = per_token - cfg.positive_nll_coef * (advantages > 0).float() * logprobs
    mask = loss_mask
    with torch.no_grad():
        was_clipped = (ratio * advantages > clipped * advantages).float()
        metrics = {
            "train/clip_fraction": (was_clipped * mask).sum(),
            "train/importance_weight": (weight * mask).sum(),
            "train/importance_weight_capped": ((weight >= cfg.iw_cap).float() * mask).sum(),
            "train/approx_kl_proximal": ((proximal_logprobs - logprobs) * mask).sum(),
        }
        if entropy is not None:
            metrics["train/entropy"] = (entropy * mask).sum()
        if ref_logprobs is not None:
            metrics["train/kl_reference"] = (
                kl_estimate(logprobs, ref_logprobs, cfg.kl_estimator) * mask
            ).sum()
    return (per_token * mask).sum(), metrics


def token_values(head_out: torch.Tensor) -> torch.Tensor:
    """Critic values aligned like ``token_logprobs``: ``[rows, T, 1]`` → ``[rows, T]``.

    Entry t is V_t, the value of the state before token t, read from the head at t − 1
    (the position whose logits give token t's logprob); 0 at t = 0. The head's output at
    the last position (the state after the final token) is not used: that state is
    terminal for PPO (the reward model reads it instead).
    """
    return torch.nn.functional.pad(head_out[:, :-1, 0].float(), (1, 0), value=0.0)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss, summed over tokens (the core divides by the token count).

    Every tensor is ``[rows, T]``, aligned with the input ids: ``values`` (current critic,
    with grad, from ``token_values``), ``old_values`` (the critic when the advantages were
    computed, no grad), ``returns`` (GAE advantages + old values), ``loss_mask``.

        V_clip = V_old + clip(V − V_old, −ε, ε)
        loss_sum = Σ mask · ½ · max((V − R)², (V_clip − R)²)

    ``clip <= 0`` turns clipping off (plain ½(V − R)²).
    """
    old_values = old_values.detach()
    unclipped = (values - returns).square()
    if clip > 0:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        per_token = 0.5 * torch.maximum(unclipped, (clipped_values - returns).square())
    else:
        per_token = 0.5 * unclipped
    with torch.no_grad():
        was_clipped = (per_token > 0.5 * unclipped).float()
        metrics = {
            "critic/clip_fraction": (was_clipped * loss_mask).sum(),
            "critic/value_error": ((values - returns).abs() * loss_mask).sum(),
        }
    return (per_token * loss_mask).sum(), metrics


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
