"""Where a buffer's lease meets an engine: the experiment's sampling settings
(``SamplingConfig``, ``experiment.sampling``; the buffer sends them with every lease as
the wire's ``SamplingSpec``), the engine request a lease becomes (``lease_request``), and
the tokens generated for it and not yet sent (``PendingLease``, ``record_tokens``). Used
by the generator, the colocated placement and the episode driver."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.engine.base import Request, SamplingParams, StepOutput
from asyncrl.wire import EpisodeFigures, Lease, SamplingSpec


@dataclass
class SamplingConfig:
    max_new_tokens: int = 16
    """Tokens generated per sample at most; per model turn for a multi-turn task (whose
    episodes are bounded by ``task.max_episode_tokens``)."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = 0
    """Top-k truncation (0: off)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a sample ends (finish reason ``stop``) at the first token whose decoded
    completion (special tokens skipped) contains one, in both engines. That token stays in
    the token ids the trainer trains on, as sglang and vLLM return it; the reward's text is
    cut at the string (``keep_stop_text``). A sample resumed after an interruption is
    checked from where it resumed; empty strings are ignored. See ``asyncrl.engine.stops``."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample (finish reason ``stop``) besides the model's EOS. The
    token stays in the token ids; its text is left out of the reward's text unless
    ``keep_stop_text`` (a special token's never shows)."""
    seeded: bool = True
    """Each sample draws from its own seed (the run's ``seed``, its group and its index)
    by token position, so its tokens depend on no timing and ``tools/replay.py`` can
    decode it again. False: the engine's own randomness (for a server whose per-request
    seeds cost decode speed)."""
    keep_stop_text: bool = False
    """Whether the reward's text keeps the stop string, cut right after it, or not (the
    default), cut right before it: vLLM's ``include_stop_str_in_output``, sglang's
    ``no_stop_trim``; likewise a final stop token's text. Token ids are never cut."""

    def spec(self, seed: int | None = None) -> SamplingSpec:
        """The buffer's sampling for every lease; ``seed``, the run's, from which the
        buffer derives each sample's own (None, or ``seeded`` off: unseeded draws)."""
        return SamplingSpec(
            seed=seed if self.seeded else None,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=list(self.stop_token_ids),
            stop=list(self.stop),
        )


def lease_request(lease: Lease) -> Request:
    """The engine request of a lease: its prompt plus any prefix an earlier holder
    generated, with the generation budget that prefix leaves."""
    s = lease.sampling
    params = sampling_params(s, max(1, s.max_new_tokens - len(lease.prefix_ids)), s.seed)
    return Request(lease.lease_id, lease.prompt_ids + lease.prefix_ids, params)


def sampling_params(s: SamplingSpec, max_new_tokens: int, seed: int | None) -> SamplingParams:
    """The engine's sampling parameters for a lease's ``s``, with this budget and seed."""
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=seed,
        stop_token_ids=list(s.stop_token_ids),
        stop=list(s.stop),
    )


@dataclass
class PendingLease:
    """Tokens of one lease generated and not yet sent; the three lists line up, one entry
    per token."""

    lease: Lease
    seq: int = 0
    """Sequence number of the next chunk of this lease."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Behavior logprob of each token."""
    versions: list[int] = field(default_factory=list)
    """Weights version that produced each token."""
    last_flush: float = 0.0
    """When the last chunk went out (``time.time()``)."""
    loss_mask: list[int] = field(default_factory=list)
    """Episodes: one entry per token (0: the environment's); empty: all the model's."""
    reward: float | None = None
    """Episodes: the environment's reward, sent with the finishing chunk."""
    episode: EpisodeFigures | None = None
    """Episodes: the finished episode's figures (``Chunk.episode``)."""
    frames: bytearray = field(default_factory=bytearray)
    """Pictures: the frames of the steps in ``token_ids`` (``Chunk.frames``)."""
    whole_turns: bool = False
    """Episodes: tokens go out a whole turn at a time, never in timed chunks, so that a
    continued episode always starts at a turn's end."""


def record_tokens(
    pending: dict[str, PendingLease], out: StepOutput
) -> list[tuple[PendingLease, str]]:
    """Append an engine step's tokens (each with its logprob and version) to their leases;
    remove the finished ones from ``pending`` and return them with their finish reason.
    Requests not in ``pending`` (aborted because their lease was taken back; an engine
    may still report their last tokens and their finish) are ignored."""
    for t in out.tokens:
        p = pending.get(t.request_id)
        if p is not None:
            p.token_ids.append(t.token_id)
            p.logprobs.append(t.logprob)
            p.versions.append(t.version)
    return [(pending.pop(f.request_id), f.reason) for f in out.finished if f.request_id in pending]
