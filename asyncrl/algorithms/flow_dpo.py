"""Diffusion-DPO for a flow-matching policy (Wallace et al., 2023, in the velocity form).

A picture's log-likelihood under a diffusion model is bounded by its denoising error, so
Diffusion-DPO puts ``−error`` where text DPO puts a completion's log-probability: for
a pair noised with the same time ``t`` and noise ``eps`` (so the comparison is the
pictures', not the draws'), with ``e = ||v_target − v(x_t, t)||²`` per picture (a mean
over its dimensions) under the policy and under the frozen reference,

    h = −(e_θ(chosen) − e_ref(chosen)) + (e_θ(rejected) − e_ref(rejected))
    loss = −log σ(β · h)

which is ``dpo_loss`` (``asyncrl.algorithms.preference``) on ``−e``. β is on the scale
of these per-dimension errors: the chosen picture's error must fall against the
reference's, relative to the rejected one's.
"""

from __future__ import annotations

import torch

from asyncrl.algorithms.preference import DPOLossConfig, dpo_loss
from asyncrl.image.model import ImagePolicy


def velocity_errors(
    policy: ImagePolicy, x0: torch.Tensor, prompts: list[str], t: torch.Tensor, eps: torch.Tensor
) -> torch.Tensor:
    """``[P]``: each picture's mean squared velocity error at ``x_t = (1 − t) x0 + t eps``.

    Args:
        x0: pictures ``[P, 3, H, W]`` in [-1, 1]; ``eps``: noise of the same shape.
        t: ``[P]`` times in (0, 1).
    """
    tb = t.view(-1, 1, 1, 1)
    x_t = (1 - tb) * x0 + tb * eps
    return (policy.velocity(x_t, t, prompts) - (eps - x0)).pow(2).flatten(1).mean(1)


def diffusion_dpo_loss(
    policy: ImagePolicy,
    reference: ImagePolicy,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    prompts: list[str],
    cfg: DPOLossConfig,
    generator: torch.Generator,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``dpo_loss`` summed over the ``P`` pairs of pictures ``chosen`` and ``rejected``
    (``[P, 3, H, W]``, in [-1, 1]) for ``prompts``; ``t`` drawn logit-normal, as
    pretraining draws it, one per pair with one noise for both pictures."""
    p = chosen.shape[0]
    t = torch.sigmoid(torch.randn(p, generator=generator)).repeat(2)
    eps = torch.randn(chosen.shape, generator=generator).repeat(2, 1, 1, 1)
    x0, both = torch.cat([chosen, rejected]), prompts + prompts
    errors = velocity_errors(policy, x0, both, t, eps)
    with torch.no_grad():
        ref = velocity_errors(reference, x0, both, t, eps)
    return dpo_loss(-errors[:p], -errors[p:], -ref[:p], -ref[p:], cfg)
