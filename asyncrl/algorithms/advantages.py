"""Advantage estimators and reward shaping (docs/design.md, The loss). Plain tensor
functions, apart from the plumbing: the trainer broadcasts sequence-level advantages over
completion tokens.

- GRPO: reward minus the group mean, divided by the group std unless ``scale_by_std``
  is off (Dr.GRPO, which drops the std to avoid favouring easy or hard prompts).
- RLOO: reward minus the mean of the *other* samples of the group.
- GAE for PPO with a critic: token-level δ_t = r_t + γ·V_{t+1} − V_t accumulated with γλ.
- A KL penalty in the reward: per-token rewards minus β·KL to the reference, before GAE.
- DAPO's overlong shaping: a linear penalty over the last ``cache`` tokens before the limit.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """``rewards [groups, n]`` → advantages ``[groups, n]``; std is the population std."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centered
    return centered / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``rewards [groups, n]`` (n ≥ 2) → r_i − mean_{j≠i} r_j, ``[groups, n]``."""
    n = rewards.shape[1]
    if n < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt")
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return rewards - others


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the completion tokens of each sequence.

    Args:
        rewards: ``[rows, T]`` per-token rewards (e.g. the score on the last token, minus
            a KL penalty when it goes in the reward).
        values: ``[rows, T]`` critic values V_t of the state before token t.
        mask: ``[rows, T]``, 1 on completion tokens; the value after the last one is 0.
        position_ids: ``[rows, T]`` of packed rows, where a sequence starts at each 0;
            nothing flows back across a start. None: one sequence per row.

    Returns:
        ``(advantages, returns)``, both ``[rows, T]``, zero where ``mask`` is 0.
    """
    rows, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rows, dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros(rows, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(length)):
        if position_ids is not None and t + 1 < length:
            # Token t ends its sequence: the next one's values and advantages stay there.
            ends = position_ids[:, t + 1] == 0
            running = running.masked_fill(ends, 0.0)
            next_value = next_value.masked_fill(ends, 0.0)
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m > 0, delta + gamma * lam * running, running)
        advantages[:, t] = running * m
        next_value = torch.where(m > 0, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, mean: float, std: float, eps: float = 1e-8
) -> torch.Tensor:
    """``(x − mean) / (std + eps)`` where ``mask`` is 1, else 0; ``[rows, T]``. The moments
    are the caller's, so they can be those of the global batch over all ranks."""
    return (x - mean) / (std + eps) * mask


def kl_penalized_rewards(
    rewards: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """Token rewards with the KL penalty in them: ``rewards − coef·kl`` on completion
    tokens, unchanged elsewhere. ``rewards``, ``kl`` (a per-token estimate of
    KL(π_behavior ‖ π_ref), e.g. ``kl_estimate``) and ``mask``: ``[rows, T]``."""
    return rewards - coef * kl * mask


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, cache: int) -> torch.Tensor:
    """DAPO's soft overlong penalty: 0 up to ``max_new_tokens − cache`` tokens, then
    falling linearly to −1 at ``max_new_tokens``. ``lengths [N]`` → ``[N]``."""
    start = max_new_tokens - cache
    return -((lengths.float() - start) / cache).clamp(0.0, 1.0)
