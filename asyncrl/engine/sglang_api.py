"""What the remote engine sends to and reads from sglang's native HTTP API, by version.

Supported: sglang 0.5.0 to 0.5.23 (``SUPPORTED_SGLANG``); a server whose ``GET
/server_info`` ``version`` is outside is refused at attach, naming its URL, its version
and the range. Checked against the released wheels 0.5.10, 0.5.20, 0.5.21 and 0.5.23:
``tests/test_sglang_wheels.py`` parses each pinned wheel's route table (``python/sglang/
srt/entrypoints/http_server.py``), request structs (``srt/managers/io_struct.py``) and
``SamplingParams`` (``srt/sampling/sampling_params.py``) and checks every call this
client and ``asyncrl.trainer.publish_sglang.NcclWeightPublisher`` make against them.
asyncrl's own front (``asyncrl.serving.serve``) answers as one release (``--sglang-version``).

- **Attach.** ``GET /server_info``: ``version``, and the server's arguments, among them
  ``enable_deterministic_inference``; ``GET /model_info``: ``weight_version`` (a string;
  ``/get_model_info`` is its deprecated alias, ``/get_weight_version`` answers 404).
  There is no ``/version`` route.
- ``POST /generate`` {``rid``, ``input_ids``, ``sampling_params``, ``return_logprob``,
  ``stream``} streams server-sent events ``data: {json}`` and ends with ``data: [DONE]``;
  a failed request streams ``data: {"error": {"message"}}``. Each event's ``meta_info``
  has ``output_token_logprobs`` (``[logprob, token_id, text|null]`` per output token),
  ``completion_tokens``, ``prompt_tokens``, ``weight_version`` (a string) and
  ``finish_reason`` (null while running; ``{"type": "stop", "matched": token_id}``, or
  ``"matched": string`` for a stop string, ``{"type": "length", "length": n}``,
  ``{"type": "abort", "message", "status_code"}``). ``output_ids`` include the token that
  ended the request, the one in which a stop string completed too.
  Streams are cumulative by default (every event repeats all tokens so far) and
  incremental with ``--incremental-streaming-output``; ``new_tokens`` reads both.
- ``sampling_params`` keys sent: ``max_new_tokens``, ``temperature`` (0 = greedy),
  ``top_p``, ``top_k`` (only when set: sglang's "all" is -1, and it refuses 0),
  ``stop_token_ids`` and ``stop`` (when there are any), and ``sampling_seed`` only to a
  server that applies it: sglang ignores it unless launched with
  ``--enable-deterministic-inference`` (asyncrl's front always applies it), so another
  server samples unseeded, said once at attach. sglang builds ``SamplingParams(**keys)``:
  an unknown key (vLLM's ``seed``) is a TypeError, answered 500, so nothing else is sent:
  not ``no_stop_trim`` either, which only shapes the ``text`` the engine never reads (the
  reward's text is cut by ``asyncrl.engine.stops`` from the token ids). sglang looks for
  stop strings in text that keeps special tokens, asyncrl's engine in text that skips
  them; they differ only for a stop string that spells a special token.
- ``POST /abort_request`` {``rid``} aborts the live request of exactly that rid, and with
  it every request whose rid starts with it: the engine's rids are prefix-free
  (``asyncrl.engine.remote_requests.server_rid``). ``POST /pause_generation`` {``mode``:
  ``"abort"``} ends every request in flight with finish reason abort and holds new ones
  until ``POST /continue_generation`` {} (0.5.10's takes no field, and ignores one);
  ``POST /update_weights_from_disk`` {``model_path``, ``weight_version``} answers
  {``success``, ``message``} — while paused it does not wait for requests to finish.
- ``POST /init_weights_update_group`` {``master_address``, ``master_port``,
  ``rank_offset``, ``world_size``, ``group_name``, ``backend``} and ``POST
  /update_weights_from_distributed`` {``names``, ``dtypes`` (``"bfloat16"``…), ``shapes``,
  ``group_name``, ``flush_cache``, ``weight_version``}: from 0.5.21 (``SESSIONS_FROM``)
  the latter is refused (400) unless ``POST /begin_weight_update`` {} came first, and
  ``POST /end_weight_update`` {} follows; disk updates need neither. See
  ``asyncrl.trainer.publish_sglang.NcclWeightPublisher``.
- ``GET /health``: 200 once the server serves.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.engine.base import SamplingParams
from asyncrl.seeds import derive_seed

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_SGLANG = ((0, 5, 0), (0, 5, 23))
"""Accepted ``/server_info`` ``version``: (major, minor, patch) from the first to the
second, both included. 0.5.23 is the newest release checked."""
SESSIONS_FROM = (0, 5, 21)
"""The first release that refuses ``/update_weights_from_distributed`` outside a
``/begin_weight_update`` … ``/end_weight_update`` session (and has those routes)."""


@dataclass(frozen=True)
class SglangServer:
    """What an sglang server is, as read from its ``/server_info``: what may be sent it."""

    version: tuple[int, int, int]
    deterministic: bool = False
    """Launched with ``--enable-deterministic-inference``: the only mode in which sglang
    applies a request's ``sampling_seed`` (asyncrl's front says it is, and is)."""

    @property
    def seeded(self) -> bool:
        """Whether a request's ``sampling_seed`` is applied (else it is not sent)."""
        return self.deterministic

    @property
    def weight_sessions(self) -> bool:
        """Whether distributed weight updates must run inside a begin/end session."""
        return self.version >= SESSIONS_FROM


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as ``0.5.21.post1`` or ``v0.5.9``."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return (int(match[1]), int(match[2]), int(match[3] or 0)) if match else None


def check_version(url: str, reported: object) -> tuple[int, int, int]:
    """The parsed ``reported`` (``/server_info``'s ``version``); RuntimeError unless it is
    in ``SUPPORTED_SGLANG``, naming the server, its version and the range."""
    low, high = SUPPORTED_SGLANG
    parsed = parse_version(reported if isinstance(reported, str) else "")
    if parsed is None or not low <= parsed <= high:
        supported = f"{'.'.join(map(str, low))} to {'.'.join(map(str, high))}"
        raise RuntimeError(
            f"the sglang server at {url} reports version {reported!r} (GET /server_info); "
            f"asyncrl's sglang client supports sglang {supported}"
        )
    return parsed


def read_server(url: str, info: dict) -> SglangServer:
    """The server at ``url`` from its ``GET /server_info`` answer (``check_version``)."""
    version = check_version(url, info.get("version"))
    return SglangServer(version, info.get("enable_deterministic_inference") is True)


def generate_payload(
    rid: str,
    input_ids: list[int],
    params: SamplingParams,
    max_new_tokens: int,
    server: SglangServer,
) -> dict:
    """The body of a streaming ``/generate`` request to ``server``. A seeded request's
    ``sampling_seed`` is its seed keyed by where the attempt starts (a resumed attempt
    draws afresh), sent only where ``server.seeded``."""
    sampling = {
        "max_new_tokens": max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.seed is not None and server.seeded:
        sampling["sampling_seed"] = derive_seed(params.seed, len(input_ids))
    if params.top_k > 0:
        sampling["top_k"] = params.top_k
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        sampling["stop"] = list(params.stop)
    return {
        "rid": rid,
        "input_ids": input_ids,
        "sampling_params": sampling,
        "return_logprob": True,
        "stream": True,
    }


async def events(lines: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """The JSON objects of a server-sent event stream, up to ``data: [DONE]``."""
    async for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def new_tokens(meta: dict, seen: int, version: int) -> tuple[list[tuple[int, float, int]], int]:
    """``(token_id, logprob, version)`` of each token ``meta`` adds to the ``seen`` ones of
    this request, and the new count. New tokens are the last ``completion_tokens - seen``
    logprob entries: right for cumulative and incremental streams alike. Their versions
    are ``output_token_versions`` (asyncrl's front) when given, else ``version``: the
    chunk's ``weight_version`` (sglang reports one per response)."""
    entries = meta.get("output_token_logprobs") or []
    new = min(meta.get("completion_tokens", len(entries)) - seen, len(entries))
    if new <= 0:
        return [], seen
    versions = meta.get("output_token_versions")
    if not versions or len(versions) < new:
        versions = [version] * new
    out = [
        (int(entry[1]), float(entry[0]), as_version(v, version))
        for entry, v in zip(entries[-new:], versions[-new:])
    ]
    return out, seen + new


def finish_reason(finish: dict | str, eos_ids: set[int]) -> tuple[str, bool]:
    """asyncrl's finish reason of a server's ``finish_reason``, and whether it reports an
    error (an abort sglang gives an HTTP status code: a request it refused or lost).
    sglang reports EOS and ``stop_token_ids`` alike (``stop``, matched = the token id);
    EOS wins, as in the embedded engine."""
    if isinstance(finish, str):
        return finish, False
    kind, matched = finish.get("type"), finish.get("matched")
    if kind == "stop":
        return ("eos" if isinstance(matched, int) and matched in eos_ids else "stop"), False
    error = kind == "abort" and int(finish.get("status_code") or 0) >= 400
    return kind, error


def matched_stop(finish: dict | str) -> str | None:
    """The stop string a server's ``finish_reason`` says ended the request; None when a
    token (``matched`` is its id) or anything else did."""
    matched = finish.get("matched") if isinstance(finish, dict) else None
    return matched if isinstance(matched, str) else None


def as_version(value, default: int) -> int:
    """A ``weight_version`` (a string in sglang) as an int; ``default`` when it is not a
    number (sglang's ``"default"`` when launched without ``--weight-version``)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def eos_ids(model_path: str, config: PretrainedConfig) -> set[int]:
    """The token ids sglang stops at on its own: the generation config's EOS, else the
    model config's (``config``, the model's ``transformers`` config)."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
