"""What an engine takes and gives: requests, generated tokens, finish reports, status.

A generator (docs/architecture.md, Processes and their sockets) wraps one engine through the
``Engine`` protocol (``asyncrl.interfaces``): it submits ``Request``s, calls ``step`` in a
loop and streams the ``GeneratedToken``s it returns, aborts requests whose lease was
withdrawn, hands new ``Weights`` (tensors, or a directory on disk) to ``stage_weights`` as
the trainer publishes them, and reads an ``EngineStatus`` to decide how many leases to ask
for. Two implementations: the embedded torch engine (``asyncrl.engine.embedded``) and the
remote engine (``asyncrl.engine.remote``), which drives sglang or vLLM servers, or asyncrl's
front for the embedded engine (both APIs), over HTTP. Every generated token carries its
behavior logprob and the policy version that produced it (docs/design.md, Versions and
staleness).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import torch

FinishReason = Literal["eos", "stop", "length", "abort"]


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    """Generate at most this many tokens."""
    temperature: float = 1.0
    """Logits are divided by it; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    seed: int | None = None
    """Seed of this request's own generator, so its samples do not depend on its batch."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Finish (reason ``stop``) after any of these; the model's EOS always finishes."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: finish (reason ``stop``) at the first token whose decoded completion
    contains one; that token is still returned (see ``asyncrl.engine.stops``)."""


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GeneratedToken:
    """One new token of one request, with what the trainer needs to correct for it."""

    request_id: str
    token_id: int
    logprob: float
    """``log_softmax(logits / T)[token_id]`` over the full vocabulary (T = temperature, 1 for
    greedy): the quantity the trainer recomputes with ``token_logprobs(..., temperature=T)``.
    top-k/top-p truncation is not renormalized into it, as in sglang and AReaL."""
    version: int
    """Version of the weights whose forward pass produced the logits of this token."""


@dataclass
class Finished:
    request_id: str
    reason: FinishReason
    num_tokens: int
    """Tokens generated for the request in total."""
    matched: str | None = None
    """The stop string that ended it (reason ``stop``); None when a token or anything
    else did."""


@dataclass
class StepOutput:
    tokens: list[GeneratedToken]
    finished: list[Finished]
    version: int
    """Weights version the step ran with."""


class PushFailed(RuntimeError):
    """A ``WeightsPush`` did not bring its server to the version; ``touched``: the server's
    weights may have been partly replaced (or nobody can tell), so it must not generate
    until an update succeeds."""

    def __init__(self, why: str, touched: bool) -> None:
        super().__init__(why)
        self.touched = touched


class ServerFailed(RuntimeError):
    """An inference server the engine depends on failed in a way a restart of the generator
    cannot repair: it stopped answering and cannot be brought back (an attached one past
    ``engine.remote.dead_after_s``, a launched one that will not start), or it answers
    what the client cannot read. The message names its URL. A generator exits with
    ``EXIT_FATAL`` on it, and the run stops."""


class WeightsPush(Protocol):
    """Weights the trainer sends into one server itself, when asked: vLLM's weight transfer
    (``asyncrl.trainer.publish_vllm``). Remote engines with vLLM servers only."""

    def __call__(self, url: str, version: int) -> None:
        """Return once the server at ``url`` (paused and drained by the caller) runs
        ``version``; raise ``PushFailed`` saying why when it does not."""
        ...


Weights = Mapping[str, torch.Tensor] | str | Path | WeightsPush
"""New weights for ``Engine.stage_weights``: a state dict (full tensors by parameter name),
the path of a Hugging Face directory holding them in ``*.safetensors`` files (what
``asyncrl.engine.weight_dirs.write_weights_dir`` and the ``DiskWeightPublisher`` write), or a
``WeightsPush`` (remote vLLM servers)."""


@dataclass(frozen=True)
class EngineStatus:
    """An engine's state at one moment, read in one call: what its caller decides from
    (how many leases to ask for, whether to step, which weights are in use)."""

    running: int
    """Requests being decoded."""
    waiting: int
    """Requests submitted and not yet running."""
    free_slots: int
    """Requests that could start running now (free KV-cache slots, or server capacity)."""
    version: int
    """Version of the weights in use: the newest flipped in (or confirmed by every server)."""
    staged_version: int
    """Version of weights offered and not yet in use; -1 when there are none."""
    tokens: int
    """Tokens generated since the engine started."""
    prefill_tokens: int | None
    """Prompt tokens prefilled since the engine started; None where the engine cannot see
    them (the remote engine: its servers prefill)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Every counter and gauge under its ``engine/`` name, for logging and servers'
    ``/get_server_info``; decisions read the typed fields above."""
    failure: str | None = None
    """Why the engine cannot go on (``ServerFailed``'s message), as soon as it is known: an
    idle engine is not stepped, so its caller reads it here; None while it can."""
