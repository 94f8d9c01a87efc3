"""Weight publication from trainer rank 0 to the generators (DESIGN §5): the full state,
gathered to rank 0, sent as raw ZeroMQ frames on a PUB socket, one message per version.
Another transport (a versioned HF directory on disk, NCCL broadcast) is another class
with the same two methods, ``publish`` and ``republish``."""

from __future__ import annotations

import time

import torch
import zmq

from asyncrl.transport import bind, make_socket, write_endpoints
from asyncrl.wire import encode_tensors


class WeightPublisher:
    """Rank 0's PUB socket: every generator receives each published version."""

    def __init__(self, cfg) -> None:
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.PUB, cfg.transport)
        endpoint = bind(self.sock, cfg.transport, cfg.run_dir, "trainer-weights")
        write_endpoints(cfg.run_dir, "trainer", {"weights": endpoint})
        self.run_id = cfg.run_id
        self.last: tuple[int, dict[str, torch.Tensor]] | None = None

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> float:
        start = time.perf_counter()
        self.sock.send_multipart(encode_tensors(version, self.run_id, state), copy=False)
        self.last = (version, state)
        return time.perf_counter() - start

    def republish(self) -> None:
        """Send the last version again: PUB drops messages for subscribers that were not
        connected yet, so a generator restarted after the publish would never get it."""
        if self.last is not None:
            self.publish(*self.last)

    def close(self) -> None:
        self.ctx.destroy(linger=1000)
