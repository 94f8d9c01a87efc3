"""Flow-GRPO's loss: the decoupled PPO loss per denoising step.

A picture's steps are its actions (``asyncrl.engine.image``): step ``k`` took frame
``x_k`` at time ``grid[k]`` to ``x_{k+1}``, a Gaussian draw whose log-probability the
trainer recomputes from the two frames and the policy's velocity (``step_distributions``).
With the behavior log-probability and version the generator recorded for each step, the
text loss applies unchanged (``asyncrl.algorithms.losses.ppo_loss``): rows are pictures,
positions are steps, every step of a picture shares its group-relative advantage.

Scale: a step's log-probability sums over the picture's 3 × 32 × 32 dimensions, so any
update moves it by far more than a clip range of ratios allows; the loss takes the mean
per dimension instead (``PER_DIMENSION``), as Flow-GRPO does, which keeps the ratios'
clip and the importance weights on a workable scale. The KL to the reference is the two
Gaussian steps' own, in closed form and per dimension (``step_kl``), as Flow-GRPO takes it.
"""

from __future__ import annotations

import torch

from asyncrl.algorithms.losses import PPOLossConfig, ppo_loss
from asyncrl.image.flow import gaussian_logprob, sde_distribution
from asyncrl.image.frames import FRAME_SHAPE
from asyncrl.image.model import ImagePolicy

PER_DIMENSION = 1.0 / (FRAME_SHAPE[0] * FRAME_SHAPE[1] * FRAME_SHAPE[2])
"""The loss's log-probabilities are the step's, times this (a mean over dimensions)."""


def step_distributions(
    policy: ImagePolicy,
    frames: torch.Tensor,
    prompts: list[str],
    steps: torch.Tensor,
    grid: list[float],
    noise_level: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each chosen step under ``policy``: its log-probability ``[N, S]``, its Gaussian's
    mean ``[N, S, 3, H, W]`` and standard deviation ``[N, S]``.

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
    logprobs = gaussian_logprob(x_next, mean, std).view(n, s)
    return logprobs, mean.view(n, s, *mean.shape[1:]), std.view(n, s)


def step_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(policy step ‖ reference step) per dimension, ``[N, S]``: both are Gaussians with
    the same ``std`` ``[N, S]`` (the SDE's), so it is exact, ``|μ − μ_ref|² / (2σ²)``
    averaged over a picture's dimensions, where a sampled estimate would be noise on a
    3072-dimensional step. Means ``[N, S, 3, H, W]``."""
    return (mean - ref_mean).pow(2).flatten(2).mean(2) / (2 * std.pow(2))


def flow_grpo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cfg: PPOLossConfig,
    kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``ppo_loss`` over steps: every log-probability ``[N, S]`` (``step_distributions``' scale:
    whole steps), ``advantages`` ``[N]`` (one per picture), and ``cfg.kl_coef`` times
    ``kl`` ``[N, S]`` (``step_kl``, per dimension) when given. Returns the sum over steps
    and the metric sums, as ``ppo_loss`` does; the caller divides by ``N · S``."""
    scale = PER_DIMENSION
    loss_sum, metrics = ppo_loss(
        logprobs * scale,
        proximal_logprobs * scale,
        behavior_logprobs * scale,
        advantages.unsqueeze(1).expand_as(logprobs),
        torch.ones_like(logprobs),
        cfg,
    )
    if kl is not None:
        loss_sum = loss_sum + cfg.kl_coef * kl.sum()
        metrics["train/kl_reference"] = kl.detach().sum()
    return loss_sum, metrics


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
