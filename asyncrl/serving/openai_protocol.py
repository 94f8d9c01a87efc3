"""OpenAI's completion API, vLLM's flavour, as data: the requests the front accepts and
the responses it gives (``asyncrl.serving.openai_api`` serves them over HTTP).

A request becomes the sglang ``/generate`` request it means, checked by
``serve_protocol.parse_generate`` (one set of rules for both fronts). The shaping
functions take a ``Completion``, no server: the capture server of
``asyncrl.episodes.openai_agent`` answers in the same shape.

Keys beyond OpenAI's: vLLM's ``top_k``, ``min_p``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``ignore_eos``, ``min_tokens``,
``repetition_penalty`` and ``return_token_ids``; the last adds each choice's ``token_ids``
(every generated token, a final EOS or stop token included) and the prompt's ids where
vLLM puts them (``choices[0].prompt_token_ids`` for completions, top-level
``prompt_token_ids`` for chat). Each choice also has vLLM's ``stop_reason`` (the stop
string or token id that ended it; None for EOS and length) and, asked with vLLM's
``return_weight_versions`` (from 0.33), ``weight_versions``: the weights label of each
span of tokens. ``token_ids[i]`` and the i-th logprob are one token.

Where this departs from vLLM, and why:

- Logprobs are the chosen token's only (the engine computes no alternatives), of the
  distribution sampled from, ``log_softmax(logits / T)`` (what the trainer recomputes;
  vLLM reports the raw model's). Completions take ``logprobs`` 0 or 1 and list the chosen
  token alone in ``top_logprobs``; chat takes ``top_logprobs`` 0 and answers ``[]``.
- One prompt, one choice (``n`` 1) per request. Streaming (``stream: true``), echo,
  suffix, tools, response formats, penalties, prompt logprobs, and any key this server
  does not know, are each a 400 naming the key (vLLM ignores unknown keys; here no
  setting is silently dropped).
- ``model`` is not checked (one model is served); responses name it as it was at start.
- ``max_tokens`` defaults to 16 for completions (OpenAI's), to the room left in the
  context for chat; one that does not fit, or a prompt that fills the context, is a 400.
- Chat: the model's chat template renders the messages with the generation prompt; a
  content is a string or text parts (joined with newlines, as vLLM does); other message
  fields (``name``...) are dropped; ``tool_calls`` are a 400.

Why one file: OpenAI's completion and chat APIs in both directions, as data: the keys a
request may hold and the shape of the answer are checked against one specification and
change together; the HTTP side is ``asyncrl.serving.openai_api``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from itertools import accumulate
from typing import Any

from asyncrl.serving.serve_engine import EngineServer
from asyncrl.serving.serve_protocol import BadRequest, GenerateInput, WrongType, parse_generate


class InvalidRequest(BadRequest):
    """A client error whose ``param`` names the request key at fault; ``schema``: one
    vLLM's request schema refuses (a wrong JSON type, a body that is not JSON)."""

    def __init__(self, message: str, param: str | None = None, schema: bool = False) -> None:
        super().__init__(message)
        self.param, self.schema = param, schema


def error_body(
    message: str, status: int = 400, param: str | None = None, schema: bool = False
) -> dict:
    """OpenAI's error object, with vLLM's ``type`` names (the ``openai`` client raises
    ``openai.BadRequestError`` for a 400): ``Bad Request`` and ``body.KEY`` for what its
    request schema refuses, else ``BadRequestError``, ``ServiceUnavailableError``, ..."""
    if schema:
        param = f"body.{param}" if param else "body"
        return {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}
    kind = HTTPStatus(status).phrase.title().replace(" ", "")  # "BadRequest"
    kind = kind if kind.endswith("Error") else kind + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# ---- requests ----------------------------------------------------------------------------
# Request keys the engine samples with, and the sglang sampling_params key each becomes:
# serve_protocol validates them (and accepts the unimplemented ones at neutral values).
_SAMPLING_KEYS = {
    **{"max_tokens": "max_new_tokens", "seed": "sampling_seed", "min_tokens": "min_new_tokens"},
    "include_stop_str_in_output": "no_stop_trim",
    **{k: k for k in ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "min_p")},
    **{k: k for k in ("skip_special_tokens", "spaces_between_special_tokens", "ignore_eos")},
    **{k: k for k in ("frequency_penalty", "presence_penalty", "repetition_penalty")},
    "logit_bias": "logit_bias",
}
MAX_N = 64
"""Most samples (``n``) one completion request may ask for."""
# Features accepted only at the value that asks for nothing (or null).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "stream": (False,),
    "stream_options": (),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "response_format": ({"type": "text"},),
}
_WHY = {
    "stream": "streaming is not supported: send stream=false",
    "tools": "tool calling is not supported: describe the tools in the messages and parse "
    "the reply's text",
}
# Keys that change nothing here.
_IGNORED = {"model", "user", "store", "metadata", "service_tier", "parallel_tool_calls"}
_COMMON_KEYS = {*_SAMPLING_KEYS, *_NEUTRAL, *_IGNORED, "logprobs", "return_token_ids"}
COMPLETION_KEYS = frozenset(_COMMON_KEYS | {"prompt", "return_weight_versions"})
CHAT_KEYS = frozenset(_COMMON_KEYS | {"messages", "max_completion_tokens", "top_logprobs"})


@dataclass
class OpenAIRequest:
    """A validated request: what the engine runs, and what the response should hold."""

    generate: GenerateInput
    logprobs: bool
    return_token_ids: bool
    weight_versions: bool = False
    """vLLM's ``return_weight_versions`` (0.33 on): each choice's version spans."""
    n: int = 1
    """Samples of the prompt, one choice each (completions only)."""

    def samples(self) -> list[GenerateInput]:
        """What the engine runs: ``n`` requests of the prompt, their rids ``RID-i`` and a
        seed each (the given one plus ``i``), as vLLM derives its choices'."""
        if self.n == 1:
            return [self.generate]
        out = []
        for i in range(self.n):
            seed = self.generate.params.seed
            params = replace(self.generate.params, seed=None if seed is None else seed + i)
            out.append(replace(self.generate, rid=f"{self.generate.rid}-{i}", params=params))
        return out


def check_keys(body: dict, keys: Collection[str], endpoint: str) -> None:
    """Every key known to ``endpoint``, and every unsupported feature left off."""
    for key, value in body.items():
        if key not in keys:
            raise InvalidRequest(f"{key} is not a parameter of {endpoint} here", key)
        if key in _NEUTRAL and value is not None and value not in _NEUTRAL[key]:
            why = _WHY.get(key, f"{key}={value!r:.80} is not supported by this server")
            raise InvalidRequest(why, key)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"{key} must be true or false, got {value!r:.80}", key)
    return bool(value)


def _content(content: Any, index: int) -> str:
    """A message's content as text: a string, or text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "\n".join(p["text"] for p in content)
    why = f"messages[{index}].content must be a string or a list of text parts"
    raise InvalidRequest(f"{why}, got {content!r:.80}", "messages")


def chat_messages(body: dict) -> list[dict[str, str]]:
    """A chat request's keys checked and its messages as ``{"role", "content"}`` dicts."""
    check_keys(body, CHAT_KEYS, "/v1/chat/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of messages", "messages")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a role", "messages")
        if message.get("tool_calls"):
            raise InvalidRequest(f"messages[{i}].tool_calls: {_WHY['tools']}", "messages")
        turns.append({"role": message["role"], "content": _content(message.get("content"), i)})
    return turns


def _renamed(exc: BadRequest, names: dict[str, str]) -> InvalidRequest:
    """serve_protocol's error with sglang's field names made the request's keys; the
    first one found is the error's ``param``. Longest first: ``stop_token_ids`` before
    ``stop``."""
    param, message = None, str(exc)
    for name in sorted(names, key=len, reverse=True):
        if name in message:
            param = param or names[name]
            message = message.replace(name, names[name])
    return InvalidRequest(message, param, isinstance(exc, WrongType))


def _generate_input(
    body: dict, prompt_ids: list[int], prompt_key: str, server: EngineServer, rid: str
) -> GenerateInput:
    """The sglang request ``body`` means, validated by ``parse_generate``."""
    sampling = {_SAMPLING_KEYS[k]: v for k, v in body.items() if k in _SAMPLING_KEYS}
    names = {f"sampling_params.{_SAMPLING_KEYS[k]}": k for k in body if k in _SAMPLING_KEYS}
    names.setdefault("sampling_params.max_new_tokens", "max_tokens")
    if body.get("max_completion_tokens") is not None:  # chat's newer name wins, as in vLLM
        sampling["max_new_tokens"] = body["max_completion_tokens"]
        names["sampling_params.max_new_tokens"] = "max_completion_tokens"
    if prompt_key == "prompt":  # OpenAI's default; chat's (null) is the room left
        sampling.setdefault("max_new_tokens", 16)
    sampling.setdefault("max_new_tokens", None)
    if sampling.get("top_k") == 0:  # vLLM's "all tokens" is 0 or -1, sglang's -1
        sampling["top_k"] = -1
    request = {"input_ids": prompt_ids, "sampling_params": sampling, "rid": rid}
    limits = {"vocab_size": server.vocab_size, "max_seq_len": server.engine.max_seq_len}
    try:
        return parse_generate(request, encode=server.tokenizer.encode, **limits)
    except BadRequest as exc:
        raise _renamed(exc, {**names, "input_ids": prompt_key}) from None


def parse_completion(body: dict, server: EngineServer) -> OpenAIRequest:
    """Validate a ``/v1/completions`` body; raises ``InvalidRequest``."""
    n = body.get("n") if body.get("n") is not None else 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be an integer in [1, {MAX_N}], got {n!r:.80}", "n")
    check_keys({k: v for k, v in body.items() if k != "n"}, COMPLETION_KEYS, "/v1/completions")
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        prompt_ids = server.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list):
        prompt_ids = prompt  # token ids, checked by parse_generate
    else:
        why = "a non-empty string or list of token ids (one prompt per request)"
        raise InvalidRequest(f"prompt must be {why}, got {prompt!r:.80}", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and (logprobs not in (0, 1) or isinstance(logprobs, bool)):
        why = "0 or 1 (the chosen token's logprob; alternatives are not computed)"
        raise InvalidRequest(f"logprobs must be {why}, got {logprobs!r:.80}", "logprobs")
    generate = _generate_input(body, prompt_ids, "prompt", server, f"cmpl-{uuid.uuid4().hex}")
    return OpenAIRequest(
        generate,
        logprobs is not None,
        _flag(body, "return_token_ids"),
        _flag(body, "return_weight_versions"),
        n,
    )


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The messages rendered by the tokenizer's chat template, with the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        why = "the served model's tokenizer has no chat template: use /v1/completions"
        raise InvalidRequest(why, "messages")
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:  # the template's own raise_exception, or a Jinja error
        raise InvalidRequest(f"messages: the chat template failed: {exc}", "messages") from None
    return list(ids)


def parse_chat(body: dict, server: EngineServer) -> OpenAIRequest:
    """Validate a ``/v1/chat/completions`` body; raises ``InvalidRequest``."""
    prompt_ids = chat_prompt_ids(server.tokenizer, chat_messages(body))
    if body.get("top_logprobs") not in (None, 0):
        raise InvalidRequest(
            "top_logprobs must be 0: alternatives to the chosen token are not computed",
            "top_logprobs",
        )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    generate = _generate_input(body, prompt_ids, "messages", server, rid)
    return OpenAIRequest(generate, _flag(body, "logprobs"), _flag(body, "return_token_ids"))


# ---- responses ---------------------------------------------------------------------------
@dataclass
class Completion:
    """One finished generation, as the response bodies show it. ``token_ids``,
    ``logprobs``, ``token_texts`` and ``versions`` line up, one entry per generated
    token; the agent capture server knows only ``text`` and leaves them empty."""

    id: str
    """The response's id: "cmpl-..." or "chatcmpl-..." (the engine request's rid)."""
    text: str
    """The completion's text: special tokens skipped, cut at a stop string."""
    finish_reason: str = "stop"
    """"stop" (EOS, a stop token or string), "length", or "abort"."""
    stop_reason: int | str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    """Each token decoded alone (filled only when logprobs are asked for)."""
    versions: list[str] = field(default_factory=list)


def _choice(c: Completion, return_token_ids: bool, **fields: Any) -> dict[str, Any]:
    choice = {"index": 0, **fields, "finish_reason": c.finish_reason}
    choice["stop_reason"] = c.stop_reason
    if return_token_ids:
        choice["token_ids"] = c.token_ids
    return choice


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """vLLM's ``weight_versions``: ``{"version", "start", "end"}`` per run of tokens
    (half-open) sampled by weights of one label."""
    spans: list[dict[str, Any]] = []
    for i, label in enumerate(versions):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


def _response(
    kind: str, c: Completion, model: str, choices: list[dict], generated: int | None = None
) -> dict[str, Any]:
    """The body around ``choices``; ``generated``: their tokens, ``c``'s when None."""
    completion = len(c.token_ids) if generated is None else generated
    usage = {"prompt_tokens": len(c.prompt_ids), "completion_tokens": completion}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    body = {"id": c.id, "object": kind, "created": int(time.time()), "model": model}
    return {**body, "choices": choices, "usage": usage}


def completion_body(
    c: Completion | list[Completion],
    model: str,
    *,
    logprobs: bool = False,
    return_token_ids: bool = False,
    weight_versions: bool = False,
) -> dict[str, Any]:
    """A ``/v1/completions`` response (``object: "text_completion"``): one choice per
    completion, in order (``index``), under the first one's id."""
    cs = c if isinstance(c, list) else [c]
    options = {"logprobs": logprobs, "return_token_ids": return_token_ids}
    choices = [_completion_choice(one, i, weight_versions, **options) for i, one in enumerate(cs)]
    generated = sum(len(one.token_ids) for one in cs)
    return _response("text_completion", cs[0], model, choices, generated)


def _completion_choice(
    c: Completion, index: int, weight_versions: bool, logprobs: bool, return_token_ids: bool
) -> dict[str, Any]:
    choice = _choice(c, return_token_ids, text=c.text, logprobs=None)
    choice["index"] = index
    if weight_versions:
        choice["weight_versions"] = version_spans(c.versions)
    if logprobs:
        choice["logprobs"] = {
            "text_offset": list(accumulate(map(len, c.token_texts), initial=0))[:-1],
            "token_logprobs": c.logprobs,
            "tokens": c.token_texts,
            "top_logprobs": [{t: lp} for t, lp in zip(c.token_texts, c.logprobs)],
        }
    if return_token_ids:
        choice["prompt_token_ids"] = c.prompt_ids  # vLLM puts it in the choice here
    return choice


def chat_completion_body(
    c: Completion, model: str, *, logprobs: bool = False, return_token_ids: bool = False
) -> dict[str, Any]:
    """A ``/v1/chat/completions`` response (``object: "chat.completion"``)."""
    message = {"role": "assistant", "content": c.text}
    choice = _choice(c, return_token_ids, message=message, logprobs=None)
    if logprobs:
        content = [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(c.token_texts, c.logprobs)
        ]
        choice["logprobs"] = {"content": content}
    body = _response("chat.completion", c, model, [choice])
    if return_token_ids:
        body["prompt_token_ids"] = c.prompt_ids  # and at the top level here
    return body


def models_body(model: str, max_model_len: int | None = None) -> dict[str, Any]:
    """``/v1/models``: the one model served."""
    card = {"id": model, "object": "model", "created": int(time.time()), "owned_by": "asyncrl"}
    return {"object": "list", "data": [{**card, "root": model, "max_model_len": max_model_len}]}
