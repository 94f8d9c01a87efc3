"""The check after a flip (``transport.weights.probe_text``): does each engine decode with
the weights the trainer published?

Both sides score the same fixed token sequence, the probe text as the policy's tokenizer
encodes it. A generator scores it with the weights it has just flipped in
(``ProbeScorer.score``, between two decode steps) and pushes a ``ProbeReport`` to
trainer rank 0 (``FlipProbe``); every trainer rank scores it with each version it
publishes (a forward of the sharded policy, which the ranks run together), and rank 0
compares each report with its own logprobs of that version (``TrainerProbe``,
``asyncrl.trainer.probe``). The
largest absolute difference is logged; one above ``probe_alarm`` is an alarm, logged as
an error and counted, and with ``probe_stop`` it ends the run. Reports travel on a PULL
socket of their own (``RUN_DIR/endpoints/probe.json``), so the weights path is the same
with the probe on or off.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import zmq

from asyncrl.interfaces import ProbeScorer
from asyncrl.logprobs import token_logprobs
from asyncrl.models import load_tokenizer
from asyncrl.transport import RunSite, client_socket, read_endpoints
from asyncrl.wire import ProbeReport, encode

log = logging.getLogger(__name__)


def probe_tokens(model_path: str, text: str) -> list[int]:
    """The probe as token ids (no special tokens: the same ids on every side)."""
    ids = load_tokenizer(model_path)(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise ValueError(
            f"transport.weights.probe_text encodes to {len(ids)} token(s); the probe scores "
            f"each token after the first, so it needs at least 2"
        )
    return ids


@torch.no_grad()
def policy_logprobs(model: torch.nn.Module, tokens: list[int], device) -> torch.Tensor:
    """``[len(tokens) - 1]`` logprobs (temperature 1) of ``tokens[1:]`` under ``model``;
    a sharded model needs every rank to call it."""
    ids = torch.tensor([tokens], device=device)
    return token_logprobs(model(input_ids=ids, use_cache=False).logits, ids)[0, 1:].cpu()


class FlipProbe:
    """A generator's side: after each flip, the probe scored with the new weights and
    pushed to trainer rank 0. Call ``after_step`` from the loop that steps the engine."""

    def __init__(
        self,
        site: RunSite,
        model_path: str,
        worker_id: str,
        engine: ProbeScorer,
        ctx: zmq.Context,
        lineage: Callable[[], str],
    ) -> None:
        if not isinstance(engine, ProbeScorer):
            raise ValueError(
                "transport.weights.probe_text: this engine cannot score a token sequence "
                "(the probe needs engine.backend=embedded)"
            )
        self.site, self.worker_id, self.engine, self.ctx = site, worker_id, engine, ctx
        self.lineage = lineage  # of the weights the engine was last offered
        self.tokens = probe_tokens(model_path, site.transport.weights.probe_text)
        self.scored = -1  # the version scored last
        self.push: zmq.Socket | None = None
        self.endpoint = ""
        self.sent = 0

    def after_step(self, version: int) -> None:
        """Score and report when the engine's version (``version``) is new."""
        if version == self.scored or version == 0:  # version 0: the weights on disk
            return
        self.scored = version
        version, logprobs = self.engine.score(self.tokens)
        report = ProbeReport(
            run_id=self.site.run_id,
            worker_id=self.worker_id,
            version=version,
            lineage=self.lineage(),
            logprobs=logprobs,
        )
        sock = self._socket()
        if sock is not None:
            # A trainer restarting drops it: the next flip reports again.
            with contextlib.suppress(zmq.Again):
                sock.send(encode(report), zmq.NOBLOCK)
                self.sent += 1

    def _socket(self) -> zmq.Socket | None:
        """A PUSH socket to the trainer's probe endpoint, connected anew when it moved."""
        endpoints = read_endpoints(self.site.run_dir, "probe", timeout_s=0.0)
        if endpoints is None:
            return None
        if endpoints["reports"] != self.endpoint:
            self.close()
            t = self.site.transport
            self.push = client_socket(self.ctx, zmq.PUSH, t, self.site.run_dir)
            self.push.connect(endpoints["reports"])
            self.endpoint = endpoints["reports"]
        return self.push

    def close(self) -> None:
        if self.push is not None:
            self.push.close(linger=0)
            self.push = None
