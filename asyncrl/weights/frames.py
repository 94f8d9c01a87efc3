"""A whole weights version as one multipart message: a ``WeightsAnnounce`` header, then
one raw frame per tensor (zero-copy buffers), rebuilt with ``torch.frombuffer``. The
benchmarks compare the bucketed publisher (``asyncrl.weights.sender``) against it."""

from __future__ import annotations

import warnings

import torch

from asyncrl.wire import TensorMeta, WeightsAnnounce, WireError, encode


def encode_tensors(
    version: int, run_id: str, tensors: dict[str, torch.Tensor], lineage: str = ""
) -> list:
    """``[header, frame, frame, …]`` for a weights update; frames share the tensors' memory."""
    metas, frames = [], []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        metas.append(TensorMeta(name, str(t.dtype).removeprefix("torch."), list(t.shape)))
        # bf16 has no numpy/buffer format: send its bytes as int16 and reinterpret on arrival.
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        frames.append(memoryview(raw.reshape(-1).numpy()).cast("B"))
    header = encode(WeightsAnnounce(run_id=run_id, version=version, lineage=lineage, tensors=metas))
    return [header, *frames]


def decode_tensors(announce: WeightsAnnounce, frames: list) -> dict[str, torch.Tensor]:
    """Rebuild the tensors of a weights update from their raw frames (no copy: the
    tensors are read-only views of the frames)."""
    if len(frames) != len(announce.tensors):
        raise WireError("frames", f"{len(frames)} frames for {len(announce.tensors)} tensors")
    out = {}
    for meta, frame in zip(announce.tensors, frames):
        dtype = getattr(torch, meta.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise WireError("frames", f"unknown dtype {meta.dtype!r} for {meta.name}")
        buffer = memoryview(frame)
        numel = 1
        for d in meta.shape:
            numel *= d
        if buffer.nbytes != numel * dtype.itemsize:
            raise WireError(
                "frames", f"{meta.name}: {buffer.nbytes} bytes for shape {meta.shape} {meta.dtype}"
            )
        if numel == 0:
            out[meta.name] = torch.empty(meta.shape, dtype=dtype)
            continue
        raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
        with warnings.catch_warnings():
            # Received frames are read-only; the tensors are views of them, never written
            # (the engine adopts weights as they are), so the copy torch suggests is waste.
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(buffer, dtype=raw_dtype).view(meta.shape)
        out[meta.name] = t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
    return out
