"""A picture's denoising trajectory as it crosses sockets: frames as raw float32 bytes.

An image sample is a sequence of denoising steps, as a text sample is one of tokens: step
``k`` goes from time ``grid[k]`` to ``grid[k + 1]`` (``asyncrl.image.flow.time_grid``). The
generator streams each step in a ``Chunk`` like a token: ``token_ids`` holds the step's
index, ``logprobs`` its log-probability, ``versions`` the weights that took it, and
``frames`` the picture it produced, with the start noise before the first step's. A
sample's frames are therefore ``x_0`` (noise), ``x_1``, … ``x_T``, each 3 × SIZE × SIZE
float32 in the model's [-1, 1] scale, exactly as sampled: the trainer recomputes each
step's log-probability from ``x_k`` and ``x_{k+1}``, so they are sent at full precision.

A prompt travels as its word ids in the image model's vocabulary (``prompt_ids``), so the
buffer deals in ids as it does for text.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.image.model import VOCABULARY
from asyncrl.image.render import SIZE

FRAME_SHAPE = (3, SIZE, SIZE)
FRAME_BYTES = 4 * 3 * SIZE * SIZE


def to_bytes(frames: torch.Tensor) -> bytes:
    """Frames ``[n, 3, SIZE, SIZE]`` (or one, ``[3, SIZE, SIZE]``) as float32 bytes."""
    return frames.detach().to(torch.float32).contiguous().numpy().tobytes()


def from_bytes(data: bytes, where: str = "frames") -> torch.Tensor:
    """Bytes of whole frames back as ``[n, 3, SIZE, SIZE]`` float32; a length that is not
    a whole number of frames is an error naming ``where``."""
    if len(data) % FRAME_BYTES:
        raise ValueError(
            f"{where}: {len(data)} bytes is not a whole number of {FRAME_BYTES}-byte frames"
        )
    array = np.frombuffer(data, dtype=np.float32).reshape(-1, *FRAME_SHAPE)
    return torch.from_numpy(array.copy())


def prompt_ids(prompt: str) -> list[int]:
    """A prompt's words as ids in the image model's vocabulary."""
    index = {w: i for i, w in enumerate(VOCABULARY)}
    unknown = [w for w in prompt.split() if w not in index]
    if unknown:
        raise ValueError(f"prompt {prompt!r}: words outside the image vocabulary: {unknown}")
    return [index[w] for w in prompt.split()]


def prompt_text(ids: list[int]) -> str:
    """The prompt ``prompt_ids`` made; an id outside the vocabulary is an error."""
    bad = [i for i in ids if not 0 < i < len(VOCABULARY)]
    if bad:
        raise ValueError(f"prompt ids {ids}: {bad} are not words of the image vocabulary")
    return " ".join(VOCABULARY[i] for i in ids)
