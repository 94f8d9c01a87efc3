"""sglang's native ``/generate`` response (0.5.x), as ``asyncrl.serving.serve`` gives it:
a request's progress (``Generation``) as sglang's cumulative response object, and its
``finish_reason`` (``finish_reason_json``). The request side is
``asyncrl.serving.serve_protocol``.

Checked against sglang's source (0.5.x): the response building in
``TokenizerManager._handle_batch_output`` and the finish reasons' ``to_json`` in
``python/sglang/srt/managers/schedule_batch.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from asyncrl.engine.base import FinishReason
from asyncrl.engine.stops import trim_at_stop
from asyncrl.serving.serve_protocol import GenerateInput


def finish_reason_json(
    reason: FinishReason,
    matched: int | str | None,
    num_tokens: int,
    message: str = "",
    status_code: int | None = None,
) -> dict[str, Any]:
    """sglang's ``finish_reason``. EOS and stop tokens both read ``{"type": "stop",
    "matched": token_id}`` (sglang treats EOS as a stop token), a stop string ``{"type":
    "stop", "matched": string}``; an abort carries an HTTP ``status_code`` only when the
    server made it for an error."""
    if reason in ("eos", "stop"):
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": num_tokens}
    return {
        "type": "abort",
        "message": message or "Aborted",
        "status_code": status_code,
        "err_type": None if status_code is None else HTTPStatus(status_code).phrase,
    }


@dataclass
class Generation:
    """A request's output so far. ``output_ids``, ``logprobs`` and ``versions`` line up
    one entry per generated token; ``versions`` holds weight-version labels."""

    input: GenerateInput
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    created: float = field(default_factory=time.monotonic)

    def response(self, decode: Callable[[list[int], bool], str], weight_version: str) -> dict:
        """The cumulative response object; ``weight_version`` is the label of the
        latest token's weights (``weight_version`` itself before the first token)."""
        finish, keep = self.finish_reason, self.input.no_stop_trim
        matched = finish.get("matched") if finish and finish["type"] == "stop" else None
        text_ids = self.output_ids
        if isinstance(matched, int) and not keep:
            text_ids = text_ids[:-1]  # sglang drops the matched stop token from the text
        text = decode(text_ids, self.input.skip_special_tokens)
        if isinstance(matched, str):  # and cuts the text at a matched stop string
            text = trim_at_stop(text, [matched], keep)[0]
        meta: dict[str, Any] = {
            "id": self.input.rid,
            "finish_reason": finish,
            "prompt_tokens": len(self.input.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": self.versions[-1] if self.versions else weight_version,
            "output_token_versions": list(self.versions),  # asyncrl extension
        }
        if self.input.return_logprob:
            texts = [None] * len(self.output_ids)
            if self.input.return_text_in_logprobs:
                texts = [decode([t], False) for t in self.output_ids]
            meta["output_token_logprobs"] = [
                [lp, t, s] for lp, t, s in zip(self.logprobs, self.output_ids, texts)
            ]
        if finish is not None:
            meta["e2e_latency"] = time.monotonic() - self.created
        return {
            "text": text,
            "output_ids": list(self.output_ids),
            "meta_info": meta,
        }
