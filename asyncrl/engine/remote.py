"""The remote engine: the ``Engine`` interface over sglang's or vLLM's HTTP API (DESIGN §8).

A generator with ``engine.backend="remote"`` drives one or more inference servers (sglang,
vLLM, or asyncrl's front for the embedded engine) that it launches or attaches to
(``asyncrl.engine.servers``), configured by ``RemoteEngineConfig`` (``engine.remote.*``).
The generator drives it through the same ``Engine`` protocol (``asyncrl.interfaces``) as
the embedded engine. What differs between servers is one ``ServerApi`` object
(``asyncrl.engine.server_api``: sglang's; ``asyncrl.engine.vllm_client``: vLLM's).

- **Requests.** Each attempt of a request goes to the server with the fewest requests in
  flight (at most ``max_inflight`` each; the rest wait here): a streaming ``POST
  /generate`` for sglang, a ``POST /v1/completions`` for vLLM. A background thread runs
  an asyncio loop with an aiohttp session; ``step`` returns the tokens that arrived since
  the previous call, waiting up to ``STEP_WAIT_S`` when none has, so the generator's
  loop does not spin.
- **Tokens, logprobs, versions.** Each token comes with its logprob (``log_softmax(logits
  / T)``, as the embedded engine's) and its weights version: reported per token by
  asyncrl's front, per response chunk by sglang, and for vLLM the version its server ran
  when the attempt was sent. Each is exact because a weight update first interrupts
  every request on the server (below), so no attempt's tokens mix two versions.
- **Weights.** ``stage_weights(path, version)`` (the ``DiskWeightPublisher``'s
  announcements) has its ``ServerUpdates`` (``asyncrl.engine.remote_weights``) update the
  servers one after another, so the others keep generating: the ``ServerApi`` pauses the
  server (ending its requests), has it load the directory and resumes it (for vLLM after
  ``_drain``: no attempt left on it). A server's version advances only when it confirms;
  the engine's version is the oldest of its servers'. Raw tensors are written as such a
  directory first; a ``WeightsPush`` (vLLM's weight transfer) sends the version into the
  paused, drained server instead. With NCCL into sglang the trainer pauses, broadcasts
  and continues the servers itself; the engine follows the versions responses report.
- **Interruption and resumption** (AReaL's interruptible generation). A pause
  ends every request on the server with finish reason ``abort``; a request the caller
  did not abort is sent again as prompt + the tokens generated so far, with
  ``max_new_tokens`` reduced by their number, and the caller sees one uninterrupted
  request. The server re-prefills that prefix under the new weights (its cache was
  flushed with the update), so later tokens are sampled from, and carry, the new
  version, while every earlier token keeps the version and behavior logprob it was
  sampled with. That is all the decoupled loss needs (DESIGN §6): it corrects each token
  by its own behavior logprob, whichever policy produced it.

Differences from the embedded engine: a request's seed goes to the server keyed by where
each attempt starts (sglang applies it in deterministic mode only); ``max_new_tokens`` is
capped so prompt + completion fit ``max_seq_len``. Stop strings go with every attempt,
and a server looks for them in what that attempt generates: one split by an interruption
ends nothing (the reward's text is still cut at it).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch

from asyncrl.engine import sglang_api
from asyncrl.engine.base import EngineStatus, Finished, GeneratedToken, Request, StepOutput, Weights
from asyncrl.engine.remote_weights import ServerState, ServerUpdates
from asyncrl.engine.server_api import Attempt, NewTokens
from asyncrl.engine.server_apis import server_api
from asyncrl.engine.servers import (
    RemoteEngineConfig,
    log_tail,
    start_servers,
    stop_servers,
    write_weights_dir,
)
from asyncrl.models import model_config

log = logging.getLogger(__name__)

STEP_WAIT_S = 0.05
"""``step`` waits this long for a token before returning an empty step."""
MAX_FRUITLESS_RESENDS = 20
"""A request interrupted this many times in a row without a new token is given up (abort)."""
DRAIN_GRACE_S = 2.0
"""A weight update waits this long for the attempts on its server to end after the pause,
then closes the connections of the rest (see ``_drain``)."""


@dataclass
class _Seq:
    request: Request
    tokens: list[int] = field(default_factory=list)
    """Tokens generated so far, over every attempt."""
    attempt: int = 0
    fruitless: int = 0
    """Attempts in a row that ended without a new token."""
    server: ServerState | None = None
    aborted: bool = False
    """The caller aborted it: report ``abort``, never resend."""
    matched: str | None = None
    """The stop string the server reported ending it."""
    cancel: asyncio.Event | None = None
    """Set to end the attempt in flight (a new one per attempt)."""

    @property
    def rid(self) -> str:
        """The server's request id of this attempt (unique while an aborted one drains)."""
        rid = self.request.request_id
        return rid if self.attempt == 0 else f"{rid}#{self.attempt}"


@dataclass
class _Counters:
    tokens: int = 0
    finished: int = 0
    aborted: int = 0
    resent: int = 0
    resent_tokens: int = 0


class RemoteEngine:
    def __init__(
        self,
        model_path: str,
        cfg: RemoteEngineConfig,
        version: int = 0,
        log_dir: str | Path = "",
        name: str = "engine",
    ) -> None:
        cfg.check()
        self.cfg, self.model_path = cfg, model_path
        config = model_config(model_path)
        self.max_seq_len = cfg.max_seq_len or config.max_position_embeddings
        self.eos_ids = sglang_api.eos_ids(model_path, config)
        self.api = server_api(cfg.server, self.eos_ids)
        self.counters = _Counters()
        self._lock = threading.Lock()  # guards the queues below and the outputs
        self._queued: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._tokens: list[GeneratedToken] = []
        self._finished: list[Finished] = []
        self._arrived = threading.Condition(self._lock)
        self._failure: str | None = None
        self._staging = Path(tempfile.mkdtemp(prefix="asyncrl-staged-"))
        log_dir = Path(log_dir) if log_dir else self._staging / "logs"
        servers = start_servers(cfg, model_path, log_dir, name, version)
        self.servers = [ServerState(server, version) for server in servers]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="remote-engine", daemon=True
        )
        self._thread.start()
        self._session: aiohttp.ClientSession = self._call(self._open_session())
        try:  # start from the versions the servers report (attached ones may run others)
            for state in self.servers:
                self._call(self.api.attach(self._session, state))
        except BaseException:
            self.close()
            raise
        self.updates = ServerUpdates(
            self.servers,
            self._session,
            self._loop,
            self._dispatch,
            min(s.version for s in self.servers),
            self._load,
        )

    @property
    def urls(self) -> list[str]:
        return [s.server.url for s in self.servers]

    # ---- the interface -------------------------------------------------------------
    def submit(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        if len(request.prompt_ids) >= self.max_seq_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {len(request.prompt_ids)} tokens does "
                f"not fit max_seq_len={self.max_seq_len}"
            )
        with self._lock:
            rid = request.request_id
            if rid in self._running or any(s.request.request_id == rid for s in self._queued):
                raise ValueError(f"request {rid!r} is already queued or running")
            self._queued.append(_Seq(request))
        self._loop.call_soon_threadsafe(self._dispatch)

    def step(self) -> StepOutput:
        with self._arrived:
            if not (self._tokens or self._finished or self._failure):
                self._arrived.wait(STEP_WAIT_S)
            if self._failure:
                raise RuntimeError(self._failure)
            tokens, self._tokens = self._tokens, []
            finished, self._finished = self._finished, []
        return StepOutput(tokens=tokens, finished=finished, version=self.updates.version)

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._abort, request_id)

    def stage_weights(self, weights: Weights, version: int, *, wait: bool = False) -> None:
        """Have every server load ``weights`` as ``version``, one server at a time (see
        ``ServerUpdates``); returns at once unless ``wait``. A directory is loaded as it is;
        tensors are first written as one, on the caller's thread (decoding goes on
        meanwhile); a ``WeightsPush`` is asked for each server in turn. A version not newer
        than the newest offered is ignored."""
        if isinstance(weights, Mapping):
            weights = self._write_staged(weights, version)
        self.updates.offer(weights if callable(weights) else str(weights), version)
        if wait:  # each server's update is three control calls, each bounded by the timeout
            self.updates.wait_for(version, 3 * len(self.servers) * self.cfg.request_timeout_s)

    def status(self) -> EngineStatus:
        c, updates = self.counters, self.updates
        with self._lock:
            running, waiting = len(self._running), len(self._queued)
        free = sum(not s.torn for s in self.servers) * self.cfg.max_inflight - running
        version, staged = updates.version, updates.staged_version
        metrics = {
            "engine/running": running,
            "engine/waiting": waiting,
            "engine/free_slots": free,
            "engine/version": version,
            "engine/staged_version": staged,
            "engine/servers": len(self.servers),
            "engine/tokens": c.tokens,
            "engine/finished": c.finished,
            "engine/aborted": c.aborted,
            # Requests sent again after an interruption, and the tokens re-prefilled for them.
            "engine/resent": c.resent,
            "engine/resent_tokens": c.resent_tokens,
            **updates.metrics(),
        }
        return EngineStatus(running, waiting, free, version, staged, c.tokens, None, metrics)

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._call(self._shutdown())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5)
        stop_servers([s.server for s in self.servers])
        shutil.rmtree(self._staging, ignore_errors=True)

    def _write_staged(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        """Write tensors as the HF directory ``vVERSION`` of the staging directory."""
        path = write_weights_dir(state_dict, self.model_path, self._staging / f"v{version}")
        for old in self._staging.glob("v*"):  # keep this version and the one before
            if old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)
        return path

    # ---- the loop thread: requests -------------------------------------------------
    def _call(self, coro):
        """Run ``coro`` on the loop thread and wait for its result (setup and close only)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._session.close()

    async def _open_session(self) -> aiohttp.ClientSession:
        t = self.cfg.request_timeout_s
        timeout = aiohttp.ClientTimeout(total=None, connect=t, sock_read=t)
        # Cumulative stream lines grow with the completion: allow long ones.
        return aiohttp.ClientSession(timeout=timeout, read_bufsize=1 << 22)

    def _dispatch(self) -> None:
        """Send queued requests to the least busy servers neither updating nor torn."""
        with self._lock:
            while self._queued:
                open_ = [
                    s
                    for s in self.servers
                    if not (s.updating or s.torn) and s.inflight < self.cfg.max_inflight
                ]
                if not open_:
                    return
                server = min(open_, key=lambda s: s.inflight)
                seq = self._queued.popleft()
                seq.server, server.inflight = server, server.inflight + 1
                seq.cancel = asyncio.Event()
                self._running[seq.request.request_id] = seq
                self._loop.create_task(self._attempt(seq))

    def _abort(self, request_id: str) -> None:
        with self._lock:
            queued = [s for s in self._queued if s.request.request_id == request_id]
            if queued:
                self._queued.remove(queued[0])
                self._finish(queued[0], "abort")
                return
            seq = self._running.get(request_id)
        if seq is not None and not seq.aborted:
            seq.aborted = True  # its attempt ends with "abort", reported then
            seq.cancel.set()
            self._loop.create_task(self.api.abort(self._session, seq.server.server.url, seq.rid))

    async def _attempt(self, seq: _Seq) -> None:
        server, before = seq.server, len(seq.tokens)
        attempt = Attempt(
            seq.rid,
            seq.request.prompt_ids + seq.tokens,
            seq.request.params,
            self._budget(seq),
            lambda new: self._take(server, seq, new),
            seq.cancel,
        )
        try:
            end = await self.api.generate(self._session, server, attempt)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            process = server.server.process
            died = process is not None and process.poll() is not None
            self._fail(
                f"request to {server.server.url} failed: {type(e).__name__}: {e}"
                + (f"\nthe server exited:\n{log_tail(server.server)}" if died else "")
            )
            return
        seq.matched = end.matched
        with self._lock:
            server.inflight -= 1
            del self._running[seq.request.request_id]
            remaining = self._budget(seq)
            seq.fruitless = 0 if len(seq.tokens) > before else seq.fruitless + 1
            if end.reason not in (None, "abort"):
                self._finish(seq, end.reason)
            elif seq.aborted or end.error or seq.fruitless > MAX_FRUITLESS_RESENDS:
                self._finish(seq, "abort")
            elif remaining <= 0:
                self._finish(seq, "length")
            else:  # interrupted by a weight update (or a pause): continue where it stopped
                seq.attempt += 1
                self.counters.resent += 1
                self.counters.resent_tokens += len(seq.request.prompt_ids) + len(seq.tokens)
                self._queued.appendleft(seq)
        self._dispatch()

    def _budget(self, seq: _Seq) -> int:
        """New tokens the next attempt may generate."""
        used = len(seq.request.prompt_ids) + len(seq.tokens)
        return min(seq.request.params.max_new_tokens - len(seq.tokens), self.max_seq_len - used)

    def _take(self, server: ServerState, seq: _Seq, new: NewTokens) -> None:
        """Record an attempt's new tokens. A version newer than the server's means someone
        else (the trainer, over NCCL) updated it: the engine follows."""
        self.updates.observe(server, max(v for _, _, v in new))
        rid = seq.request.request_id
        seq.tokens.extend(token for token, _, _ in new)
        with self._arrived:
            self._tokens.extend(GeneratedToken(rid, t, lp, v) for t, lp, v in new)
            self.counters.tokens += len(new)
            self._arrived.notify_all()

    async def _load(self, server: ServerState, path: Weights, version: int) -> bool:
        """``ServerUpdates``' update of one server (no new attempt is sent to it meanwhile)."""
        return await self.api.load_weights(self._session, server, path, version, self._drain)

    async def _drain(self, server: ServerState) -> None:
        """Return once no attempt is in flight on ``server`` (paused: they are ending).
        After ``DRAIN_GRACE_S`` the rest are cancelled: a request that reached a vLLM
        server after its pause waits there, and closing its connection drops it."""
        deadline = self._loop.time() + DRAIN_GRACE_S
        while server.inflight:
            if self._loop.time() > deadline:
                with self._lock:
                    for seq in self._running.values():
                        if seq.server is server and seq.cancel is not None:
                            seq.cancel.set()
            await asyncio.sleep(0.01)

    def _finish(self, seq: _Seq, reason: str) -> None:
        """Report ``seq`` finished; the caller holds ``self._lock``."""
        matched = seq.matched if reason == "stop" else None
        self._finished.append(Finished(seq.request.request_id, reason, len(seq.tokens), matched))
        if reason == "abort":
            self.counters.aborted += 1
        else:
            self.counters.finished += 1
        self._arrived.notify_all()

    def _fail(self, message: str) -> None:
        """A server stopped answering: the next ``step`` raises, the generator exits, and
        the launcher restarts it (its leases are re-issued)."""
        log.error(message)
        with self._arrived:
            self._failure = message
            self._arrived.notify_all()
