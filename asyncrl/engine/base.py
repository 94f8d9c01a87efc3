"""The inference-engine interface: what a generator needs from any engine.

A generator (DESIGN §2) wraps one engine: it submits requests, calls ``step`` in a loop
and streams the tokens it returns, aborts requests whose lease was withdrawn, and hands
new weights to ``stage_weights`` as the trainer publishes them. Two implementations:
the embedded torch engine (``asyncrl.engine.embedded``), and the remote engine
(``asyncrl.engine.remote``), which drives sglang servers, or asyncrl's sglang-compatible
front for the embedded engine, over HTTP and also takes weights as a directory on disk
(``load_from_disk``). Every generated token carries its behavior logprob and the policy
version that produced it (DESIGN §4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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


@dataclass
class StepOutput:
    tokens: list[GeneratedToken]
    finished: list[Finished]
    version: int
    """Weights version the step ran with."""


class Engine(Protocol):
    def submit(self, request: Request) -> None:
        """Queue a request; it joins the running batch at a later step."""

    def step(self) -> StepOutput:
        """Advance every active request by one token (prefilling newly admitted ones)."""

    def abort(self, request_id: str) -> None:
        """Drop a queued or running request and free its slot; reported as finished."""

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Receive weights off the decode path; the engine flips to them between steps."""

    def stats(self) -> dict[str, float]:
        """Counters and gauges for metrics (active, queued, free slots, tokens, version …)."""
