"""How the remote engine brings its servers to new weights, and its JSON control calls.

``ServerUpdates`` is ``RemoteEngine``'s collaborator for weights: it owns the engine's
weights version (the oldest of its servers') and the offered one, takes offers of
versioned HF directories (or ``WeightsPush``es) from any thread, and updates the servers
on the engine's event loop, one at a time, so the others keep generating: no new request
goes to the server being updated, and ``load`` (its ``ServerApi.load_weights``,
``asyncrl.engine.server_api``) interrupts its requests in flight (the engine sends them
again as prompt + tokens so far) and has it load the weights. A server's version advances
only when it confirms. A failed update is forgotten, so the trainer's next announcement
retries it.
``ServerState`` is what the engine and this class know of one server; ``post_json`` and
``get_json`` are the control calls every ``ServerApi`` makes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from asyncrl.engine.base import WeightsPush
from asyncrl.engine.servers import Server

log = logging.getLogger("asyncrl.remote")


@dataclass
class ServerState:
    """One server, as the remote engine tracks it."""

    server: Server
    version: int
    """Weights version the server runs: confirmed by an update, or reported on a response."""
    inflight: int = 0
    """Requests sent to it that have not ended."""
    updating: bool = False
    """Its weights are being updated: no new request goes there meanwhile."""
    torn: bool = False
    """A transfer into it failed part-way (or without an answer), or it came back from a
    restart with weights of its own: it gets no request until an update succeeds."""
    down_since: float | None = None
    """When it stopped answering (``time.monotonic``); None while it answers
    (``asyncrl.engine.server_watch``)."""
    last_error: str = ""
    """Why it was last taken for down."""
    restarted: bool = False
    """Launched again since it went down, and not yet answering."""


async def post_json(
    session: aiohttp.ClientSession, url: str, path: str, payload: dict
) -> dict | None:
    """POST a control call to the server at ``url``; its JSON answer ({} if none), or None
    on failure (logged)."""
    try:
        async with session.post(f"{url}{path}", json=payload) as resp:
            text = await resp.text()
            if resp.status != 200:
                log.warning("%s%s answered %s: %s", url, path, resp.status, text[:300])
                return None
            try:
                return json.loads(text) if text else {}
            except json.JSONDecodeError:
                return {}
    except (TimeoutError, aiohttp.ClientError) as e:
        log.warning("%s%s failed: %s", url, path, e)
        return None


async def get_json(session: aiohttp.ClientSession, url: str, path: str) -> dict:
    """GET ``path`` of the server at ``url``: its JSON answer, {} unless it answered 200."""
    async with session.get(f"{url}{path}") as resp:
        return json.loads(await resp.text()) if resp.status == 200 else {}


class ServerUpdates:
    """The weights of a remote engine's servers. ``offer``, ``wait_for`` and the attributes
    are safe from any thread; ``observe`` and the updates run on the engine's loop."""

    def __init__(
        self,
        servers: list[ServerState],
        session: aiohttp.ClientSession,
        loop: asyncio.AbstractEventLoop,
        on_server_free: Callable[[], None],
        version: int,
        load: Callable[[ServerState, str | WeightsPush, int], Awaitable[bool]],
        suspect: Callable[[ServerState, str], None] = lambda state, why: None,
    ) -> None:
        self.servers = servers
        self.version = version
        """The engine's weights version: the oldest of its servers'."""
        self.staged_version = -1
        """The version being brought to the servers; -1 when none is."""
        self.completed = 0
        """Updates every server confirmed."""
        self.failed = 0
        """Updates some server did not confirm (forgotten, retried on the next offer)."""
        self.last_update_s = 0.0
        """Seconds the last update took, over every server."""
        self.last: tuple[str | WeightsPush, int] | None = None
        """The newest weights every server confirmed; None before any update."""
        self._session, self._loop = session, loop
        self._on_server_free = on_server_free  # the engine sends it requests again
        self._load = load  # (server, source, version) -> whether the server confirmed
        # A server that fails an update may be gone: it gets no request while it waits
        # for weights, so no request would ever find out; the watch probes it.
        self._suspect = suspect
        self._changed = threading.Condition()  # guards _target, staged_version, version
        self._target: tuple[str | WeightsPush, int] | None = None  # newest weights offered
        self._task: asyncio.Task | None = None

    def offer(self, path: str | WeightsPush, version: int) -> None:
        """Bring every server to the HF directory ``path`` (or what a ``WeightsPush`` sends)
        as ``version``; returns at once. An offer not newer than the engine's version or
        the newest offered is ignored."""
        with self._changed:
            newest = max(self.version, self._target[1] if self._target else -1)
            if version <= newest and not self._any_torn():
                return  # (a torn server takes any version: a restarted trainer's is older)
            self._target = (path, version)
            self.staged_version = version
        self._loop.call_soon_threadsafe(self._start)

    def wait_for(self, version: int, timeout_s: float) -> None:
        """Block until the engine runs ``version`` (or newer); RuntimeError when its update
        failed, TimeoutError after ``timeout_s``."""
        with self._changed:
            settled = self._changed.wait_for(  # a torn server may hold a newer label
                lambda: (self.version >= version and not self._any_torn()) or self._target is None,
                timeout_s,
            )
            if not settled:
                raise TimeoutError(
                    f"the servers were loading weights v{version} after {timeout_s:.0f}s"
                )
            if self.version < version or self._any_torn():
                raise RuntimeError(f"the servers did not load weights v{version} (see the log)")

    def refresh(self) -> None:
        """Offer the last confirmed weights again: a server back from a restart (torn)
        takes them."""
        if self.last is not None:
            self.offer(*self.last)

    def observe(self, state: ServerState, version: int) -> None:
        """A response of ``state`` carried weights ``version``: when newer, someone else
        (the trainer, over NCCL) updated the server; follow it."""
        if version > state.version:
            state.version = version
            self.version = max(self.version, min(s.version for s in self.servers))

    def metrics(self) -> dict[str, float]:
        return {
            "engine/weight_updates": self.completed,
            "engine/weight_update_failures": self.failed,
            "engine/last_update_s": self.last_update_s,
        }

    # ---- on the engine's loop --------------------------------------------------------
    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._update_servers())

    def _any_torn(self) -> bool:
        """A server a failed transfer may have touched: it waits paused for any version."""
        return any(s.torn for s in self.servers)

    def _settle(self, target: tuple[str | WeightsPush, int] | None) -> bool:
        """Forget ``target`` if it is still the newest offer (it is done, or it failed)."""
        with self._changed:
            if self._target != target:
                return False
            self._target, self.staged_version = None, -1
            self._changed.notify_all()
            return True

    async def _update_servers(self) -> None:
        """Bring every server to the newest offered version, one server at a time."""
        while True:
            target = self._target
            if target is None or (target[1] <= self.version and not self._any_torn()):
                if self._settle(target):
                    return
                continue
            path, version = target
            start = time.perf_counter()
            for state in self.servers:
                if self._target != target:  # a newer version came: no server waits for this one
                    break
                if state.version < version or state.torn:
                    await self._update_one(state, path, version)
            self.last_update_s = time.perf_counter() - start
            if min(s.version for s in self.servers) < version or self._any_torn():
                self.failed += 1
                if self._settle(target):  # so the trainer's next announcement retries it
                    return
                continue
            with self._changed:
                self.completed += 1
                self.version, self.last = version, target
                self._changed.notify_all()

    async def _update_one(self, state: ServerState, path: str | WeightsPush, version: int) -> None:
        state.updating, torn, loaded = True, state.torn, False
        try:
            loaded = await self._load(state, path, version)
            if loaded:  # a torn one may go back in version
                state.version = version if torn else max(state.version, version)
            else:
                log.warning("%s did not load weights v%d from %s", state.server.url, version, path)
        except Exception:  # a failed update, not the end of updates
            log.exception("updating %s to weights v%d failed", state.server.url, version)
        finally:
            state.updating = False
            if not loaded:
                self._suspect(state, f"weights v{version} were not loaded")
            self._on_server_free()
