"""Reading the parameters out for a weights publish, beside training (docs/design.md,
Weights without stopping generation).

``ParameterReadout.full_parameters`` hands a publisher the parameters one at a time; the
publisher may read them on its own thread while the trainer goes on with the next batch
(its forward and backward only read the weights). What must not happen meanwhile is an
update: ``wait`` blocks until every readout handed out has been read to its end, and the
core calls it before each optimizer step and before weights are restored.

With several ranks each parameter is a DTensor shard, and reading it means an all-gather
of the shards. Those run on a gloo group of their own, created at the first readout
(every rank reaches it at the same point), so a gather on a publisher's thread never
interleaves with FSDP's collectives on the training group.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from asyncrl.interfaces import FullParameters


class ParameterReadout:
    def __init__(self, model: torch.nn.Module, timeout_s: float = 600.0) -> None:
        self.model, self.timeout_s = model, timeout_s
        self.mesh: DeviceMesh | None = None
        self.pending: list[tuple[str, threading.Event]] = []

    def full_parameters(self, label: str = "") -> FullParameters:
        """The parameters unsharded, on the CPU, one at a time (tied ones once); every rank
        iterates them to the end. A tensor may be the live parameter itself."""
        if self.mesh is None and dist.is_initialized() and dist.get_world_size() > 1:
            # Its collectives fail after timeout_s, as wait does, instead of gloo's 30 min.
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            self.mesh = DeviceMesh.from_group(group, "cpu")
        # FSDP leaves the root unit gathered after a forward without backward (a proximal
        # pass): its parameters are then its all-gather buffer, which the next forward
        # frees. Reshard, so every parameter read is the rank's own shard.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        named = list(self.model.named_parameters())
        reading = _Reading(((n, self._full(p.detach())) for n, p in named), threading.Event())
        self.pending.append((label, reading.done))
        return FullParameters([(n, p.dtype, p.shape) for n, p in named], reading)

    def wait(self) -> None:
        """Block until every readout handed out has been read to its end (a publisher
        reading on its own thread); ``TimeoutError`` naming it after ``timeout_s``."""
        for label, done in self.pending:
            if not done.wait(self.timeout_s):
                raise TimeoutError(
                    f"the weights publish {label} has not read the parameters in "
                    f"{self.timeout_s:.0f} s: its reader is stuck"
                )
        self.pending.clear()

    def _full(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return t.cpu()
        local = t.to_local().cpu()
        if self.mesh is None:
            return local  # one rank: its shard is the whole tensor
        shard = DTensor.from_local(
            local, self.mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
        return shard.full_tensor()


class _Reading:
    """An iterator over gathered parameters whose ``done`` is set once it is exhausted or
    closed, also when it never started (a generator's ``finally`` would not run then)."""

    def __init__(self, tensors, done: threading.Event) -> None:
        self.tensors, self.done = tensors, done

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.tensors)
        except BaseException:
            self.done.set()
            raise

    def close(self) -> None:
        self.tensors.close()
        self.done.set()
