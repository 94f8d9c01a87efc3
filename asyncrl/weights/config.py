"""How weights travel from the trainer to embedded engines (``transport.weights``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class WeightSyncConfig:
    dtype: Literal["train", "bfloat16"] = "train"
    """Dtype on the wire: the training dtype (the engine then runs exactly the trainer's
    weights) or bf16 (half of fp32's bytes; the engine runs them rounded, as a bf16 server
    would, so the behavior logprobs drift further from the trainer's)."""
    bucket_mb: int = 64
    """Size of one bucket (one message): the largest piece of a version held in flight, and
    the unit a checksum covers. A tensor larger than a bucket spans several."""
    anchor_every: int = 50
    """Every this many versions (and a lineage's first) the whole weights go out, not a
    delta; a generator that lost its place waits at most this long without asking. 1 sends
    only anchors."""
    compress_level: int = 1
    """zlib level of the deltas (0: none). XORed neighbours are mostly zero bytes once
    byte-shuffled, so the fastest level already shrinks them several times; higher ones cost
    the sender thread more than they save."""
    timeout_s: float = 120.0
    """How long a generator waits for the rest of a version it has started to receive
    before it drops it and asks for an anchor, and how long ``publish`` waits for the
    sender to finish the previous version before it says what it is waiting for and fails."""

    probe_text: str = ""
    """A fixed text each generator scores after every weight flip and the trainer scores
    with the weights it published; the largest difference of their token logprobs is
    logged (``weights/probe_max_abs_diff``). Empty: no probe. Embedded engines only."""
    probe_alarm: float = 0.1
    """A difference above this many nats is an alarm: an error logged and counted
    (``weights/probe_alarms``). Measured on the CPU: the training dtype on the wire, 0;
    bf16 weights, 0.0008 nats on the test model and 0.013 on Qwen2.5-0.5B's shape."""
    probe_stop: bool = False
    """Stop the run at an alarm instead of going on."""

    def check(self) -> None:
        if self.bucket_mb < 1:
            raise ValueError(f"transport.weights.bucket_mb must be >= 1, got {self.bucket_mb}")
        if self.anchor_every < 1:
            raise ValueError(
                f"transport.weights.anchor_every must be >= 1, got {self.anchor_every}"
            )
        if not 0 <= self.compress_level <= 9:
            raise ValueError(
                f"transport.weights.compress_level must be in 0..9, got {self.compress_level}"
            )
        if self.probe_alarm <= 0:
            raise ValueError(f"transport.weights.probe_alarm must be > 0, got {self.probe_alarm}")
        if self.timeout_s <= 0:
            raise ValueError(f"transport.weights.timeout_s must be > 0, got {self.timeout_s}")
