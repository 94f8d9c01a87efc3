"""A reward server: a process of its own (``reward_K``) that scores sequences with the run's
reward model for the buffer, so that a reward which costs compute takes slots of its own
and grows or shrinks with the run (``RewardConfig.model_servers``; the launcher's pool of
``RUN_DIR/control/rewards``; the elastic controller).

It connects a DEALER to the buffer's reward socket (``RUN_DIR/endpoints/rewards.json``,
bound by ``asyncrl.buffer.reward_dispatch``) and loops: ask for a batch (``ScoreAsk``,
again every ``ASK_EVERY_S`` while none comes), score it as the in-process scorer does
(``asyncrl.buffer.reward_model.score_sequences``, the same definition the RM stage trains
on), answer (``ScoreResult``). Stopped (SIGTERM) or drained (SIGUSR1) it finishes the
batch in hand, answers it, and says ``Leaving``, so the buffer sends nothing more and
gives whatever it still held to another server; drained, it exits with ``EXIT_DRAINED``,
which the launcher does not restart. Killed, its batch goes to another server when the
launcher's restart asks again (a new incarnation) or after ``model_timeout_s``.

    python -m asyncrl.buffer.reward_server --config RUN_DIR/rollout.json --worker-id r0
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading
import time

import torch
import zmq

from asyncrl.buffer.config import RolloutConfig
from asyncrl.buffer.reward_model import score_sequences
from asyncrl.config import load_json
from asyncrl.liveness import EXIT_DRAINED, AliveMark
from asyncrl.models import ModelConfig, load_model
from asyncrl.transport import client_socket, close_context, read_endpoints
from asyncrl.wire import Leaving, ScoreAsk, ScoreJob, ScoreResult, WireDecoder, encode
from asyncrl.wire.rewards import ASK_EVERY_S

log = logging.getLogger(__name__)


class RewardServer:
    def __init__(self, cfg: RolloutConfig, worker_id: str) -> None:
        self.cfg, self.worker_id = cfg, worker_id
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        if cfg.reward.model_threads > 0:
            torch.set_num_threads(cfg.reward.model_threads)
        self.model = load_model(ModelConfig(path=cfg.reward.model_path, head="value")).eval()
        pad = self.model.config.pad_token_id
        self.pad_id = 0 if pad is None else int(pad)  # any id: padding is never attended
        endpoints = read_endpoints(cfg.run_dir, "rewards")
        if endpoints is None:
            raise RuntimeError(f"the buffer's reward socket never appeared in {cfg.run_dir}")
        self.ctx = zmq.Context()
        self.sock = client_socket(self.ctx, zmq.DEALER, cfg.transport, cfg.run_dir, worker_id)
        self.sock.connect(endpoints["jobs"])
        self.decoder = WireDecoder(cfg.run_id)
        self.stop_event = threading.Event()
        self.drain_event = threading.Event()
        self.scored = 0

    def run(self) -> None:
        alive, last_ask = AliveMark(), float("-inf")
        try:
            while not (self.stop_event.is_set() or self.drain_event.is_set()):
                now = time.monotonic()
                alive.touch(now)
                if now - last_ask >= ASK_EVERY_S:
                    self._send(
                        ScoreAsk(
                            run_id=self.cfg.run_id,
                            worker_id=self.worker_id,
                            incarnation=self.incarnation,
                        )
                    )
                    last_ask = now
                if not self.sock.poll(200):
                    continue
                message = self.decoder.try_decode(self.sock.recv(), "reward jobs")
                if isinstance(message, ScoreJob):
                    self._send(self._score(message))
                    last_ask = float("-inf")  # free again: ask at once
                elif message is not None:
                    self.decoder.count("unexpected", f"reward jobs: {type(message).__name__}")
            # Whatever the buffer sent after the last answer goes to another server.
            self._send(
                Leaving(
                    run_id=self.cfg.run_id, worker_id=self.worker_id, incarnation=self.incarnation
                )
            )
            time.sleep(0.2)  # let the message leave before the socket closes
        finally:
            self.sock.close(linger=1000)
            close_context(self.ctx)
        log.info("reward server %s: %d sequences scored", self.worker_id, self.scored)

    def stop(self) -> None:
        self.stop_event.set()

    def drain(self) -> None:
        self.drain_event.set()

    def _score(self, job: ScoreJob) -> ScoreResult:
        start = time.perf_counter()
        try:
            scores: list[float | None] = list(
                score_sequences(self.model, job.sequences, self.pad_id)
            )
        except Exception:
            log.exception("reward model forward failed on %d sequences", len(job.sequences))
            scores = [None] * len(job.sequences)
        scores = [s if s is not None and math.isfinite(s) else None for s in scores]
        self.scored += len(scores)
        return ScoreResult(
            run_id=self.cfg.run_id,
            worker_id=self.worker_id,
            job_id=job.job_id,
            scores=scores,
            seconds=time.perf_counter() - start,
        )

    def _send(self, message) -> None:
        self.sock.send(encode(message))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run one reward server.")
    parser.add_argument("--config", required=True, help="RolloutConfig JSON")
    parser.add_argument("--worker-id", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg: RolloutConfig = load_json(args.config)
    server = RewardServer(cfg, args.worker_id)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    signal.signal(signal.SIGUSR1, lambda *_: server.drain())
    server.run()
    if server.drain_event.is_set() and not server.stop_event.is_set():
        raise SystemExit(EXIT_DRAINED)  # it left on purpose: the launcher lets it go


if __name__ == "__main__":
    main()
