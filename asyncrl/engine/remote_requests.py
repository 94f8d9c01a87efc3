"""The remote engine's requests: its queue, the attempts it sends, what it hands back.

``RemoteEngine`` (``asyncrl.engine.remote``) owns one ``RequestQueue``. ``submit`` and
``take`` are called from the generator's thread; everything else runs on the engine's
event loop. Each attempt of a request goes to the open server (not updating, not torn,
not down) with the fewest requests in flight, at most ``max_inflight`` each; the rest
wait here. An attempt that ends without its request ending is sent again, first in line,
as prompt + every token so far: after a weight update's pause (``abort``), or when its
server went away (a dropped connection or a server error: the server is then reported to
``ServerWatch``). Tokens come back in order, each with its logprob and version, and the
caller sees one uninterrupted request.

Each attempt has its own server request id, ``request_id#attempt#`` with any ``#`` in the
request id escaped: no id is the start of another, since sglang's ``/abort_request``
aborts every request whose id starts with the one given.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from urllib.parse import quote

import aiohttp

from asyncrl.engine.base import Finished, GeneratedToken, Request, SamplingParams
from asyncrl.engine.remote_weights import ServerState
from asyncrl.engine.server_api import Attempt, AttemptEnd, NewTokens, ServerApi

log = logging.getLogger("asyncrl.remote")

MAX_FRUITLESS_RESENDS = 20
"""A request interrupted this many times in a row without a new token is given up (abort)."""
DRAIN_GRACE_S = 0.25
"""A weight update waits this long for the attempts on its server to end after the pause,
then closes the connections of the rest (see ``drain``): those are held by the paused
server (vLLM 0.32), so waiting longer only delays the update (2 s cost each update of a
GRPO run ~2 s of its ~4 s steps); one cut off early is sent again, losing nothing."""


def _sampling(request: Request) -> SamplingParams:
    """A request's sampling without its seed: what the samples of one call share."""
    return replace(request.params, seed=None)


def server_rid(request_id: str, attempt: int) -> str:
    """The server's id of an attempt: ``request_id#attempt#``, prefix-free (no such id
    starts another) because ``#`` is escaped in ``request_id``."""
    return f"{quote(request_id, safe=':/-_.@')}#{attempt}#"


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
        return server_rid(self.request.request_id, self.attempt)


@dataclass
class Counters:
    tokens: int = 0
    finished: int = 0
    aborted: int = 0
    resent: int = 0
    """Attempts sent again after an interruption or a lost server."""
    resent_tokens: int = 0
    """Prompt and generated tokens those attempts sent again (re-prefilled)."""


class RequestQueue:
    """The requests of one remote engine (module docstring)."""

    def __init__(
        self,
        api: ServerApi,
        servers: list[ServerState],
        loop: asyncio.AbstractEventLoop,
        session: aiohttp.ClientSession,
        max_inflight: int,
        max_seq_len: int,
        observe: Callable[[ServerState, int], None],
        suspect: Callable[[ServerState, str], None],
    ) -> None:
        self.api, self.servers, self.max_inflight = api, servers, max_inflight
        self.max_seq_len = max_seq_len
        self._loop, self._session = loop, session
        self._observe = observe  # a version newer than its server's: someone else updated it
        self._suspect = suspect  # the server failed an attempt: the watch checks it
        self.counters = Counters()
        self.failure: str | None = None
        """Why the engine cannot go on; None while it can."""
        self.lock = threading.Lock()  # guards the queues below and the outputs
        self.arrived = threading.Condition(self.lock)
        self._queued: deque[_Seq] = deque()
        self._submitted = False  # queued since the last take: dispatch then
        self._running: dict[str, _Seq] = {}
        self._tokens: list[GeneratedToken] = []
        self._finished: list[Finished] = []

    # ---- from the generator's thread ---------------------------------------------------
    def submit(self, request: Request) -> None:
        with self.lock:
            rid = request.request_id
            if rid in self._running or any(s.request.request_id == rid for s in self._queued):
                raise ValueError(f"request {rid!r} is already queued or running")
            self._queued.append(_Seq(request))
            self._submitted = True

    def take(self, wait_s: float) -> tuple[list[GeneratedToken], list[Finished]]:
        """What arrived since the last call, waiting up to ``wait_s`` when nothing has.
        Requests submitted since the last call are sent from here: those submitted
        together (a GRPO group) are seen together, and go as one request of ``n``."""
        with self.arrived:
            if self._submitted:
                self._submitted = False
                self._loop.call_soon_threadsafe(self.dispatch)
            if not (self._tokens or self._finished or self.failure):
                self.arrived.wait(wait_s)
            tokens, self._tokens = self._tokens, []
            finished, self._finished = self._finished, []
        return tokens, finished

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self.lock:
            return len(self._running), len(self._queued)

    # ---- on the engine's loop ----------------------------------------------------------
    def dispatch(self) -> None:
        """Send queued requests to the least busy open servers."""
        with self.lock:
            while self._queued:
                open_ = [
                    s
                    for s in self.servers
                    if not (s.updating or s.torn or s.down_since is not None)
                    and s.inflight < self.max_inflight
                ]
                if not open_:
                    return
                server = min(open_, key=lambda s: s.inflight)
                group = self._take_group(server)
                for seq in group:
                    seq.server, seq.cancel = server, asyncio.Event()
                    self._running[seq.request.request_id] = seq
                server.inflight += len(group)
                self._loop.create_task(self._attempt(group))

    def _take_group(self, server: ServerState) -> list[_Seq]:
        """The next queued request, and the fresh ones queued with the same prompt and
        sampling (a GRPO group's samples) up to what one call may carry: the server then
        runs them as one request of ``n`` samples. The caller holds ``self.lock``."""
        seq = self._queued.popleft()
        room = self.max_inflight - server.inflight
        limit = min(room, self.api.group_size(server.server.url, seq.request.params))
        group = [seq]
        if seq.tokens or limit <= 1:
            return group
        key = _sampling(seq.request)
        for other in list(self._queued):
            if len(group) >= limit:
                break
            same = other.request.prompt_ids == seq.request.prompt_ids
            if same and not other.tokens and _sampling(other.request) == key:
                self._queued.remove(other)
                group.append(other)
        return group

    def abort(self, request_id: str) -> None:
        with self.lock:
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

    async def drain(self, server: ServerState) -> None:
        """Return once no attempt is in flight on ``server`` (paused: they are ending).
        After ``DRAIN_GRACE_S`` the rest are cancelled: a request that reached a vLLM
        server after its pause waits there, and closing its connection drops it."""
        deadline = self._loop.time() + DRAIN_GRACE_S
        while server.inflight:
            if self._loop.time() > deadline:
                with self.lock:
                    for seq in self._running.values():
                        if seq.server is server and seq.cancel is not None:
                            seq.cancel.set()
            await asyncio.sleep(0.01)

    async def _attempt(self, group: list[_Seq]) -> None:
        """One call: one attempt of each request of ``group`` (several: one input)."""
        server = group[0].server
        before = [len(seq.tokens) for seq in group]
        attempts = [self._attempt_of(seq, server) for seq in group]
        try:
            if len(attempts) == 1:
                ends = [await self.api.generate(self._session, server, attempts[0])]
            else:
                ends = await self.api.generate_group(self._session, server, attempts)
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            ends = [AttemptEnd(None, lost=f"{type(e).__name__}: {e}")] * len(group)  # cut off
        except (aiohttp.ClientError, ValueError) as e:
            self._fail(f"the server at {server.server.url} answered what cannot be read: {e}")
            return
        with self.lock:
            for seq, end, count in zip(group, ends, before):
                self._settle(seq, server, end, count)
        self.dispatch()

    def _attempt_of(self, seq: _Seq, server: ServerState) -> Attempt:
        return Attempt(
            seq.rid,
            seq.request.prompt_ids + seq.tokens,
            seq.request.params,
            self._budget(seq),
            lambda new: self._take(server, seq, new),
            seq.cancel,
        )

    def _settle(self, seq: _Seq, server: ServerState, end: AttemptEnd, before: int) -> None:
        """What follows an attempt's end: the request finishes, or goes again first in
        line. The caller holds ``self.lock``."""
        seq.matched = end.matched
        server.inflight -= 1
        del self._running[seq.request.request_id]
        if end.lost:  # the server went away: the attempt goes again, elsewhere or later
            self._suspect(server, end.lost)
        seq.fruitless = 0 if len(seq.tokens) > before else seq.fruitless + 1
        if end.reason not in (None, "abort"):
            self._finish(seq, end.reason)
        elif seq.aborted or end.error or seq.fruitless > MAX_FRUITLESS_RESENDS:
            self._finish(seq, "abort")
        elif self._budget(seq) <= 0:
            self._finish(seq, "length")
        else:  # interrupted (an update's pause, a lost server): continue where it stopped
            seq.attempt += 1
            self.counters.resent += 1
            self.counters.resent_tokens += len(seq.request.prompt_ids) + len(seq.tokens)
            self._queued.appendleft(seq)

    def _budget(self, seq: _Seq) -> int:
        """New tokens the next attempt may generate."""
        used = len(seq.request.prompt_ids) + len(seq.tokens)
        return min(seq.request.params.max_new_tokens - len(seq.tokens), self.max_seq_len - used)

    def _take(self, server: ServerState, seq: _Seq, new: NewTokens) -> None:
        """Record an attempt's new tokens, and the version they report."""
        self._observe(server, max(v for _, _, v in new))
        rid = seq.request.request_id
        seq.tokens.extend(token for token, _, _ in new)
        with self.arrived:
            self._tokens.extend(GeneratedToken(rid, t, lp, v) for t, lp, v in new)
            self.counters.tokens += len(new)
            self.arrived.notify_all()

    def _finish(self, seq: _Seq, reason: str) -> None:
        """Report ``seq`` finished; the caller holds ``self.lock``."""
        matched = seq.matched if reason == "stop" else None
        self._finished.append(Finished(seq.request.request_id, reason, len(seq.tokens), matched))
        if reason == "abort":
            self.counters.aborted += 1
        else:
            self.counters.finished += 1
        self.arrived.notify_all()

    def _fail(self, message: str) -> None:
        """A server answered what this client cannot read: the engine's next ``step``
        raises ``ServerFailed``, and the run stops (a restart would meet the same)."""
        log.error(message)
        with self.arrived:
            self.failure = message
            self.arrived.notify_all()
