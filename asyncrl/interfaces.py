"""The components' interfaces, declared in this one place as narrow ``typing.Protocol``s:
what one part of asyncrl asks of another, and nothing more. A new implementation (a
transport, a placement, an engine) is one class that has these methods.

- ``BatchSource``: what a trainer rank asks of the buffer. Implemented by
  ``asyncrl.buffer.client.BufferClient`` (the buffer process, over ZeroMQ) and by
  ``asyncrl.loop.colocated.ColocatedRollout`` (generation inside the trainer process).
- ``WeightPublisher``: how trainer rank 0 hands new weights to the generators.
  Implemented by ``BucketPublisher`` (``asyncrl.weights.sender``), ``DiskWeightPublisher``,
  ``NcclWeightPublisher`` and ``NoWeightPublisher`` (ranks other than 0) in
  ``asyncrl.trainer.publish``, and by ``ColocatedRollout``.
- ``Engine``: what a generator (and the colocated placement) asks of an inference engine.
  Implemented by ``asyncrl.engine.embedded.EmbeddedEngine`` (asyncrl's torch engine, in
  the process) and ``asyncrl.engine.remote.RemoteEngine`` (sglang or vLLM servers over HTTP).
- ``SharedEngine``: an ``Engine`` that gives its memory back to a trainer in its process
  (the colocated placement, evaluation). Implemented by ``EmbeddedEngine``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from asyncrl.engine.base import EngineStatus, Request, StepOutput, Weights
from asyncrl.wire import Batch


class BatchSource(Protocol):
    """Where a trainer rank's batches come from, and whom it tells about versions and
    checkpoints."""

    def request_batch(
        self,
        step: int,
        world_size: int,
        timeout_s: float = 600.0,
        on_wait: Callable[[], None] | None = None,
        wait_tick_s: float = 10.0,
        deadline: float | None = None,
    ) -> Batch | None:
        """Block until this rank's share of ``step``'s batch is there (whole groups, none
        staler than ``max_staleness``) and return it; ``on_wait`` runs every
        ``wait_tick_s`` seconds spent waiting; ``TimeoutError`` after ``timeout_s``; None
        once ``deadline`` (Unix time: the stage's time limit) passes without it."""
        ...

    def announce_version(self, version: int, resumed: bool = False) -> None:
        """The newest published version (the staleness gate moves with it), or
        (``resumed``) the version this trainer starts at, from a checkpoint or from 0."""
        ...

    def announce_checkpoint(self, oldest_kept_step: int) -> None:
        """Batches of steps before ``oldest_kept_step`` will never be asked for again."""
        ...

    def close(self) -> None:
        """Release sockets, engines and worker processes."""
        ...


@dataclass
class FullParameters:
    """The policy's parameters, unsharded one at a time (``TrainerCore.full_parameters``):
    names, dtypes and full shapes up front, then the tensors by iterating ``tensors`` once.
    Each is gathered as it is reached (a collective), so every rank iterates to the end
    and no rank ever holds more than one whole tensor at once."""

    specs: list[tuple[str, torch.dtype, torch.Size]]
    tensors: Iterable[tuple[str, torch.Tensor]]

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> FullParameters:
        """Of whole tensors already at hand."""
        return cls([(name, t.dtype, t.shape) for name, t in state.items()], state.items())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All of them at once (each a copy), for paths that need the whole state."""
        return {name: t.clone() for name, t in self.tensors}


class WeightPublisher(Protocol):
    """How trainer rank 0 sends each new version of the policy to the generators."""

    lineage: str
    """Whose versions these are: new at each trainer start, so a generator tells a
    restarted trainer's versions from the last one's ("" where nothing is sent)."""

    def publish(self, version: int, params: FullParameters) -> float:
        """Send ``params`` as ``version`` (every rank calls it, and iterates ``params`` to
        the end); returns the seconds the caller was held."""
        ...

    def republish(self) -> None:
        """Send the last version again, for generators that joined since (a no-op where
        nothing can have been missed)."""
        ...

    def close(self) -> None:
        """Release sockets and process groups."""
        ...


class Engine(Protocol):
    """An inference engine: continuous batching over requests, one token per running
    request per ``step``, each with its behavior logprob and weights version; new weights
    flipped in between two steps, so decoding never waits for a transfer (docs/design.md,
    Weights without stopping generation; Engines)."""

    def submit(self, request: Request) -> None:
        """Queue a request; it joins the running batch at a later step. ``ValueError`` for
        an empty prompt, one that does not fit the context, or an id already in use."""
        ...

    def step(self) -> StepOutput:
        """Advance every running request by one token (prefilling newly admitted ones) and
        report the requests that finished, aborted ones included."""
        ...

    def abort(self, request_id: str) -> None:
        """Drop a queued or running request; a later step reports it finished (``abort``).
        An unknown or already finished id is ignored."""
        ...

    def stage_weights(self, weights: Weights, version: int, *, wait: bool = False) -> None:
        """Offer weights ``version`` (tensors, which the engine adopts, a directory on disk,
        or, for remote vLLM servers, a ``WeightsPush``); received off the decode path and
        used from a later step on. Offers not
        newer than the engine's newest are ignored by the remote engine. ``wait``: return
        only once ``version`` is in use, for a caller that is not stepping meanwhile (the
        colocated placement)."""
        ...

    def status(self) -> EngineStatus:
        """Requests running and waiting, free capacity, weights versions, counters."""
        ...

    def close(self) -> None:
        """Stop background threads, and the servers the engine launched."""
        ...


class SharedEngine(Engine, Protocol):
    """An engine sharing its process with a trainer (the colocated placement, evaluation
    on trainer rank 0): it gives its memory back while the trainer works."""

    @property
    def idle(self) -> bool:
        """No request queued or running: nothing holds the KV cache."""
        ...

    def release_memory(self) -> None:
        """Free the KV cache and the weights; the engine must be idle, nothing staging."""
        ...

    def resume_memory(self) -> None:
        """Allocate the KV cache again, once ``stage_weights(..., wait=True)`` (or
        ``load_weights``) has put weights back."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Stage ``state_dict`` and flip to it now (a caller that is not stepping)."""
        ...


@runtime_checkable
class ProbeScorer(Protocol):
    """An engine that can score a fixed token sequence under the weights it decodes with
    (``transport.weights.probe_text``: the check after each flip)."""

    def score(self, tokens: list[int]) -> tuple[int, list[float]]:
        """The active weights' version and their logprobs (temperature 1) of
        ``tokens[1:]``, each given those before it; called between two steps."""
        ...
