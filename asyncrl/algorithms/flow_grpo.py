"""Flow-GRPO's loss: the decoupled PPO loss per denoising step.

A picture's steps are its actions (``asyncrl.engine.image``): step ``k`` took frame
``x_k`` at time ``grid[k]`` to ``x_{k+1}``, a Gaussian draw whose log-probability the
trainer recomputes from the two frames and the policy's velocity (``step_logprobs``).
With the behavior log-probability and version the generator recorded for each step, the
text loss applies unchanged (``asyncrl.algorithms.losses.ppo_loss``): rows are pictures,
positions are steps, every step of a picture shares its group-relative advantage.

Scale: a step's log-probability sums over the picture's 3 × 32 × 32 dimensions, so any
update moves it by far more than a clip range of ratios allows; the loss takes the mean
per dimension instead (``PER_DIMENSION``), as Flow-GRPO does, which keeps the ratios'
clip, the importance weights and the KL on a workable scale.
"""

from __future__ import annotations

import torch

from asyncrl.algorithms.losses import PPOLossConfig, ppo_loss
from asyncrl.image.flow import gaussian_logprob, sde_distribution
from asyncrl.image.frames import FRAME_SHAPE
from asyncrl.image.model import ImagePolicy

PER_DIMENSION = 1.0 / (FRAME_SHAPE[0] * FRAME_SHAPE[1] * FRAME_SHAPE[2])
"""The loss's log-probabilities are the step's, times this (a mean over dimensions)."""


def step_logprobs(
    policy: ImagePolicy,
    frames: torch.Tensor,
    prompts: list[str],
    steps: torch.Tensor,
    grid: list[float],
    noise_level: float,
) -> torch.Tensor:
    """Each chosen step's log-probability under ``policy``: ``[N, S]``.

    Args:
        frames: ``[N, T + 1, 3, H, W]``, each picture's start noise and its T steps' frames.
        prompts: ``N`` prompts.
        steps: ``[N, S]`` step indices in ``0 … T - 1`` (a picture's trained steps).
        grid: the sampler's ``T + 1`` times (``time_grid``).
    """
    n, s = steps.shape
    rows = torch.arange(n).unsqueeze(1)
    x, x_next = frames[rows, steps].flatten(0, 1), frames[rows, steps + 1].flatten(0, 1)
    times = torch.tensor(grid, dtype=frames.dtype)
    t, t_next = times[steps].flatten(), times[steps + 1].flatten()
    v = policy.velocity(x, t, [p for p in prompts for _ in range(s)])
    mean, std = sde_distribution(x, v, t, t_next, noise_level, grid[1])
    return gaussian_logprob(x_next, mean, std).view(n, s)


def flow_grpo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cfg: PPOLossConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``ppo_loss`` over steps: every log-probability ``[N, S]`` (``step_logprobs``'s scale:
    whole steps), ``advantages`` ``[N]`` (one per picture). Returns the sum over steps and
    the metric sums, as ``ppo_loss`` does; the caller divides by ``N · S``."""
    scale = PER_DIMENSION
    ref = None if ref_logprobs is None else ref_logprobs * scale
    return ppo_loss(
        logprobs * scale,
        proximal_logprobs * scale,
        behavior_logprobs * scale,
        advantages.unsqueeze(1).expand_as(logprobs),
        torch.ones_like(logprobs),
        cfg,
        ref_logprobs=ref,
    )


def train_steps(
    num_steps: int, per_picture: int, generator: torch.Generator, n: int
) -> torch.Tensor:
    """``[n, per_picture]`` step indices, each picture's drawn without repeats from its
    ``num_steps`` (Flow-GRPO trains on a fraction of the sampling steps: neighbouring
    steps carry much the same signal, at a forward each)."""
    if not 1 <= per_picture <= num_steps:
        raise ValueError(f"train steps per picture must be 1 to {num_steps}, got {per_picture}")
    scores = torch.rand(n, num_steps, generator=generator)
    return scores.argsort(dim=1)[:, :per_picture].sort(dim=1).values
