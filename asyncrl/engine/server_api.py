"""How the remote engine talks to one kind of inference server: the ``ServerApi``
strategy, and sglang's implementation of it.

``RemoteEngine`` (``asyncrl.engine.remote``) owns the queue, the servers' load, the
resending of interrupted requests and the caller's view; ``ServerUpdates``
(``asyncrl.engine.remote_weights``) decides when each server loads which weights. What
differs between sglang and vLLM is behind these four calls, one object per engine, picked
by ``engine.remote.server`` (``server_api``):

- ``attach``: check a server (its version) and learn the weights version it runs, and
  whether it is paused with weights that may be mixed (torn);
- ``generate``: one attempt of a request, its tokens reported as they arrive, each with
  its logprob and weights version;
- ``abort``: end one attempt early (its ``generate`` then returns finish reason abort);
- ``load_weights``: bring one server to an HF directory, or to what the trainer sends it
  (a ``WeightsPush``, vLLM only), interrupting what it runs.

``SglangServerApi`` speaks sglang's native API (``asyncrl.engine.sglang_api``, which also
reads asyncrl's own front); ``VllmServerApi`` (``asyncrl.engine.vllm_client``) speaks
vLLM's. Both servers and asyncrl's front (``asyncrl.serving.serve``) answer JSON only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from asyncrl.engine import sglang_api as api
from asyncrl.engine.base import SamplingParams, WeightsPush
from asyncrl.engine.remote_weights import ServerState, get_json, post_json

log = logging.getLogger("asyncrl.remote")

NewTokens = list[tuple[int, float, int]]
"""``(token_id, logprob, version)`` per token, in generation order."""


@dataclass
class Attempt:
    """One attempt of a request: what to send, and how to report its progress."""

    rid: str
    """The server's id of this attempt."""
    input_ids: list[int]
    """The prompt plus the tokens earlier attempts generated."""
    params: SamplingParams
    max_new_tokens: int
    on_tokens: Callable[[NewTokens], None]
    """Called with each batch of new tokens, in order."""
    cancel: asyncio.Event
    """Set to end the attempt early (``abort``, or a weight update draining the server)."""


@dataclass
class AttemptEnd:
    reason: str | None
    """asyncrl's finish reason (``eos``, ``stop``, ``length``, ``abort``); None when the
    response ended without one."""
    matched: str | None = None
    """The stop string that ended it, when one did."""
    error: bool = False
    """The server refused the request: it is not sent again."""
    lost: str = ""
    """Why the server failed the attempt (a dropped connection, a server error): the
    attempt is sent again, and the server is checked (``ServerWatch``)."""


class ServerApi(Protocol):
    async def attach(self, session: aiohttp.ClientSession, state: ServerState) -> None:
        """Check ``state``'s server (RuntimeError when it cannot be driven) and set the
        weights version it runs (left as is when it reports none) and ``torn`` when it
        is paused (a generator that failed a transfer into it, then died)."""
        ...

    async def generate(
        self, session: aiohttp.ClientSession, state: ServerState, attempt: Attempt
    ) -> AttemptEnd:
        """Run ``attempt`` on ``state``'s server. Raises ``TimeoutError``,
        ``aiohttp.ClientError`` or ``ValueError`` when the server stops answering."""
        ...

    def group_size(self, url: str, params: SamplingParams) -> int:
        """How many attempts of one input and ``params`` one call to ``generate_group`` may
        carry (1: each goes alone, through ``generate``)."""
        ...

    async def generate_group(
        self, session: aiohttp.ClientSession, state: ServerState, attempts: list[Attempt]
    ) -> list[AttemptEnd]:
        """Run attempts of one input and sampling as one request; their ends, in order.
        Called only with at most ``group_size`` of them."""
        ...

    async def abort(self, session: aiohttp.ClientSession, url: str, rid: str) -> None:
        """Ask the server to end attempt ``rid`` (after its ``cancel`` event was set)."""
        ...

    async def load_weights(
        self,
        session: aiohttp.ClientSession,
        state: ServerState,
        path: str | WeightsPush,
        version: int,
        drain: Callable[[ServerState], Awaitable[None]],
    ) -> bool:
        """Have the server load the HF directory ``path`` (or what the ``WeightsPush``
        sends) as ``version``; True once it confirms. ``drain(state)`` returns once no
        attempt is in flight on the server."""
        ...


class SglangServerApi:
    """sglang's native API (0.5.0 to 0.5.23, by version: ``asyncrl.engine.sglang_api``),
    and asyncrl's sglang-compatible front."""

    def __init__(self, eos_ids: set[int]) -> None:
        self.eos_ids = eos_ids
        self.servers: dict[str, api.SglangServer] = {}
        """What each server is (its version, whether it applies seeds), by URL."""

    async def attach(self, session: aiohttp.ClientSession, state: ServerState) -> None:
        """``/server_info`` (refused outside the supported versions), then the weights
        label from ``/model_info``."""
        url = state.server.url
        server = api.read_server(url, await get_json(session, url, "/server_info"))
        if not server.seeded and url not in self.servers:
            log.warning(
                "the sglang server at %s runs without --enable-deterministic-inference, so "
                "it ignores sampling_seed: its requests are sampled without seeds and are "
                "not reproducible",
                url,
            )
        self.servers[url] = server
        info = await get_json(session, url, "/model_info")
        state.version = api.as_version(info.get("weight_version"), state.version)

    async def generate(
        self, session: aiohttp.ClientSession, state: ServerState, attempt: Attempt
    ) -> AttemptEnd:
        """One streaming ``/generate``. A token's version is the server's report (per token
        from asyncrl's front, per chunk from sglang: exact, since an update first ends
        every request in flight)."""
        url, seen, end = state.server.url, 0, AttemptEnd(None)
        payload = api.generate_payload(
            attempt.rid,
            attempt.input_ids,
            attempt.params,
            attempt.max_new_tokens,
            self.servers[url],
        )
        async with session.post(f"{url}/generate", json=payload) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                log.warning("request %s refused by %s: %s %s", attempt.rid, url, resp.status, text)
                return AttemptEnd(None, error=True)
            async for chunk in api.events(resp.content):
                if "error" in chunk:
                    log.warning("request %s failed on %s: %s", attempt.rid, url, chunk["error"])
                    return AttemptEnd(None, error=True)
                meta = chunk.get("meta_info", {})
                version = api.as_version(meta.get("weight_version"), state.version)
                new, seen = api.new_tokens(meta, seen, version)
                if new:
                    attempt.on_tokens(new)
                if meta.get("finish_reason"):
                    reason, error = api.finish_reason(meta["finish_reason"], self.eos_ids)
                    end = AttemptEnd(reason, api.matched_stop(meta["finish_reason"]), error)
                    if error:
                        why = meta["finish_reason"]
                        log.warning("request %s aborted by %s: %s", attempt.rid, url, why)
                        return end
        return end

    def group_size(self, url: str, params: SamplingParams) -> int:
        """One each: a streamed ``/generate`` carries one sample."""
        return 1

    async def generate_group(
        self, session: aiohttp.ClientSession, state: ServerState, attempts: list[Attempt]
    ) -> list[AttemptEnd]:
        return [await self.generate(session, state, attempts[0])]

    async def abort(self, session: aiohttp.ClientSession, url: str, rid: str) -> None:
        """sglang aborts the request of exactly ``rid`` and every one whose rid starts with
        it: the engine's are prefix-free (``remote_requests.server_rid``)."""
        await post_json(session, url, "/abort_request", {"rid": rid})  # the stream ends "abort"

    async def load_weights(
        self,
        session: aiohttp.ClientSession,
        state: ServerState,
        path: str | WeightsPush,
        version: int,
        drain: Callable[[ServerState], Awaitable[None]],
    ) -> bool:
        if not isinstance(path, str):  # RLExperiment.check_remote allows no such setting
            raise TypeError("sglang servers take weights from disk or from the NCCL publisher")
        # Pausing ends the requests in flight (finish reason abort; they are resent). The
        # responses carry versions, so nothing needs draining.
        url = state.server.url
        try:
            await post_json(session, url, "/pause_generation", {"mode": "abort"})
            body = await post_json(
                session,
                url,
                "/update_weights_from_disk",
                {"model_path": path, "weight_version": str(version)},
            )
            return body is not None and body.get("success", True)
        finally:
            await post_json(session, url, "/continue_generation", {})
