"""How a ``RemoteEngine`` brings its servers to new weights, on its event-loop thread
(a mixin of ``RemoteEngine``, split out to keep each file readable).

One server at a time, so the others keep generating: pause it (mode ``abort``: its
requests in flight end and are re-sent by the engine as prompt + tokens so far), ask it
to load the versioned directory (``/update_weights_from_disk``), continue. A server's
version advances only when it confirms; the engine's version is the oldest of its
servers'. A failed update is forgotten, so the trainer's next announcement retries it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:  # remote imports this module
    from asyncrl.engine.remote import _ServerState

log = logging.getLogger("asyncrl.remote")


class ServerUpdates:
    """The weight-update half of ``RemoteEngine``; it uses the engine's ``servers``,
    ``_loop``, ``_lock``, ``_session``, ``_target``, ``counters`` and ``_dispatch``."""

    def _start_updater(self) -> None:
        if self._updater is None or self._updater.done():
            self._updater = self._loop.create_task(self._update_servers())

    async def _update_servers(self) -> None:
        """Bring every server to the newest offered version, one server at a time."""
        while True:
            with self._lock:
                target = self._target
                if target is None or target[1] <= self.version:
                    self._target, self.staged_version = None, -1
                    return
            path, version = target
            start = time.perf_counter()
            for state in self.servers:
                if state.version < version:
                    await self._update_one(state, path, version)
            self.counters.last_update_s = time.perf_counter() - start
            if min(s.version for s in self.servers) < version:
                self.counters.weight_update_failures += 1
                with self._lock:  # forget it, so the trainer's next announcement retries it
                    if self._target == target:
                        self._target, self.staged_version = None, -1
                        return
                continue
            self.version = version
            self.counters.weight_updates += 1

    async def _update_one(self, state: _ServerState, path: str, version: int) -> None:
        state.updating = True  # no new request goes there meanwhile
        try:
            # Pausing ends the requests in flight (finish reason abort; they are resent).
            await self._post(state, "/pause_generation", {"mode": "abort"})
            body = await self._post(
                state,
                "/update_weights_from_disk",
                {"model_path": path, "weight_version": str(version)},
            )
            if body is not None and body.get("success", True):
                state.version = max(state.version, version)
            else:
                log.warning(
                    "%s did not load weights v%d from %s: %s", state.server.url, version, path, body
                )
        finally:
            await self._post(state, "/continue_generation", {})
            state.updating = False
            self._dispatch()

    async def _post(self, state: _ServerState, path: str, payload: dict) -> dict | None:
        """POST a control call; its JSON answer ({} if none), or None on failure."""
        try:
            async with self._session.post(f"{state.server.url}{path}", json=payload) as resp:
                text = await resp.text()
                if resp.status != 200:
                    log.warning(
                        "%s%s answered %s: %s", state.server.url, path, resp.status, text[:300]
                    )
                    return None
                try:
                    return json.loads(text) if text else {}
                except json.JSONDecodeError:
                    return {}
        except (TimeoutError, aiohttp.ClientError) as e:
            log.warning("%s%s failed: %s", state.server.url, path, e)
            return None

    async def _get(self, state: _ServerState, path: str) -> dict:
        async with self._session.get(f"{state.server.url}{path}") as resp:
            return json.loads(await resp.text()) if resp.status == 200 else {}
