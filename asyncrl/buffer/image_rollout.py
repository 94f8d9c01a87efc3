"""The rollout of pictures: what the buffer and the image generators read in the image
chain's asynchronous RL (Flow-GRPO, ``asyncrl.stages.image_grpo``).

An ``ImageRolloutConfig`` is a ``RolloutConfig`` whose policy is an image policy directory
(``asyncrl.image.model``) and whose prompts are the image task's training scenes
(``ScenePrompts``), sent as word ids (``asyncrl.image.frames``). Everything else of the
buffer is unchanged: groups, leases, the staleness gate, the WAL, batches. A picture's
steps arrive as a text sample's tokens do, its frames beside them (``Chunk.frames``), and
its reward with its last chunk: the generator judges the finished picture, as an
environment rewards an episode, so no reward worker runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.buffer.config import RolloutConfig
from asyncrl.engine.image import ImageSamplingConfig
from asyncrl.image.frames import prompt_ids
from asyncrl.image.scenes import split
from asyncrl.tasks import stream_index


@dataclass
class ImageRolloutConfig(RolloutConfig):
    image: ImageSamplingConfig = field(default_factory=ImageSamplingConfig)
    """The SDE sampler of every picture (steps, shift, noise level)."""
    max_batch: int = 16
    """Pictures an image generator steps at once; more wait for a place."""

    def prompt_source(self) -> ScenePrompts:
        return ScenePrompts(self.seed)


class ScenePrompts:
    """Prompt ``position`` of the stream: a training scene (never a held-out one),
    reshuffled every epoch, as ``(its index among the training scenes, its word ids)``; a
    pure function of (seed, position), so a restarted buffer resumes it."""

    def __init__(self, seed: int) -> None:
        self.scenes, self.seed = split(held_out=False), seed

    def __call__(self, position: int) -> tuple[int, list[int]]:
        index = stream_index(self.seed, position, len(self.scenes))
        return index, prompt_ids(self.scenes[index].prompt)
