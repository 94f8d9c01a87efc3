"""The remote engine: the ``Engine`` interface over sglang's or vLLM's HTTP API
(docs/design.md, Engines).

A generator with ``engine.backend="remote"`` drives one or more inference servers (sglang,
vLLM, or asyncrl's front for the embedded engine) that it launches or attaches to
(``asyncrl.engine.servers``), configured by ``RemoteEngineConfig`` (``engine.remote.*``).
The generator drives it through the same ``Engine`` protocol (``asyncrl.interfaces``) as
the embedded engine. What differs between servers is one ``ServerApi`` object
(``asyncrl.engine.server_api``: sglang's; ``asyncrl.engine.vllm_client``: vLLM's).

- **Requests** (``RequestQueue``, ``asyncrl.engine.remote_requests``). Each attempt of a
  request goes to the server with the fewest requests in flight (at most
  ``max_inflight`` each; the rest wait there): a streaming ``POST /generate`` for
  sglang, a ``POST /v1/completions`` for vLLM. A background thread runs an asyncio loop
  with an aiohttp session; ``step`` returns the tokens that arrived since the previous
  call, waiting up to ``STEP_WAIT_S`` when none has, so the generator's loop does not
  spin.
- **Tokens, logprobs, versions.** Each token comes with its logprob (``log_softmax(logits
  / T)``, as the embedded engine's) and its weights version: reported per token by
  asyncrl's front, per response chunk by sglang, and for vLLM the version its server ran
  when the attempt was sent. Each is exact because a weight update first interrupts
  every request on the server (below), so no attempt's tokens mix two versions.
- **Weights.** ``stage_weights(path, version)`` (the ``DiskWeightPublisher``'s
  announcements) has its ``ServerUpdates`` (``asyncrl.engine.remote_weights``) update the
  servers one after another, so the others keep generating: the ``ServerApi`` pauses the
  server (ending its requests), has it load the directory and resumes it (for vLLM after
  ``RequestQueue.drain``: no attempt left on it). A server's version advances only when it confirms;
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
  sampled with. That is all the decoupled loss needs (docs/design.md, The loss): it corrects
  each token by its own behavior logprob, whichever policy produced it.
- **Servers that stop answering** (``ServerWatch``, ``asyncrl.engine.server_watch``):
  their requests go back in the queue, a launched one is restarted, an attached one
  still down after ``dead_after_s`` ends the engine with ``ServerFailed``.

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
from collections.abc import Mapping
from pathlib import Path

import aiohttp
import torch

from asyncrl.engine import sglang_api
from asyncrl.engine.base import EngineStatus, Request, ServerFailed, StepOutput, Weights
from asyncrl.engine.remote_requests import RequestQueue
from asyncrl.engine.remote_weights import ServerState, ServerUpdates
from asyncrl.engine.server_apis import server_api
from asyncrl.engine.server_watch import ServerWatch
from asyncrl.engine.servers import RemoteEngineConfig, start_servers, stop_servers
from asyncrl.engine.weight_dirs import write_weights_dir
from asyncrl.models import model_config

log = logging.getLogger(__name__)

STEP_WAIT_S = 0.05
"""``step`` waits this long for a token before returning an empty step."""


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
        self.requests = RequestQueue(
            self.api,
            self.servers,
            self._loop,
            self._session,
            cfg.max_inflight,
            self.max_seq_len,
            observe=lambda state, version: self.updates.observe(state, version),
            suspect=lambda state, why: self.watch.suspect(state, why),
        )
        self.updates = ServerUpdates(
            self.servers,
            self._session,
            self._loop,
            self.requests.dispatch,
            min(s.version for s in self.servers),
            self._load,
            suspect=lambda state, why: self.watch.suspect(state, why),
        )
        self.watch = ServerWatch(
            cfg, self.servers, self._session, self._reattach, self.requests.dispatch, model_path
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
        self.requests.submit(request)

    def step(self) -> StepOutput:
        """The tokens and finished requests since the last step; ``ServerFailed`` once a
        server is lost for good (``ServerWatch``) or answers what cannot be read."""
        tokens, finished = self.requests.take(STEP_WAIT_S)
        if self.requests.failure or self.watch.fatal:
            raise ServerFailed(self.requests.failure or self.watch.fatal)
        return StepOutput(tokens=tokens, finished=finished, version=self.updates.version)

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self.requests.abort, request_id)

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
        c, updates = self.requests.counters, self.updates
        running, waiting = self.requests.counts()
        usable = sum(not s.torn and s.down_since is None for s in self.servers)
        free = usable * self.cfg.max_inflight - running
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
            **self.watch.metrics(),
        }
        failure = self.requests.failure or self.watch.fatal
        return EngineStatus(
            running, waiting, free, version, staged, c.tokens, None, metrics, failure
        )

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

    # ---- the loop thread -----------------------------------------------------------
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

    async def _load(self, server: ServerState, path: Weights, version: int) -> bool:
        """``ServerUpdates``' update of one server (no new attempt is sent to it meanwhile)."""
        drain = self.requests.drain
        return await self.api.load_weights(self._session, server, path, version, drain)

    async def _reattach(self, state: ServerState) -> None:
        """Learn again what a server that stopped answering runs (``ServerWatch``): one
        that restarted, or that reports weights other than the version it ran, gets no
        request until an update brings it the newest (the last confirmed, offered again)."""
        before = state.version
        state.version = -1  # unless it reports a version
        await self.api.attach(self._session, state)
        changed = state.restarted or state.version != before
        state.version = before
        if changed and self.updates.last is not None:
            state.torn = True
            self.updates.refresh()
