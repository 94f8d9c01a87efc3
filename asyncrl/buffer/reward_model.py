"""Reward-model scoring for the buffer: a learned reward as a reward source beside the
task's verifier (``RewardConfig.source``; the buffer's ``Scoring`` combines the two).

A reward model is an HF directory that ``load_model(ModelConfig(path, head="value"))``
loads: the policy's backbone with a scalar head, logits ``[rows, T, 1]``. The score of a
token sequence (prompt ids + completion ids, the completion ending with EOS when
generation did) is the head's output at its last token, under plain causal attention
over that sequence alone; the RM stage trains on exactly this definition.

``RewardModelScorer`` owns the model and one background thread that takes up to
``batch_size`` queued sequences per forward, so the buffer's event loop only submits and
polls and never waits on a forward. Every submitted key comes out of ``poll`` exactly
once: with its score, or with 0.0 when the forward of its batch raised (counted).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Hashable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.models import ModelConfig, forward_padded, load_model

log = logging.getLogger(__name__)


def completion_text(tokenizer: PreTrainedTokenizerBase, completion: list[int]) -> str:
    """The text of generated ``completion`` ids: the final EOS dropped, special tokens
    skipped. What the verifier scores, and what preference data stores for the RM stage
    (which re-tokenizes it and appends EOS), so both see the same decode."""
    eos = tokenizer.eos_token_id
    ids = completion[:-1] if completion and completion[-1] == eos else completion
    return tokenizer.decode(ids, skip_special_tokens=True)


@torch.no_grad()
def score_sequences(model: PreTrainedModel, sequences: list[list[int]], pad_id: int) -> list[float]:
    """The RM score of each sequence: ``logits[i, len_i - 1, 0]`` of a value-head model.

    One right-padded batch (``forward_padded``): each row is scored as it would be alone."""
    if not sequences:
        return []
    if any(not ids for ids in sequences):
        raise ValueError("cannot score an empty sequence")
    logits, _ = forward_padded(model, sequences, pad_id)  # [rows, T_max, 1]
    device, rows = logits.device, len(sequences)
    last = torch.tensor([len(ids) - 1 for ids in sequences], device=device)
    return logits[torch.arange(rows, device=device), last, 0].float().tolist()


class RewardModelScorer:
    """Scores token sequences with a reward model in a background thread (see the module
    docstring): ``submit``, ``poll``, ``pending``, ``counters``, ``close``.

    ``submit``/``poll`` may be called from one thread (the buffer's event loop) while the
    scoring thread runs forwards; a lock guards the queue and the results."""

    def __init__(self, model_path: str, batch_size: int = 64, threads: int = 1) -> None:
        if batch_size < 1 or threads < 0:
            raise ValueError(
                f"RewardModelScorer needs batch_size >= 1 and threads >= 0, "
                f"got {batch_size} and {threads}"
            )
        # On the CPU: the buffer process holds no accelerator of its own.
        self.model = load_model(ModelConfig(path=model_path, head="value")).eval()
        pad = self.model.config.pad_token_id
        self.pad_id = 0 if pad is None else int(pad)  # any id: padding is never attended
        self.batch_size, self.threads = batch_size, threads
        self._cond = threading.Condition()
        self._queue: deque[tuple[Hashable, list[int]]] = deque()
        self._results: list[tuple[Hashable, float]] = []
        self._outstanding = 0  # submitted and not yet returned by poll
        self._counts = {"scored": 0, "batches": 0, "errors": 0}
        self._error_logged = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="reward-model", daemon=True)
        self._thread.start()

    def submit(self, key: Hashable, ids: list[int]) -> None:
        """Queue ``ids`` (prompt + completion token ids); its score comes out of ``poll``
        under ``key``."""
        with self._cond:
            self._queue.append((key, list(ids)))
            self._outstanding += 1
            self._cond.notify()

    def poll(self) -> list[tuple[Hashable, float]]:
        """(key, score) of the items finished since the last call, in any order; never
        waits for a forward."""
        with self._cond:
            results, self._results = self._results, []
            self._outstanding -= len(results)
        return results

    def pending(self) -> int:
        """Submitted items that ``poll`` has not yet returned."""
        with self._cond:
            return self._outstanding

    def counters(self) -> dict[str, int]:
        """Items finished as "scored" or "errors" (each item in exactly one), and
        "batches": forwards run."""
        with self._cond:
            return dict(self._counts)

    def close(self) -> None:
        """Stop the thread once its current forward ends; queued items are dropped."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        # torch.set_num_threads is documented as process-wide, but with torch's OpenMP
        # backend (the default CPU build) it sets the calling thread's own intra-op count:
        # called here it limits this thread's forwards and leaves the threads of whoever
        # else shares the process (the colocated trainer) alone. 0 leaves torch's default.
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._queue))
                if self._closed:
                    return
                n = min(self.batch_size, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
            try:
                scores: list[float | None] = list(
                    score_sequences(self.model, [ids for _, ids in batch], self.pad_id)
                )
            except Exception:
                # A failed forward must not lose its keys, or their groups never complete:
                # each gets 0.0. Logged loudly once, then counted.
                self._log_error(f"reward-model forward failed on {n} sequences", exc_info=True)
                scores = [None] * n
            # A non-finite score would poison the group's advantages: 0.0, counted.
            bad = sum(1 for s in scores if s is None or not math.isfinite(s))
            if bad and all(s is not None for s in scores):
                self._log_error(f"reward model gave {bad} non-finite scores")
            with self._cond:
                for (key, _), s in zip(batch, scores):
                    self._results.append((key, s if s is not None and math.isfinite(s) else 0.0))
                self._counts["scored"] += n - bad
                self._counts["errors"] += bad
                self._counts["batches"] += 1

    def _log_error(self, message: str, exc_info: bool = False) -> None:
        level = logging.DEBUG if self._error_logged else logging.ERROR
        log.log(level, message, exc_info=exc_info)
        self._error_logged = True
