"""Process-group setup for trainer ranks.

Ranks started by ``torchrun`` (or Slurm) find each other through the usual ``MASTER_ADDR``
environment; ranks started by ``launch/local.py`` rendezvous through a file in the run
directory, so no port is ever hard-coded. gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import ctypes
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class DistInfo:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(preference: str) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(
    device_preference: str = "auto", rendezvous_file: str | None = None
) -> DistInfo:
    """Join (or create) the default process group and a 1-D mesh over all ranks."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(device_preference)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            init_method = "env://"
        else:
            if rendezvous_file is None:
                raise RuntimeError("no MASTER_ADDR in the environment and no rendezvous file given")
            init_method = f"file://{Path(rendezvous_file).resolve()}"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    mesh = init_device_mesh(device.type, (world_size,))
    return DistInfo(rank=rank, world_size=world_size, device=device, mesh=mesh)


def set_malloc_mmap_threshold(nbytes: int) -> None:
    """Fix glibc's mmap threshold of this process at ``nbytes`` (``trainer.
    malloc_mmap_threshold``; 0 leaves glibc's own): allocations above it are mapped and,
    when freed, returned to the system, where glibc's own threshold (it rises as large
    blocks are freed) would keep them resident in the heap. Call it before the model is
    built."""
    if not nbytes:
        return
    m_mmap_threshold = -3  # from glibc's malloc.h
    if not ctypes.CDLL(None).mallopt(m_mmap_threshold, nbytes):
        raise ValueError(f"glibc refused an mmap threshold of {nbytes} bytes (at most 32 MiB)")


def shutdown_distributed() -> None:
    if dist.is_initialized():
        # Without the barrier a fast rank can tear the group down under a slow one.
        dist.barrier()
        dist.destroy_process_group()
    # What still holds the group (a sharded model's hooks and its collectives' work, in
    # reference cycles) is freed now, while the interpreter is whole: freed during its
    # finalization, gloo's threads would reach for a GIL that is gone and abort the process.
    gc.collect()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few scalars over all ranks in one collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(value: int | float, device: torch.device) -> int | float:
    """The largest of every rank's ``value``, of its type (an int stays exact)."""
    dtype = torch.float64 if isinstance(value, float) else torch.int64
    t = torch.tensor([value], dtype=dtype, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def broadcast_json(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (the others pass anything, e.g. None). It travels
    as JSON bytes in a tensor, never pickled (``broadcast_object_list`` would unpickle on
    the receiving ranks whatever arrived), so it must be made of JSON types."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL moves only device tensors
        device = torch.device("cuda", torch.cuda.current_device())
    data = msgspec.json.encode(value) if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() == 0:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    return msgspec.json.decode(payload.cpu().numpy().tobytes())
