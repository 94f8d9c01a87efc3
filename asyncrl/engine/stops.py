"""Stop strings and stop token ids: where generation ends and where its text is cut.

The semantics follow vLLM and sglang:

- A request ends (finish reason ``stop``) at a stop token id, or at the first token whose
  decoded completion (special tokens skipped) contains a stop string. That token stays in
  the completion's token ids like every other sampled token: the trainer trains on all of
  them, as sglang's ``output_ids`` and vLLM's ``token_ids`` include it.
- The completion's text (what a reward or an evaluation reads) is cut right before the
  first stop string, or right after it with ``keep`` (vLLM's ``include_stop_str_in_output``,
  sglang's ``no_stop_trim``). A final stop token id is left out of the text unless ``keep``;
  special tokens never show, since the text skips them (vLLM's default).
- When several stop strings are present, the one that starts first wins (the longest at
  equal starts); empty stop strings are ignored.

Who uses it: the embedded engine (``StopChecker``, one per engine, checks each new token of
the requests that have stop strings), asyncrl's sglang-compatible front
(``asyncrl.serving.serve_protocol``, which trims ``text`` with ``trim_at_stop``), and the
buffer's scoring and evaluation (``text_until_stop``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from asyncrl.engine.base import FinishReason, SamplingParams
from asyncrl.models import load_tokenizer

WINDOW_SLACK = 4
"""Tokens decoded before the bytes a stop string can span. A token decodes to at least one
byte (byte-level BPE, SentencePiece's byte fallback), so the last ``len(stop in UTF-8)``
tokens hold the whole string once it completes; the slack adds the token before it, so a
decoder that drops the leading space of a text's first token, or a partial character at
the window's start, never touches the string, and covers a few skipped special tokens."""


def find_stop(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """``(start, stop string)`` of the first stop string in ``text`` (the longest of those
    that start there); None when there is none."""
    best: tuple[int, str] | None = None
    for s in stop:
        start = text.find(s) if s else -1
        if start >= 0 and (best is None or (start, -len(s)) < (best[0], -len(best[1]))):
            best = (start, s)
    return best


def trim_at_stop(text: str, stop: Sequence[str], keep: bool) -> tuple[str, str | None]:
    """``text`` cut right before its first stop string (right after it with ``keep``), and
    that string; ``text`` unchanged and None when it holds none."""
    found = find_stop(text, stop)
    if found is None:
        return text, None
    start, matched = found
    return text[: start + len(matched) if keep else start], matched


def text_until_stop(
    decode: Callable[[list[int]], str],
    ids: list[int],
    stop: Sequence[str],
    stop_token_ids: Collection[int],
    keep: bool,
) -> str:
    """The text of completion ``ids`` that a reward reads: a final stop token id dropped
    unless ``keep``, ``decode``d (the caller's decode: skipping special tokens, and dropping
    a final EOS where it does), then cut at the first stop string (``trim_at_stop``)."""
    if not keep and ids and ids[-1] in stop_token_ids:
        ids = ids[:-1]
    return trim_at_stop(decode(ids), stop, keep)[0]


class StopChecker:
    """Decides whether a request's newest token ends it: EOS, a stop token id, or a stop
    string completed by that token. Stop strings are found by decoding only the tail of the
    completion (``WINDOW_SLACK``), so a check costs the same at any length; the tokenizer is
    loaded at the first stop string, so engines whose requests have none never load it."""

    def __init__(self, tokenizer_path: str) -> None:
        self.tokenizer_path = tokenizer_path
        self._tokenizer = None

    def check(
        self, tokens: list[int], generated: int, params: SamplingParams, eos_ids: Collection[int]
    ) -> tuple[FinishReason | None, str | None]:
        """The finish reason the last of ``tokens`` gives its request (None: it goes on),
        and the stop string it completed. ``tokens[-generated:]`` is the completion so far."""
        token = tokens[-1]
        if token in eos_ids:
            return "eos", None
        if token in params.stop_token_ids:
            return "stop", None
        if params.stop:
            matched = self.matched(tokens, generated, params.stop)
            if matched is not None:
                return "stop", matched
        return None, None

    def matched(self, tokens: list[int], generated: int, stop: Sequence[str]) -> str | None:
        """The stop string in the decoded tail of the completion ``tokens[-generated:]``;
        checked after every token, so a string found here is one the last token completed."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        window = max(len(s.encode()) for s in stop) + WINDOW_SLACK
        tail = tokens[len(tokens) - min(window, generated) :]
        found = find_stop(self._tokenizer.decode(tail, skip_special_tokens=True), stop)
        return None if found is None else found[1]
