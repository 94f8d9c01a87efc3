"""What the remote engine sends to and reads from sglang's native HTTP API (0.5.x).

Checked against sglang's source: the routes in ``python/sglang/srt/entrypoints/
http_server.py``; the request structs ``GenerateReqInput``, ``AbortReq``,
``PauseGenerationReqInput``, ``UpdateWeightFromDiskReqInput``,
``InitWeightsUpdateGroupReqInput`` and ``UpdateWeightsFromDistributedReqInput`` in
``python/sglang/srt/managers/io_struct.py``; and the responses built by
``TokenizerManager`` (``_handle_batch_output``, ``convert_logprob_style``,
``pause_generation``, ``update_weights_from_disk``) in ``python/sglang/srt/managers/
tokenizer_manager.py``. asyncrl's own front (``asyncrl.engine.serve``) answers the same.

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
  ``top_p``, ``top_k`` (only when set: sglang's "all" is -1), ``stop_token_ids`` and
  ``stop`` (when there are any). sglang rejects unknown keys, so nothing else is sent:
  not ``no_stop_trim`` either, which only shapes the ``text`` the engine never reads (the
  reward's text is cut by ``asyncrl.engine.stops`` from the token ids). sglang looks for
  stop strings in text that keeps special tokens, asyncrl's engine in text that skips
  them; they differ only for a stop string that spells a special token.
- ``POST /abort_request`` {``rid``}; ``POST /pause_generation`` {``mode``: ``"abort"``} ends
  every request in flight with finish reason abort and holds new ones until ``POST
  /continue_generation`` {} (older sglang takes no body, and ignores one);
  ``POST /update_weights_from_disk`` {``model_path``, ``weight_version``} answers
  {``success``, ``message``} — while paused it does not wait for requests to finish.
- ``POST /init_weights_update_group`` {``master_address``, ``master_port``,
  ``rank_offset``, ``world_size``, ``group_name``, ``backend``} and ``POST
  /update_weights_from_distributed`` {``names``, ``dtypes`` (``"bfloat16"``…), ``shapes``,
  ``group_name``, ``flush_cache``, ``weight_version``}: see
  ``asyncrl.trainer.publish.NcclWeightPublisher``.
- ``GET /health`` (200 once the server serves), ``GET /get_model_info`` (``weight_version``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from asyncrl.engine.base import SamplingParams
from asyncrl.seeds import derive_seed


def generate_payload(
    rid: str, input_ids: list[int], params: SamplingParams, max_new_tokens: int
) -> dict:
    """The body of a streaming ``/generate`` request. A seeded request's ``sampling_seed``
    is its seed keyed by where the attempt starts (a resumed attempt draws afresh); sglang
    applies it in its deterministic mode (``--enable-deterministic-inference``), and the
    embedded engine's front always."""
    sampling = {
        "max_new_tokens": max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.seed is not None:
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


def eos_ids(model_path: str, config) -> set[int]:
    """The token ids sglang stops at on its own: the generation config's EOS, else the
    model config's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
