"""Pictures from the image policy, and how they are judged and shown.

``generate`` runs the sampler over a whole batch at once: the probability-flow ODE for
evaluation (deterministic given each prompt's seed), or the SDE when a noise level is
given. ``evaluate`` judges a fixed set of held-out scenes (``asyncrl.image.check``) and
returns per-category success with a grid of the first pictures, which the stages write as
PNG and show in TensorBoard's image tab.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from asyncrl.image.check import judge, success_by_category
from asyncrl.image.flow import ode_step, sde_step, time_grid
from asyncrl.image.model import ImagePolicy, to_images
from asyncrl.image.render import SIZE
from asyncrl.image.scenes import Scene


def start_noise(seeds: list[int]) -> torch.Tensor:
    """Each picture's starting noise [B, 3, SIZE, SIZE], from its own seed alone (so a
    prompt's picture does not depend on what else is in the batch)."""
    return torch.stack(
        [torch.randn(3, SIZE, SIZE, generator=torch.Generator().manual_seed(s)) for s in seeds]
    )


@torch.no_grad()
def generate(
    policy: ImagePolicy,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    shift: float,
    noise_level: float | None = None,
) -> torch.Tensor:
    """Pictures [B, SIZE, SIZE, 3] uint8 for ``prompts``: ODE steps, or SDE steps at
    ``noise_level`` (noise drawn from the first seed's stream)."""
    grid = time_grid(steps, shift)
    x = start_noise(seeds)
    noise = torch.Generator().manual_seed(seeds[0] + 1)
    for t, t_next in zip(grid, grid[1:]):
        v = policy.velocity(x, torch.full((len(prompts),), t), prompts)
        if noise_level is None:
            x = ode_step(x, v, t, t_next)
        else:
            x, _ = sde_step(x, v, t, t_next, noise_level, grid[1], generator=noise)
    return to_images(x)


def generate_batched(
    policy: ImagePolicy,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    shift: float,
    batch: int = 64,
    progress: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """ODE pictures [N, SIZE, SIZE, 3] uint8 of ``prompts``, ``batch`` at a time (for
    memory: each picture's noise is its own seed's, so batching does not change it);
    ``progress`` is told how many are drawn after each batch."""
    parts = []
    for i in range(0, len(prompts), batch):
        parts.append(generate(policy, prompts[i : i + batch], seeds[i : i + batch], steps, shift))
        if progress is not None:
            progress(min(i + batch, len(prompts)))
    return torch.cat(parts)


def picture_grid(images: torch.Tensor | np.ndarray, columns: int, scale: int = 4) -> np.ndarray:
    """Pictures [B, H, W, 3] side by side, ``columns`` a row, each ``scale`` times larger
    and one background pixel apart: [rows·(H·scale+1), columns·(W·scale+1), 3] uint8."""
    images = np.asarray(images)
    b, h, w, _ = images.shape
    rows = -(-b // columns)
    big = images.repeat(scale, axis=1).repeat(scale, axis=2)
    out = np.full((rows * (h * scale + 1), columns * (w * scale + 1), 3), 255, dtype=np.uint8)
    for i, picture in enumerate(big):
        r, c = divmod(i, columns)
        top, left = r * (h * scale + 1), c * (w * scale + 1)
        out[top : top + h * scale, left : left + w * scale] = picture
    return out


def evaluate(
    policy: ImagePolicy, scenes: list[Scene], steps: int, shift: float, shown: int = 16
) -> tuple[dict[str, float], np.ndarray]:
    """Held-out success per category (``eval/success_<category>``, and ``eval/accuracy``
    over all) of ODE pictures of ``scenes`` (scene ``i`` from seed ``i``), and a grid of
    the first ``shown`` pictures."""
    was_training = policy.training
    policy.eval()
    images = generate(policy, [s.prompt for s in scenes], list(range(len(scenes))), steps, shift)
    policy.train(was_training)
    verdicts = [(s, judge(img.numpy(), s)) for s, img in zip(scenes, images)]
    rates = success_by_category(verdicts)
    scalars = {f"eval/success_{k}": v for k, v in rates.items() if k != "overall"}
    scalars["eval/accuracy"] = rates["overall"]
    return scalars, picture_grid(images[:shown], columns=8)
