"""sglang's native ``/generate`` protocol (0.5.x), as ``asyncrl.serving.serve`` speaks it:
turning a request body into an engine ``Request`` (a request's progress becomes sglang's
response object in ``asyncrl.serving.sglang_response``).

Checked against sglang's source (0.5.x): ``GenerateReqInput`` and ``AbortReq`` in
``python/sglang/srt/managers/io_struct.py``, the response building in
``TokenizerManager._handle_batch_output``, the finish reasons' ``to_json`` in
``python/sglang/srt/managers/schedule_batch.py``, and ``SamplingParams`` in
``python/sglang/srt/sampling/sampling_params.py``.

A response is ``{"text", "output_ids", "meta_info"}``. Its per-token lists line up
index by index: ``output_ids[i]``, ``meta_info["output_token_logprobs"][i] ==
[logprob, output_ids[i], None]`` and ``meta_info["output_token_versions"][i]`` (the
asyncrl extension: the ``weight_version`` of the weights that produced token ``i``).
Streamed responses are cumulative (sglang's default, ``--stream-output`` off): every
event repeats all tokens so far.

Every client error raises ``BadRequest`` with a message that names the field, e.g.
``sampling_params.top_p must be in (0, 1], got 0``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.engine.base import SamplingParams

if TYPE_CHECKING:
    from aiohttp import web


class BadRequest(ValueError):
    """A client error; the server answers it with HTTP 400 and this message."""


class WrongType(BadRequest):
    """A body that is not JSON, or a value of the wrong JSON type: what vLLM's request
    schema refuses before its own checks (its error type is then ``Bad Request``)."""


@dataclass
class GenerateInput:
    """One validated ``/generate`` request."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    stream: bool = False
    stream_interval: int = 1
    """Stream an event every this many new tokens (and always the final one)."""
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    """Keep a matched stop token or stop string in ``text`` (the string cut right after it);
    the token that ended the request is always in ``output_ids``."""


# sglang sampling parameters the engine does not implement, accepted at their neutral value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_new_tokens": (0,),
    "n": (1,),
    "ignore_eos": (False,),
    "stop_regex": ("", []),
    "json_schema": (),
    "regex": (),
    "ebnf": (),
    "structural_tag": (),
    "custom_params": ({},),
    "logit_bias": ({},),
    "spaces_between_special_tokens": (True, False),
}
_IMPLEMENTED = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "stop",
    "sampling_seed",
    "stream_interval",
    "skip_special_tokens",
    "no_stop_trim",
}
# Top-level GenerateReqInput fields the embedded engine cannot honour when set.
_UNSUPPORTED_INPUTS = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "lora_id",
    "session_params",
    "custom_logit_processor",
    "token_ids_logprob",
    "bootstrap_host",
)


def decode_body(raw: bytes) -> dict:
    """A request body that must be one JSON object (both HTTP fronts read bodies so)."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise WrongType(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def read_json(request: web.Request, empty_ok: bool = False) -> dict:
    """A request's body as ``decode_body`` reads it; an empty one is ``{}`` if ``empty_ok``."""
    raw = await request.read()
    if not raw.strip() and empty_ok:
        return {}
    return decode_body(raw)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any, name: str) -> float:
    kind = WrongType if not (_is_int(value) or isinstance(value, float)) else BadRequest
    if kind is WrongType or not math.isfinite(value):
        raise kind(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(value: Any, name: str, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        kind = BadRequest if _is_int(value) else WrongType
        raise kind(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _flag(body: dict, key: str, name: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}")
    return value


def _token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{name} must be a non-empty list of token ids, got {value!r:.80}")
    if any(isinstance(v, list) for v in value):
        raise BadRequest(
            f"{name} is a batch (a list of lists); this server takes one prompt per request"
        )
    bad = [v for v in value if not _is_int(v) or not 0 <= v < vocab_size]
    if bad:
        raise BadRequest(f"{name} must hold token ids in [0, {vocab_size}), got {bad[0]!r}")
    return value


def _prompt(body: dict, vocab_size: int, encode: Callable[[str], list[int]]) -> list[int]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("give exactly one of input_ids (a list of token ids) or text")
    if input_ids is not None:
        return _token_ids(input_ids, "input_ids", vocab_size)
    if not isinstance(text, str) or not text:
        raise BadRequest(f"text must be a non-empty string (one prompt), got {text!r:.80}")
    return _token_ids(encode(text), "text (tokenized)", vocab_size)


def _stop_strings(value: Any) -> list[str]:
    """sglang's ``stop``: one string or a list of them; null and "" mean none."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BadRequest(
            f"sampling_params.stop must be a string or a list of non-empty strings, "
            f"got {value!r:.80}"
        )
    return list(value)


def _sampling_keys(raw: Any) -> dict[str, Any]:
    """``sampling_params`` as a dict whose every key the engine honours or can ignore."""
    if raw is None:
        return {}
    if isinstance(raw, list):
        raise BadRequest("sampling_params is a batch (a list); send one request per prompt")
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be a JSON object, got {raw!r:.80}")
    for key, value in raw.items():
        name = f"sampling_params.{key}"
        if key in _NEUTRAL:
            if value is not None and value not in _NEUTRAL[key]:
                raise BadRequest(f"{name}={value!r} is not supported by the embedded engine")
        elif key not in _IMPLEMENTED:
            raise BadRequest(f"{name} is not a sampling parameter")
    return raw


def _max_new_tokens(raw: dict[str, Any], prompt_len: int, max_seq_len: int) -> int:
    room = max_seq_len - prompt_len
    if raw.get("max_new_tokens") is None:
        # As in sglang: an absent limit (default 128) or null stops at the context length;
        # only an explicit limit that does not fit is an error.
        return room if "max_new_tokens" in raw else min(128, room)
    max_new = _integer(raw["max_new_tokens"], "sampling_params.max_new_tokens", 1)
    if max_new > room:
        raise BadRequest(
            f"sampling_params.max_new_tokens={max_new} plus the prompt's {prompt_len} "
            f"tokens exceed the context length {max_seq_len}"
        )
    return max_new


def _output_options(raw: dict[str, Any]) -> dict[str, Any]:
    """The output options that ride in sglang's ``sampling_params``."""
    interval = raw.get("stream_interval")
    return {
        "stream_interval": 1
        if interval is None
        else _integer(interval, "sampling_params.stream_interval", 1),
        "skip_special_tokens": _flag(
            raw, "skip_special_tokens", "sampling_params.skip_special_tokens", True
        ),
        "no_stop_trim": _flag(raw, "no_stop_trim", "sampling_params.no_stop_trim", False),
    }


def _sampling(
    raw: Any, prompt_len: int, vocab_size: int, max_seq_len: int
) -> tuple[SamplingParams, dict[str, Any]]:
    """Engine sampling params, plus the output options that ride in sglang's
    ``sampling_params`` (stream_interval, skip_special_tokens, no_stop_trim)."""
    raw = _sampling_keys(raw)
    max_new = _max_new_tokens(raw, prompt_len, max_seq_len)
    temperature = raw.get("temperature")
    temperature = (
        1.0 if temperature is None else _number(temperature, "sampling_params.temperature")
    )
    if temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0, got {temperature}")
    top_p = raw.get("top_p")
    top_p = 1.0 if top_p is None else _number(top_p, "sampling_params.top_p")
    if not 0 < top_p <= 1:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {raw['top_p']!r}")
    top_k = raw.get("top_k")
    top_k = -1 if top_k is None else top_k
    if not _is_int(top_k) or (top_k < 1 and top_k != -1):
        raise BadRequest(f"sampling_params.top_k must be -1 (all) or >= 1, got {top_k!r}")
    stop_ids = raw.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    if stop_ids:
        stop_ids = _token_ids(stop_ids, "sampling_params.stop_token_ids", vocab_size)
    elif not isinstance(stop_ids, list):
        raise BadRequest(f"sampling_params.stop_token_ids must be a list, got {stop_ids!r:.80}")
    seed = raw.get("sampling_seed")
    if seed is not None:
        seed = _integer(seed, "sampling_params.sampling_seed", 0)
    params = SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        # sglang's "all tokens" is -1 (or 1 << 30); the engine's is 0.
        top_k=0 if top_k == -1 or top_k >= vocab_size else top_k,
        seed=seed,
        stop_token_ids=list(stop_ids),
        stop=_stop_strings(raw.get("stop")),
    )
    return params, _output_options(raw)


def parse_generate(
    body: Any, *, vocab_size: int, max_seq_len: int, encode: Callable[[str], list[int]]
) -> GenerateInput:
    """Validate a ``/generate`` body; raises ``BadRequest`` naming the faulty field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key in _UNSUPPORTED_INPUTS:
        if body.get(key):
            raise BadRequest(f"{key} is not supported by the embedded engine")
    prompt = _prompt(body, vocab_size, encode)
    if len(prompt) >= max_seq_len:
        raise BadRequest(
            f"input_ids: the prompt's {len(prompt)} tokens leave no room in the context "
            f"length {max_seq_len}"
        )
    params, options = _sampling(body.get("sampling_params"), len(prompt), vocab_size, max_seq_len)
    rid = body.get("rid")
    if isinstance(rid, list):
        raise BadRequest("rid is a batch (a list); send one request per prompt")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise BadRequest(f"rid must be a non-empty string, got {rid!r:.80}")
    return_logprob = body.get("return_logprob")
    if isinstance(return_logprob, list):
        raise BadRequest("return_logprob is a batch (a list); send one request per prompt")
    # Logprobs of prompt tokens are not computed: only -1 (output tokens only) is accepted.
    if body.get("logprob_start_len") not in (None, -1):
        raise BadRequest("logprob_start_len: prompt logprobs are not supported (use -1)")
    if body.get("top_logprobs_num") not in (None, 0):
        raise BadRequest("top_logprobs_num: top logprobs are not supported (use 0)")
    return GenerateInput(
        rid=rid or uuid.uuid4().hex,
        prompt_ids=list(prompt),
        params=params,
        return_logprob=_flag(body, "return_logprob", "return_logprob", False),
        return_text_in_logprobs=_flag(
            body, "return_text_in_logprobs", "return_text_in_logprobs", False
        ),
        stream=_flag(body, "stream", "stream", False),
        **options,
    )
