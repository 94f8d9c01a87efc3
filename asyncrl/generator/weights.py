"""A generator's weights thread: receives each version the trainer publishes and offers
it to the engine's staging (``Engine.stage_weights``), never on the decode loop.

It subscribes to the trainer's weights PUB socket once the trainer has written its
endpoints, and again whenever they change (a restarted trainer binds anew). Two kinds of
update arrive there:

- ``WeightsBucket`` (embedded engines): buckets rebuilt into a mirror of the newest version
  (``asyncrl.weights.receiver``); when the mirror cannot go on (nothing yet, a missed
  delta, a bad checksum, a version stalled half-way) the thread asks the trainer for an
  anchor on its PULL socket, and again every ``ASK_EVERY_S`` while none has come.
- ``WeightsOnDisk`` (remote engines): a directory the engine's servers load.
- ``WeightsByTransfer`` (remote vLLM servers): weights the trainer sends into each server
  when the engine asks, through a ``TrainerPush`` (a REQ socket to the trainer's
  transfer endpoint), once it has paused and drained that server.

A new lineage (a trainer restarted from a checkpoint) is taken whatever its version; from
the same trainer, only newer versions.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import zmq

from asyncrl.background import yield_cpu
from asyncrl.buffer.config import RolloutConfig
from asyncrl.engine.base import PushFailed
from asyncrl.generator.stats import GeneratorStats
from asyncrl.interfaces import Engine
from asyncrl.transport import client_socket, read_endpoints
from asyncrl.weights.receiver import NeedAnchor, WeightsReceiver
from asyncrl.wire import (
    AnchorRequest,
    TransferAsk,
    TransferDone,
    WeightsBucket,
    WeightsByTransfer,
    WeightsOnDisk,
    WireDecoder,
    encode,
)

log = logging.getLogger(__name__)

ASK_EVERY_S = 5.0
"""How often a generator without usable weights asks again: a request sent before the
trainer's sockets knew of it, or an anchor dropped on the way, is not waited for forever."""


class WeightsIntake:
    def __init__(
        self,
        cfg: RolloutConfig,
        worker_id: str,
        engine: Engine,
        stats: GeneratorStats,
        ctx: zmq.Context,
        stop: threading.Event,
    ) -> None:
        self.cfg, self.worker_id, self.engine, self.stats = cfg, worker_id, engine, stats
        self.ctx, self.stop = ctx, stop
        self.decoder = WireDecoder(
            cfg.run_id, expected=WeightsBucket | WeightsOnDisk | WeightsByTransfer
        )
        self.receiver = WeightsReceiver(cfg.transport.weights.timeout_s)
        self.lineage = ""  # of the weights the engine runs
        self.anchors_asked = 0
        self.asked_at = 0.0
        self.arrived: float | None = None  # the stats clock when the current version began
        self.thread = threading.Thread(target=self._run, name="weights", daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout=timeout)

    def _run(self) -> None:
        # Rebuilding versions must not slow the decode loop. (The worker made its sockets
        # first, so the context's I/O threads do not inherit this priority.)
        yield_cpu()
        endpoint = None
        while not self.stop.is_set():
            endpoints = read_endpoints(self.cfg.run_dir, "trainer", timeout_s=1.0)
            if endpoints is None or endpoints["weights"] == endpoint:
                continue
            endpoint = endpoints["weights"]
            try:
                self._follow(endpoints)
            except Exception:  # never a silent end of updates: say it, subscribe again
                log.exception("the weights thread failed; subscribing again")
                endpoint = None
                time.sleep(1.0)

    def _follow(self, endpoints: dict[str, str]) -> None:
        """Receive from one trainer until its endpoints change or the generator stops."""
        t = self.cfg.transport
        sub = client_socket(
            self.ctx, zmq.SUB, t, self.cfg.run_dir, max_message_bytes=t.max_weights_bytes
        )
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        # Few buckets queue here (each up to bucket_mb): past that the trainer's side holds
        # them, and a generator too slow for them loses some and asks for an anchor.
        sub.setsockopt(zmq.RCVHWM, 8)
        sub.connect(endpoints["weights"])
        asks = None
        if "anchors" in endpoints:  # the bucket publisher: it answers anchor requests
            asks = client_socket(self.ctx, zmq.PUSH, t, self.cfg.run_dir)
            asks.connect(endpoints["anchors"])
        last_check = time.monotonic()
        try:
            while not self.stop.is_set():
                if sub.poll(200):
                    self._on_message(sub.recv_multipart(copy=False), asks)
                now = time.monotonic()
                if now - last_check > 2.0:
                    last_check = now
                    latest = read_endpoints(self.cfg.run_dir, "trainer", timeout_s=0.0)
                    if latest is not None and latest["weights"] != endpoints["weights"]:
                        return
                    if latest is not None and asks is not None:
                        # A trainer restarted on the same endpoints: its first anchor
                        # went out while this socket reconnected.
                        self.receiver.trainer_is(latest.get("lineage", ""))
                if asks is not None:
                    self._keep_asking(asks, now)
        finally:
            sub.close(linger=0)
            if asks is not None:
                asks.close(linger=0)

    def _keep_asking(self, asks: zmq.Socket, now: float) -> None:
        try:
            self.receiver.expire(now)
        except NeedAnchor as e:
            self._ask(asks, str(e))
        r = self.receiver  # an anchor on its way is left to arrive (or to expire)
        if r.waiting is not None and r.partial is None and now - self.asked_at > ASK_EVERY_S:
            self._ask(asks, r.waiting)

    def _ask(self, asks: zmq.Socket, why: str) -> None:
        if self.arrived is not None:
            self.stats.weights_dropped()
            self.arrived = None
        self.asked_at = time.monotonic()
        self.anchors_asked += 1
        log.info("asking for an anchor: %s", why)
        request = AnchorRequest(
            run_id=self.cfg.run_id, worker_id=self.worker_id, have=self.receiver.version, why=why
        )
        # No trainer connected (it restarts): the request is dropped, and made again later.
        with contextlib.suppress(zmq.Again):
            asks.send(encode(request), zmq.NOBLOCK)

    def _on_message(self, frames, asks: zmq.Socket | None) -> None:
        header = self.decoder.try_decode(frames[0].buffer, "weights socket")
        if header is None:
            return
        if isinstance(header, WeightsOnDisk):
            self._offer(header.path, header.version, header.lineage, self.stats.weights_arriving())
            return
        if isinstance(header, WeightsByTransfer):
            push = TrainerPush(self.cfg, self.worker_id, header, self.ctx, self.stop)
            self._offer(push, header.version, header.lineage, self.stats.weights_arriving())
            return
        if len(frames) != 2:
            self.decoder.count("frames", f"{len(frames) - 1} payload frames in a bucket")
            return
        if header.index == 0 and self.arrived is None:
            self.arrived = self.stats.weights_arriving()
        try:
            done = self.receiver.accept(header, frames[1].buffer)
        except NeedAnchor as e:
            self.decoder.count("frames", str(e))
            if asks is not None:
                self._ask(asks, str(e))
            return
        if done is not None:
            arrived, self.arrived = self.arrived, None
            self._offer(done[1], done[0], header.lineage, arrived or self.stats.weights_arriving())

    def _offer(self, weights, version: int, lineage: str, arrived: float) -> None:
        if lineage == self.lineage and version <= self.engine.status().version:
            self.stats.weights_dropped()  # an anchor sent again for another generator
            return
        try:
            self.engine.stage_weights(weights, version)
        except Exception as e:  # a bad update is counted and dropped, never fatal
            self.decoder.count("frames", str(e))
            self.stats.weights_dropped()
            return
        self.lineage = lineage
        self.stats.weights_offered(version, arrived)


class TrainerPush:
    """A ``WeightsPush``: asks trainer rank 0, on its transfer endpoint, to send the
    version it announced into one server (``asyncrl.trainer.publish_vllm``), and waits
    for its answer. Called on the engine's threads; each call has its own socket.

    The ask carries a deadline: the trainer starts no transfer past it, so an ask this
    side gave up on is never served later into a server that runs again. Giving up
    (no answer by then, or the generator stopping) counts as touched: the trainer may
    be sending still."""

    def __init__(
        self,
        cfg: RolloutConfig,
        worker_id: str,
        header: WeightsByTransfer,
        ctx: zmq.Context,
        stop: threading.Event,
    ) -> None:
        self.cfg, self.worker_id, self.ctx, self.stop = cfg, worker_id, ctx, stop
        self.endpoint, self.lineage = header.endpoint, header.lineage
        self.decoder = WireDecoder(cfg.run_id, expected=TransferDone)

    def __repr__(self) -> str:
        return f"TrainerPush({self.endpoint})"

    def __call__(self, url: str, version: int) -> None:
        # The trainer serves one server at a time: others' transfers may come first.
        wait_s = 2 * self.cfg.engine.remote.request_timeout_s
        deadline, sent = time.time() + wait_s, False
        ask = TransferAsk(
            run_id=self.cfg.run_id,
            worker_id=self.worker_id,
            version=version,
            url=url,
            lineage=self.lineage,
            deadline=deadline,
        )
        try:
            sock = client_socket(self.ctx, zmq.REQ, self.cfg.transport, self.cfg.run_dir)
            try:
                sock.connect(self.endpoint)
                sock.send(encode(ask))
                sent = True
                reply = self._reply(sock, deadline)
            finally:
                sock.close(linger=0)
            if not reply:  # the trainer could not read the ask: it started nothing
                raise PushFailed(f"trainer rank 0 could not read the ask for v{version}", False)
            done = self.decoder.decode(reply)
        except PushFailed:
            raise
        except Exception as e:  # once sent, the trainer may be sending: count it touched
            why = f"asking trainer rank 0 ({self.endpoint}) for v{version} into {url}: {e!r}"
            raise PushFailed(why, touched=sent) from e
        if not done.ok or done.version != version or done.url != url:
            raise PushFailed(done.why or f"answered {done!r:.200}", touched=done.touched)

    def _reply(self, sock: zmq.Socket, deadline: float) -> bytes:
        """The trainer's answer; polled in slices so a stopping generator does not wait."""
        start = time.time()
        while not sock.poll(500):
            if self.stop.is_set() or time.time() > deadline:
                why = "the generator is stopping" if self.stop.is_set() else "no answer"
                raise PushFailed(
                    f"{why} from trainer rank 0 ({self.endpoint}) after {time.time() - start:.0f}s",
                    touched=True,
                )
        return sock.recv()
