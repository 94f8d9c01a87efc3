"""The image policy (``asyncrl.image.model``): a directory diffusers reads back to the
same velocities, prompts outside the vocabulary refused by name, and flow-matching
pretraining that fits a fixed batch of rendered scenes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from diffusers import SD3Transformer2DModel

from asyncrl.image.model import (
    ImageModelConfig,
    ImagePolicy,
    flow_matching_loss,
    to_images,
    to_pixels,
)
from asyncrl.image.render import draw
from asyncrl.image.scenes import all_scenes

TINY = ImageModelConfig(layers=2, heads=2, head_dim=16, text_dim=32)


def test_a_saved_policy_loads_to_the_same_velocities(tmp_path):
    torch.manual_seed(0)
    policy = ImagePolicy(TINY)
    x, t = torch.randn(3, 3, 32, 32), torch.tensor([0.9, 0.5, 0.1])
    prompts = [s.prompt for s in all_scenes()[:3]]
    policy.save(tmp_path / "m")
    again = ImagePolicy.load(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(again.velocity(x, t, prompts), policy.velocity(x, t, prompts))
    assert isinstance(
        SD3Transformer2DModel.from_pretrained(tmp_path / "m" / "transformer"), SD3Transformer2DModel
    )
    assert 2e6 < sum(p.numel() for p in ImagePolicy(ImageModelConfig()).parameters()) < 4e6


def test_a_prompt_outside_the_vocabulary_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'a purple circle'.*\['purple'\]"):
        ImagePolicy(TINY).prompt_encoder.tokens(["a purple circle"])


def test_pixels_round_trip():
    images = np.stack([draw(s, random.Random(0)) for s in all_scenes()[:4]])
    assert torch.equal(to_images(to_pixels(images)), torch.as_tensor(images))


def test_pretraining_fits_a_fixed_batch():
    torch.manual_seed(0)
    scenes = all_scenes()[:8]
    x0 = to_pixels(np.stack([draw(s, random.Random(i)) for i, s in enumerate(scenes)]))
    prompts = [s.prompt for s in scenes]
    policy = ImagePolicy(TINY)
    opt = torch.optim.AdamW(policy.parameters(), lr=2e-3)
    losses = []
    for step in range(40):
        loss = flow_matching_loss(policy, x0, prompts, torch.Generator().manual_seed(step % 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4])
