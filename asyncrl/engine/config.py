"""Which inference engine the generators run, and each backend's own settings.

An experiment (and the rollout config every generator reads) holds one ``EngineConfig``:
``backend`` picks the engine, and only the selected backend's section is used —
``engine.embedded.*`` for ``EmbeddedEngine`` (``asyncrl.engine.embedded``, in the
generator process) or ``engine.remote.*`` for ``RemoteEngine`` (``asyncrl.engine.remote``,
inference servers over HTTP). Each engine class takes its own section only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncrl.engine.servers import RemoteEngineConfig


@dataclass
class EmbeddedEngineConfig:
    """The embedded engine's settings (``engine.embedded.*``)."""

    max_slots: int = 64
    """Sequences decoded together (KV-cache slots)."""
    max_seq_len: int = 0
    """Longest prompt + completion; 0 means the model's ``max_position_embeddings``."""
    max_prefill_tokens: int = 2048
    """Prompt tokens admitted (prefilled) in one step; a prompt identical to one admitted
    in the same step counts once (see ``share_prefill``)."""
    share_prefill: bool = True
    """Requests admitted in one step with identical tokens (a GRPO group's samples of one
    prompt) are prefilled once: the others get a copy of its K/V and sample their first
    token from its logits. Off prefills each, for the equivalence test and the ablation."""
    flip_policy: Literal["recompute", "keep"] = "keep"
    """What in-flight sequences do when new weights are flipped in. ``keep`` continues on
    the K/V cached under the weights they were computed with (PipelineRL, PRIME-RL, SkyRL):
    a flip costs no step time, and every token carries the version that sampled it, which
    the decoupled loss corrects for. ``recompute`` re-prefills every running sequence under
    the new weights (AReaL): one step that costs a prefill of everything in flight, which
    grows with completion length. docs/results.md compares the two on learning."""
    threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine runs; auto picks CUDA when available."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of weights and KV cache."""


@dataclass
class EngineConfig:
    backend: Literal["embedded", "remote"] = "embedded"
    """The generators' engine: ``embedded`` (asyncrl's torch engine, in the generator
    process) or ``remote`` (HTTP servers speaking sglang's API, launched or attached)."""
    embedded: EmbeddedEngineConfig = field(default_factory=EmbeddedEngineConfig)
    """The embedded engine's settings (also the engine of the colocated placement)."""
    remote: RemoteEngineConfig = field(default_factory=RemoteEngineConfig)
    """The remote engine's servers: launch or attach, capacity, weight updates."""

    @property
    def threads(self) -> int:
        """torch threads of a generator process: the selected backend's ``threads``."""
        return self.remote.threads if self.backend == "remote" else self.embedded.threads
