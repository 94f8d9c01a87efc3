"""The token losses: SFT, the decoupled PPO loss and its importance weights, the value
loss, entropy and KL, with tensor shapes in the signatures (the pair losses of the
preference stages are ``asyncrl.algorithms.preference``'s).

Each returns a *sum* over its tokens plus metric sums; the trainer core
divides by the global normalizer so packing and rank count do not change the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from asyncrl.logprobs import token_logprobs


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
    """C: the bound of the behavior importance weight exp(proximal − behavior). ``truncate``
    and ``sequence_mask`` clip the weight at C; ``token_mask`` drops the tokens above it."""
    is_correction: Literal["truncate", "token_mask", "sequence_mask", "icepop"] = "truncate"
    """How the loss treats tokens whose behavior importance ratio exp(proximal − behavior)
    is far from 1: the generator sampled them with other probabilities than the trainer's
    (an engine's numerics, or stale weights). ``importance_weights`` has the formulas.
    ``truncate`` (TIS): weight min(ratio, C), every token kept; biased toward the behavior
    policy where clipped. ``token_mask`` (token-level masked IS): drop tokens whose ratio
    exceeds C, keep the others' unclipped ratio; unbiased on the kept tokens, for
    mismatch concentrated on a few tokens. ``sequence_mask`` (sequence-level masked IS):
    drop whole samples whose geometric-mean ratio leaves [``sequence_low``,
    ``sequence_high``], for a sample that drifted as a whole (a broken engine, stale
    weights). ``icepop`` (IcePop): drop tokens whose ratio leaves [``icepop_low``,
    ``icepop_high``], the two-sided band, keep the others' ratio. A dropped token adds
    nothing to the loss and still counts in the token mean it is divided by
    (``train/is_masked_fraction`` logs the share)."""
    sequence_low: float = 0.9
    """``sequence_mask``: the lowest geometric-mean ratio a sample may have and train. The
    band is narrow: a mean over a sample's tokens moves far less than one token does."""
    sequence_high: float = 1.1
    """``sequence_mask``: the highest geometric-mean ratio a sample may have and train."""
    icepop_low: float = 0.5
    """``icepop``: α, the lowest ratio a token may have and train (IcePop's 0.5)."""
    icepop_high: float = 2.0
    """``icepop``: β, the highest ratio a token may have and train (IcePop's 2)."""
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

    def check(self) -> None:
        """Raise ValueError, naming the key, for an unknown correction or a bad band."""
        options = ("truncate", "token_mask", "sequence_mask", "icepop")
        if self.is_correction not in options:
            raise ValueError(
                f"rl.loss.is_correction {self.is_correction!r} is not one of {options}"
            )
        if not self.iw_cap > 0:
            raise ValueError(f"rl.loss.iw_cap must be positive, got {self.iw_cap}")
        for name in ("sequence", "icepop"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if not 0 < low <= 1 <= high or low == high:
                raise ValueError(
                    f"rl.loss.{name}_low and rl.loss.{name}_high must make a band "
                    f"0 < low < high around 1 (a ratio of 1 is on-policy), got [{low}, {high}]"
                )


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
    sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The decoupled PPO objective (AReaL's Eq. 5; docs/design.md, The loss), token sums.

    Every tensor is ``[rows, T]``, aligned with the input ids: ``logprobs`` (current policy,
    with grad), ``proximal_logprobs`` (recomputed at the start of the step, no grad),
    ``behavior_logprobs`` (recorded by the generator), ``advantages``, ``loss_mask``, and
    optionally ``ref_logprobs`` (frozen reference), ``entropy`` (``token_entropy``) and
    ``sequence_ids`` (each token's sample in a packed row, for ``sequence_mask``).

        w, keep = importance_weights(prox, behav, mask)        u = exp(logp − prox)
        pg = −w · min(u·A, clip(u, 1−ε_low, 1+ε_high)·A)    [dual clip: ≤ c·|A| when A < 0]
        loss_sum = Σ keep · (pg + β·KL − c_ent·H + α·[A > 0]·(−logp))

    By default (``truncate``) w = min(exp(prox − behav), iw_cap) and keep = mask. The caller
    divides by the global number of loss tokens, dropped ones too (token-level mean). With
    ``use_decoupled_loss=False`` the behavior logprobs play the proximal role and w = 1.
    """
    prox = (proximal_logprobs if cfg.use_decoupled_loss else behavior_logprobs).detach()
    weight, keep = importance_weights(prox, behavior_logprobs, loss_mask, cfg, sequence_ids)
    ratio = torch.exp(logprobs - prox)
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
    with torch.no_grad():  # over every loss token, dropped or not: the guard reads them
        mask = loss_mask
        behavior_weight = torch.exp(prox - behavior_logprobs).clamp(max=cfg.iw_cap)
        metrics = {
            "train/clip_fraction": ((ratio * advantages > clipped * advantages) * mask).sum(),
            "train/importance_weight": (behavior_weight * mask).sum(),
            "train/importance_weight_capped": ((behavior_weight >= cfg.iw_cap) * mask).sum(),
            "train/approx_kl_proximal": ((prox - logprobs) * mask).sum(),
        }
        if cfg.is_correction != "truncate":
            metrics["train/is_masked_fraction"] = (loss_mask - keep).sum()
        if entropy is not None:
            metrics["train/entropy"] = (entropy * mask).sum()
        if ref_logprobs is not None:
            kl = kl_estimate(logprobs, ref_logprobs, cfg.kl_estimator)
            metrics["train/kl_reference"] = (kl * mask).sum()
    return (per_token * keep).sum(), metrics


def importance_weights(
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PPOLossConfig,
    sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The behavior importance weights and the loss mask they leave, both ``[rows, T]``
    (no grad), by ``cfg.is_correction``. With ρ = exp(prox − behav) per token and C =
    ``iw_cap``:

        truncate       w = min(ρ, C)                 mask = loss_mask
        token_mask     w = ρ                         mask = loss_mask · [ρ ≤ C]
        sequence_mask  w = min(ρ, C)                 mask = loss_mask · [low ≤ g ≤ high]
        icepop         w = ρ                         mask = loss_mask · [α ≤ ρ ≤ β]

    g is the sample's geometric-mean ratio, exp(mean of log ρ over its loss tokens)
    (``sequence_geometric_mean``; ``sequence_ids`` ``[rows, T]`` names each token's sample,
    -1 on padding; None: one sample per row). The masks follow the masked importance
    sampling of the train–inference mismatch literature (token- and sequence-level MIS)
    and IcePop's band; a kept sample's tokens keep TIS's clipped weight, because its mean
    ratio bounds its drift as a whole, not that of one token in it. Under a mask w is 0
    wherever the mask is 0, so an overflowing ρ never reaches the loss as inf · 0.
    """
    log_ratio = (proximal_logprobs - behavior_logprobs).detach()
    ratio = torch.exp(log_ratio)
    if cfg.is_correction == "truncate":
        return ratio.clamp(max=cfg.iw_cap), loss_mask
    if cfg.is_correction == "token_mask":
        weight, keep = ratio, ratio <= cfg.iw_cap
    elif cfg.is_correction == "icepop":
        weight, keep = ratio, (ratio >= cfg.icepop_low) & (ratio <= cfg.icepop_high)
    elif cfg.is_correction == "sequence_mask":
        mean = sequence_geometric_mean(log_ratio, loss_mask, sequence_ids)
        weight = ratio.clamp(max=cfg.iw_cap)
        keep = (mean >= cfg.sequence_low) & (mean <= cfg.sequence_high)
    else:
        raise ValueError(f"unknown is_correction {cfg.is_correction!r}")
    keep = keep & (loss_mask > 0)
    return torch.where(keep, weight, 0.0), keep.to(loss_mask.dtype)


def sequence_geometric_mean(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, sequence_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``[rows, T]``: at each token, exp(mean of ``log_ratio`` over its sample's loss
    tokens), 1 for a sample without any. ``sequence_ids`` ``[rows, T]``: each token's
    sample, -1 on padding (which reads sample 0's: it is no loss token); None: one sample
    per row."""
    if sequence_ids is None:
        rows = torch.arange(log_ratio.shape[0], device=log_ratio.device)
        sequence_ids = rows.unsqueeze(1).expand_as(log_ratio)
    # Padding (-1) has loss mask 0: it adds nothing to the slot it is sent to.
    ids = sequence_ids.reshape(-1).clamp(min=0)
    counted = loss_mask.reshape(-1) > 0
    values = torch.where(counted, log_ratio.reshape(-1), 0.0)  # no inf · 0 off the loss
    sums = values.new_zeros(ids.numel()).index_add(0, ids, values)  # sample index < numel
    counts = values.new_zeros(ids.numel()).index_add(0, ids, counted.to(values.dtype))
    return torch.exp(sums / counts.clamp(min=1))[ids].reshape(log_ratio.shape)


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
