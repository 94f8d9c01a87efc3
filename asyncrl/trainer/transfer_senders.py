"""Trainer rank 0's end of vLLM's weight transfer with one server's workers: how the
bytes of a version move once the HTTP calls have set the server up
(``asyncrl.trainer.publish_vllm`` makes those calls and picks a sender by
``engine.remote.weight_update``).

- ``GlooSender`` (``gloo``): a torch gloo group (``asyncrl.process_groups``), one
  broadcast per tensor: what asyncrl's front receives, so the path runs on CPU.
- ``VllmNcclSender`` (``nccl``): vLLM's own code (0.32 to 0.34), on the trainer's GPU:
  ``nccl_common.trainer_init`` joins the group vLLM's workers join, and
  ``packed_tensor.packed_nccl_broadcast_producer`` sends the tensors in packed buffers.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import torch
import torch.distributed as dist

from asyncrl.process_groups import side_group


class TransferSender(Protocol):
    """Rank 0's end of the group with one server's workers, built by
    ``cls(address, port, world_size, timeout_s)`` while the server joins."""

    @classmethod
    def wire(cls) -> dict:
        """What the workers must know to receive (``init_info``'s ``packed`` and buffer
        geometry), known before the group forms."""
        ...

    def send(self, state: dict[str, torch.Tensor], deadline: float) -> None:
        """Send ``state`` in its order; raise ``TimeoutError`` at ``deadline`` (epoch s)."""
        ...

    def close(self) -> None:
        """Leave the group (a restarted server gets a new one)."""
        ...


class GlooSender:
    """Rank 0 of a torch gloo group with one server's workers: one broadcast per tensor."""

    @classmethod
    def wire(cls) -> dict:
        return {"packed": False}

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        # Both ends name the group by its port: names must be unique within a process.
        name = f"weights_transfer_{port}"
        self.group = side_group(address, port, 0, world_size, name, "gloo", timeout_s)

    def send(self, state: dict[str, torch.Tensor], deadline: float) -> None:
        for name, tensor in state.items():  # each bounded by the group's timeout
            if time.time() > deadline:
                raise TimeoutError(f"the generator's deadline passed before {name}")
            dist.broadcast(tensor.contiguous(), src=0, group=self.group)

    def close(self) -> None:
        dist.destroy_process_group(self.group)


class VllmNcclSender:
    """Rank 0 of vLLM's NCCL weight-transfer group with one server's workers (GPU): joins
    and sends packed buffers with vLLM's own code, on the trainer's current CUDA device."""

    @classmethod
    def wire(cls) -> dict:
        from vllm.distributed.weight_transfer import packed_tensor

        return {
            "packed": True,
            "packed_buffer_size_bytes": packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
            "packed_num_buffers": packed_tensor.DEFAULT_PACKED_NUM_BUFFERS,
        }

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        from vllm.distributed.weight_transfer import nccl_common, packed_tensor

        self.producer = packed_tensor.packed_nccl_broadcast_producer
        self.device = torch.device("cuda", torch.cuda.current_device())
        info = {"master_address": address, "master_port": port, "world_size": world_size}
        self.group = nccl_common.trainer_init(info, rank=0)

    def send(self, state: dict[str, torch.Tensor], deadline: float) -> None:
        # The copies are on the CPU (the readout gathers there); vLLM's communicator
        # broadcasts from its own device, in buffers of the wire's geometry.
        wire = self.wire()
        failed: list[BaseException] = []

        def send() -> None:
            torch.cuda.set_device(self.device)
            try:
                self.producer(
                    iter(state.items()),
                    self.group,
                    0,
                    lambda item: item[1].to(self.device, non_blocking=True),
                    wire["packed_buffer_size_bytes"],
                    wire["packed_num_buffers"],
                )
                torch.cuda.synchronize(self.device)
            except BaseException as e:
                failed.append(e)

        # NCCL has no timeout, and vLLM's sender waits on its streams inside: a peer that
        # never receives hangs it, so it runs on a thread of its own, left behind at the
        # deadline (the group is dropped, and publish raises once it has hung too long).
        thread = threading.Thread(target=send, name="nccl-send", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.time()))
        if thread.is_alive():
            raise TimeoutError("the NCCL broadcast did not complete by the deadline")
        if failed:
            raise RuntimeError(f"the NCCL broadcast failed: {failed[0]}") from failed[0]

    def close(self) -> None:
        self.group = None  # vLLM's communicator has no explicit teardown


SENDERS: dict[str, type[TransferSender]] = {"gloo": GlooSender, "nccl": VllmNcclSender}
