"""Flow matching's sampler as a policy (Flow-GRPO): each denoising step a Gaussian whose
log-probability is known in closed form, so that the decoupled PPO loss applies per step.

Convention (SD3's, and diffusers'): ``x_t = (1 - t) x0 + t eps`` with ``t`` from 1 (noise)
to 0 (data), and the model predicts the velocity ``v = eps - x0``. Sampling follows the
probability-flow ODE ``dx = v dt`` (``ode_step``), or an SDE with the same marginals
(``sde_step``): with the score ``grad log p_t(x) = -(x + (1 - t) v) / t`` of this
interpolant, the reverse-time SDE

    dx = [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt + sigma_t dW,   sigma_t = a sqrt(t / (1 - t))

keeps every marginal ``p_t`` for any noise level ``a``. One Euler–Maruyama step from ``t``
down to ``t - dt`` is the Gaussian ``N(mean, (sigma_t sqrt(dt))^2 I)`` of
``sde_distribution``; ``sigma_t`` is capped at the grid's first step below 1, where it would
be infinite. The times are those of diffusers' ``FlowMatchEulerDiscreteScheduler`` with
SD3's ``shift`` (``time_grid``).
"""

from __future__ import annotations

import math

import torch
from diffusers import FlowMatchEulerDiscreteScheduler


def time_grid(steps: int, shift: float = 1.0) -> list[float]:
    """``steps + 1`` times from 1 down to 0, spaced as SD3 spaces them (``shift`` > 1
    spends more steps at high noise)."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    return [float(t) for t in scheduler.sigmas]


def sde_sigma(t: torch.Tensor, t_cap: float, noise_level: float) -> torch.Tensor:
    """``sigma_t = a sqrt(t / (1 - t))``, with ``t`` capped at ``t_cap`` under the root's
    denominator (the grid's first step below 1)."""
    return noise_level * torch.sqrt(t / (1.0 - t.clamp(max=t_cap)))


def per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` (one number, or one per sample [B]) shaped to broadcast over ``like``
    [B, C, H, W]."""
    return values.reshape((-1,) + (1,) * (like.dim() - 1)) if values.dim() else values


def sde_distribution(
    x: torch.Tensor,
    v: torch.Tensor,
    t: float | torch.Tensor,
    t_next: float | torch.Tensor,
    noise_level: float,
    t_cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step from ``t`` to ``t_next`` < ``t`` as a Gaussian: its mean (the shape of
    ``x``, [B, C, H, W]) and its standard deviation, the same in every dimension of a
    sample. ``t`` and ``t_next`` are numbers (std: a 0-d tensor) or one per sample
    ([B]: each sample at its own time, as a continuous batch is; std: [B])."""
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    t_next = torch.as_tensor(t_next, dtype=x.dtype, device=x.device)
    sigma = sde_sigma(t, t_cap, noise_level)
    dt, drift = per_sample(t - t_next, x), per_sample(sigma**2 / (2 * t), x)
    mean = x - dt * (v + drift * (x + (1 - per_sample(t, x)) * v))
    return mean, sigma * torch.sqrt(t - t_next)


def gaussian_logprob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x_next; mean, std^2 I) per sample, summed over every dimension: [B]. ``std``:
    one number, or one per sample [B]."""
    std = torch.as_tensor(std, dtype=x_next.dtype)
    z = (x_next - mean) / per_sample(std, x_next)
    dims = x_next[0].numel()
    return -0.5 * z.pow(2).flatten(1).sum(1) - dims * (torch.log(std) + 0.5 * math.log(2 * math.pi))


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    t: float | torch.Tensor,
    t_next: float | torch.Tensor,
    noise_level: float,
    t_cap: float,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One stochastic step: ``x_next`` [B, C, H, W] and its log-probability [B]. The
    noise is drawn from ``generator``, unless given (standard normal, the shape of x)."""
    mean, std = sde_distribution(x, v, t, t_next, noise_level, t_cap)
    if noise is None:
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    x_next = mean + per_sample(std, x) * noise
    return x_next, gaussian_logprob(x_next, mean, std)


def ode_step(
    x: torch.Tensor, v: torch.Tensor, t: float | torch.Tensor, t_next: float | torch.Tensor
) -> torch.Tensor:
    """One Euler step of the probability-flow ODE (evaluation pictures: no noise). Times:
    numbers, or per sample shaped to broadcast over ``x`` (``per_sample``)."""
    return x + (t_next - t) * v
