"""A batch of pictures as Flow-GRPO's update takes it (``asyncrl.stages.image_grpo``).

The buffer hands over ``Sample``s as it does for text: prompt ids (the prompt's words,
loss mask 0), then one entry per denoising step with its behavior log-probability and
version (loss mask 1), the frames beside them (``asyncrl.image.frames``) and the
picture's reward. ``PictureBatch.of`` turns them into tensors, checking that each sample
has the frames its steps need; ``advantages`` are group-relative, as GRPO's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.algorithms.advantages import grpo_advantages
from asyncrl.image.frames import from_bytes, prompt_text
from asyncrl.wire import Sample


@dataclass
class PictureBatch:
    prompts: list[str]
    """N prompts."""
    frames: torch.Tensor
    """[N, T + 1, 3, H, W]: each picture's start noise and its T steps' frames."""
    behavior: torch.Tensor
    """[N, T]: each step's log-probability as the generator sampled it."""
    versions: torch.Tensor
    """[N, T]: the weights version of each step."""
    rewards: torch.Tensor
    """[N]."""
    groups: list[int]
    """N group ids: a group's pictures share a prompt and are compared with each other."""

    @classmethod
    def of(cls, samples: list[Sample], steps: int) -> PictureBatch:
        """The batch of ``samples``, each of ``steps`` steps; a sample with other steps or
        frames is a ValueError naming its group and index."""
        prompts, frames, behavior, versions = [], [], [], []
        for s in samples:
            where = f"sample {s.sample_index} of group {s.group_id}"
            prompt = [t for t, m in zip(s.token_ids, s.loss_mask) if not m]
            taken = [i for i, m in enumerate(s.loss_mask) if m]
            pictures = from_bytes(s.frames, f"{where}'s frames")
            if len(taken) != steps or len(pictures) != steps + 1:
                raise ValueError(
                    f"{where}: {len(taken)} steps and {len(pictures)} frames, expected "
                    f"{steps} and {steps + 1} (image.steps of this run)"
                )
            prompts.append(prompt_text(prompt))
            frames.append(pictures)
            behavior.append([s.logprobs[i] for i in taken])
            versions.append([s.versions[i] for i in taken])
        return cls(
            prompts,
            torch.stack(frames),
            torch.tensor(behavior),
            torch.tensor(versions),
            torch.tensor([s.reward for s in samples]),
            [s.group_id for s in samples],
        )

    def advantages(self, scale_by_std: bool) -> torch.Tensor:
        """[N]: each picture's reward against its group's (GRPO's), in batch order."""
        order = sorted(set(self.groups), key=self.groups.index)
        members = [[i for i, g in enumerate(self.groups) if g == group] for group in order]
        sizes = {len(m) for m in members}
        if len(sizes) != 1:
            raise ValueError(f"groups of unequal sizes in one batch: {sorted(sizes)}")
        index = torch.tensor(members)
        per_group = grpo_advantages(self.rewards[index], scale_by_std)
        out = torch.empty_like(self.rewards)
        out[index.flatten()] = per_group.flatten()
        return out
