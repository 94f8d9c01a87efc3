"""What the remote engine does when one of its servers stops answering.

A server is someone else's process: it can die, hang or be restarted under the engine.
``ServerWatch`` is ``RemoteEngine``'s collaborator for that, on the engine's event loop.
A request whose connection fails (refused, dropped, silent past
``engine.remote.request_timeout_s``) or that a server answers with a server error marks
the server suspect, and so does a weight update it does not confirm (a server waiting
for weights gets no requests, so none would find it gone); the engine puts the request
back in its queue with every token it had, and sends nothing more to a server that is
down. Every ``PROBE_S`` the watch asks each down server's ``/health``, and:

- logs, every ``LOG_EVERY_S``, the server's URL, for how long, and the last error;
- restarts a server this engine launched once its process has exited, or once it has not
  answered for ``engine.remote.dead_after_s`` (a process alive but serving nothing, as a
  vLLM whose engine core died): on the same port, counted in ``engine/server_restarts``;
  more than ``MAX_RESTARTS`` restarts of one server end the engine;
- once a server answers again, has the engine attach to it anew: a restarted server runs
  the weights it started with, so it gets no request until the newest weights are in;
- ends the engine when an attached server (``engine.remote.urls``) has not answered for
  ``dead_after_s``: the next ``step`` raises ``ServerFailed`` naming the URL, the
  generator exits with ``EXIT_FATAL`` and the launcher stops the run, since restarting
  the generator would not bring someone else's server back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from asyncrl.engine.config import RemoteEngineConfig
from asyncrl.engine.remote_weights import ServerState
from asyncrl.engine.servers import log_tail, relaunch, stop_servers

log = logging.getLogger("asyncrl.remote")

PROBE_S = 1.0
"""How often a down server's ``/health`` is asked."""
LOG_EVERY_S = 5.0
"""How often a server that stays down is logged."""
MAX_RESTARTS = 5
"""Restarts of one launched server before the engine gives up on it (a server that keeps
dying has a cause a restart does not remove)."""


class ServerWatch:
    """The down servers of one remote engine. ``suspect`` and the watch task run on the
    engine's loop; ``fatal`` and ``restarts`` are read from any thread."""

    def __init__(
        self,
        cfg: RemoteEngineConfig,
        servers: list[ServerState],
        session: aiohttp.ClientSession,
        reattach: Callable[[ServerState], Awaitable[None]],
        on_server_free: Callable[[], None],
        model_path: str,
    ) -> None:
        self.cfg, self.servers, self._session = cfg, servers, session
        self._reattach = reattach  # learn its version again: torn unless it is the engine's
        self._on_server_free = on_server_free  # the engine dispatches to it again
        self.model_path = model_path
        self.fatal: str | None = None
        """Why the engine cannot go on (a server that stays down); None while it can."""
        self.restarts = 0
        """Launched servers restarted, over all of them."""
        self._task: asyncio.Task | None = None
        self._logged: dict[str, float] = {}
        self._restarted: dict[str, int] = {}

    def suspect(self, state: ServerState, error: str) -> None:
        """A request to ``state``'s server failed with ``error``: mark it down (if it is
        not already) and make sure the watch runs."""
        state.last_error = error
        if state.down_since is None:
            state.down_since = time.monotonic()
            log.warning("the server at %s failed a request: %s", state.server.url, error)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def metrics(self) -> dict[str, float]:
        return {
            "engine/servers_down": sum(s.down_since is not None for s in self.servers),
            "engine/server_restarts": self.restarts,
        }

    async def _watch(self) -> None:
        while self.fatal is None and any(s.down_since is not None for s in self.servers):
            for state in self.servers:
                if state.down_since is not None:
                    await self._check(state)
            await asyncio.sleep(PROBE_S)

    async def _check(self, state: ServerState) -> None:
        if await self._healthy(state):
            await self._revive(state)
            return
        url, process = state.server.url, state.server.process
        down_s = time.monotonic() - state.down_since
        # A restarted server has the launch's time to answer; a running one dead_after_s.
        bound = self.cfg.startup_timeout_s if state.restarted else self.cfg.dead_after_s
        if process is not None and (process.poll() is not None or down_s > bound):
            self._restart(state)
        elif process is None and down_s > self.cfg.dead_after_s:
            self.fatal = (
                f"the server at {url} has not answered for {down_s:.0f} s "
                f"(engine.remote.dead_after_s={self.cfg.dead_after_s:g}); last error: "
                f"{state.last_error}"
            )
            log.error("%s", self.fatal)
        elif time.monotonic() - self._logged.get(url, 0.0) >= LOG_EVERY_S:
            self._logged[url] = time.monotonic()
            log.warning(
                "cannot reach the server at %s for %.0f s: %s (%s)",
                url,
                down_s,
                state.last_error,
                "restarted after engine.remote.dead_after_s"
                if process
                else f"the run stops after engine.remote.dead_after_s={self.cfg.dead_after_s:g}",
            )

    async def _healthy(self, state: ServerState) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=min(5.0, self.cfg.request_timeout_s))
            async with self._session.get(f"{state.server.url}/health", timeout=timeout) as resp:
                ok = resp.status == 200
                if not ok:
                    state.last_error = f"/health answered {resp.status}"
                return ok
        except (TimeoutError, aiohttp.ClientError) as e:
            state.last_error = f"{type(e).__name__}: {e}"
            return False

    def _restart(self, state: ServerState) -> None:
        """Start a launched server again on its port (on this thread: the loop's, which
        lives as long as the engine, so the server's death signal follows it)."""
        url = state.server.url
        count = self._restarted.get(url, 0) + 1
        if count > MAX_RESTARTS:
            self.fatal = (
                f"the server at {url} was restarted {MAX_RESTARTS} times and is down again: "
                f"{state.last_error}\n{log_tail(state.server)}"
            )
            log.error("%s", self.fatal)
            return
        self._restarted[url], self.restarts = count, self.restarts + 1
        log.warning(
            "restarting the server at %s (restart %d; %s); last lines of its log:\n%s",
            url,
            count,
            state.last_error,
            log_tail(state.server, 1500),
        )
        stop_servers([state.server])
        state.server = relaunch(state.server, self.cfg, self.model_path)
        state.restarted = True
        state.down_since = time.monotonic()  # it has startup_timeout_s to answer again

    async def _revive(self, state: ServerState) -> None:
        restarted = state.restarted
        try:
            await self._reattach(state)
        except (RuntimeError, TimeoutError, aiohttp.ClientError, ValueError) as e:
            state.last_error = f"attaching again: {e}"
            return
        down_s = time.monotonic() - state.down_since
        state.down_since, state.restarted = None, False
        self._logged.pop(state.server.url, None)
        log.warning(
            "the server at %s answers again after %.0f s%s",
            state.server.url,
            down_s,
            " (restarted: it gets requests once the newest weights are in)" if restarted else "",
        )
        self._on_server_free()
