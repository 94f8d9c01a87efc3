"""The remote engine's client of vLLM's HTTP server (``engine.remote.server=vllm``): the
``ServerApi`` (``asyncrl.engine.server_api``) that ``RemoteEngine`` drives vLLM with, and
what it sends to and reads from vLLM. asyncrl's front (``asyncrl.engine.serve``, with the
routes of ``asyncrl.engine.vllm_api``) answers the same, so this client is tested on CPU.

Written against vLLM 0.33.0 (``TESTED_VLLM``); a server whose ``GET /version`` is outside
``SUPPORTED_VLLM`` is refused at attach, naming both versions. Checked against vLLM's
source and docs: ``vllm/entrypoints/openai/completion/protocol.py`` (the request),
``vllm/entrypoints/serve/dev/rlhf/api_router.py`` (``/pause``, ``/resume``,
``/is_paused``, ``/abort_requests``, ``/update_weight_version``, ``/weight_info``, and
the weight-transfer calls), the dev RPC router (``/collective_rpc``), and the docs'
"Async Reinforcement Learning" page (pause modes). The RL routes exist only when the
server runs with ``VLLM_SERVER_DEV_MODE=1``; launched servers get it.

- **Requests.** One non-streamed ``POST /v1/completions`` per attempt: ``prompt`` as
  token ids, ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (-1: all), ``seed``
  (the sample's, keyed by the attempt's prompt length), ``stop``, ``stop_token_ids``, ``logprobs: 0`` (the chosen token's only) and
  ``return_token_ids``. The choice's ``token_ids[i]`` and ``logprobs.token_logprobs[i]``
  are one token; ``finish_reason`` is ``stop`` (EOS when ``stop_reason`` is null or an
  EOS id, else the stop token id or string), ``length`` or ``abort``.
- **Logprobs.** vLLM reports the raw model's ``log_softmax(logits)`` by default; the
  trainer recomputes ``log_softmax(logits / T)``. Launched servers get
  ``--logprobs-mode processed_logprobs``: the logprobs of the distribution sampled from,
  after temperature and after top-k/top-p (vLLM's ``TopKTopPSampler``), so they equal the
  trainer's recomputation when top-k and top-p are off (the RL experiments' setting);
  with them on, they are of the renormalised truncated distribution. Attach only to
  servers started with that flag (``server_command`` shows the full line).
- **Versions.** vLLM reports no weights version per token, so this client stamps each
  attempt's tokens with the version its server ran when the attempt was sent, which is
  exact because it makes the updates itself and drains the server around each one:
  ``POST /pause?mode=abort`` (requests in flight end with finish reason abort and their
  tokens so far, and are resent as prompt + tokens), then the engine waits until no
  attempt is in flight on that server, closing the connections of any that are still
  waiting (a request that reached the server after the pause is held there; vLLM drops
  a request whose connection closes), so no attempt spans the change. asyncrl's front
  also returns ``token_versions`` per choice; when present they are used instead.
- **Weights from disk.** ``POST /collective_rpc`` {``method: "reload_weights"``,
  ``kwargs: {"weights_path"}``} loads the HF directory; ``POST /update_weight_version``
  {``new_version``} labels it (read back by ``GET /weight_info`` at attach); ``POST
  /resume``. The pause's ``clear_cache=true`` empties the prefix cache, so nothing
  computed by the old weights is reused. vLLM's NCCL weight transfer (``POST
  /init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``, the tensors broadcast by the trainer with
  ``vllm.distributed.weight_transfer``) is what ``weight_update=nccl`` drives (``gloo``
  against asyncrl's front, which receives over gloo): the pause and drain as above, then
  the trainer sends the version into this server when asked (the ``WeightsPush``;
  ``asyncrl.trainer.publish_vllm`` makes those calls), then ``/resume``. A server whose
  transfer failed part-way is left paused and gets no request until one succeeds; a
  server found paused at attach (``GET /is_paused``: its generator died meanwhile) is
  treated the same.
  Launched servers get ``--weight-transfer-config {"backend": "nccl"}``.
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
from asyncrl.engine.server_api import Attempt, AttemptEnd, NewTokens
from asyncrl.engine.sglang_api import as_version
from asyncrl.seeds import derive_seed

log = logging.getLogger("asyncrl.remote")

TESTED_VLLM = "0.33.0"
"""The vLLM release this client was written against (and asyncrl's front reports)."""
SUPPORTED_VLLM = ((0, 32), (0, 34))
"""Accepted ``/version``: from the first (major, minor) included to the second excluded.
0.32 is the first release whose docs give ``/pause`` its ``mode`` parameter."""


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as ``0.33.1.dev4+g1234``."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", text or "")
    return (int(match[1]), int(match[2])) if match else None


def check_version(url: str, reported: object) -> None:
    """Raise RuntimeError unless ``reported`` (``GET /version``'s ``version``) is in
    ``SUPPORTED_VLLM``; the message names both versions."""
    low, high = SUPPORTED_VLLM
    parsed = parse_version(reported if isinstance(reported, str) else "")
    if parsed is None or not low <= parsed < high:
        supported = f">={low[0]}.{low[1]},<{high[0]}.{high[1]} (written against {TESTED_VLLM})"
        raise RuntimeError(
            f"the vLLM server at {url} reports version {reported!r}; asyncrl's vLLM "
            f"client supports vLLM {supported}"
        )


def completion_payload(
    model: str, input_ids: list[int], params: SamplingParams, max_new_tokens: int
) -> dict:
    """The body of one ``/v1/completions`` attempt (non-streamed)."""
    body = {
        "model": model,
        "prompt": input_ids,
        "max_tokens": max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "logprobs": 0,
        "return_token_ids": True,
    }
    if params.seed is not None:  # keyed by where it starts: a resumed attempt draws afresh
        body["seed"] = derive_seed(params.seed, len(input_ids))
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        body["stop"] = list(params.stop)
    return body


def read_choice(choice: dict, version: int, eos_ids: set[int]) -> tuple[NewTokens, AttemptEnd]:
    """The tokens of a completion choice and how it ended. Raises ValueError when the
    choice lacks token ids or logprobs (a server started without them)."""
    ids = choice.get("token_ids")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(ids, list) or not isinstance(logprobs, list) or len(ids) != len(logprobs):
        raise ValueError(f"a choice without token_ids and their logprobs: {choice!r:.300}")
    if any(lp is None for lp in logprobs):
        raise ValueError(f"a choice with a null logprob: {choice!r:.300}")
    versions = choice.get("token_versions") or []
    if len(versions) != len(ids):  # vLLM's own: the version the server ran (see above)
        versions = [version] * len(ids)
    tokens = [
        (int(t), float(lp), as_version(v, version)) for t, lp, v in zip(ids, logprobs, versions)
    ]
    reason, stop = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "stop":
        if isinstance(stop, str):
            return tokens, AttemptEnd("stop", matched=stop)
        eos = stop is None or stop in eos_ids
        return tokens, AttemptEnd("eos" if eos else "stop")
    if reason in ("length", "abort"):
        return tokens, AttemptEnd(reason)
    raise ValueError(f"unknown finish_reason {reason!r}")


class VllmServerApi:
    """vLLM's OpenAI-compatible and RL routes (see the module's docstring)."""

    def __init__(self, eos_ids: set[int]) -> None:
        self.eos_ids = eos_ids
        self.models: dict[str, str] = {}
        """Served model name of each server (``/v1/models``), sent as ``model``."""

    async def attach(self, session: aiohttp.ClientSession, state: ServerState) -> None:
        """A server found paused is taken as torn: this client leaves one paused only
        when a transfer into it may have failed part-way, and its generator may have died
        before the next one. A paused vLLM holds the requests sent to it, so it gets none
        until an update succeeds and resumes it."""
        url = state.server.url
        check_version(url, (await get_json(session, url, "/version")).get("version"))
        models = (await get_json(session, url, "/v1/models")).get("data") or []
        if not models:
            raise RuntimeError(f"the vLLM server at {url} lists no model on /v1/models")
        self.models[url] = models[0]["id"]
        info = await get_json(session, url, "/weight_info")  # {} without dev mode
        state.version = as_version(info.get("weight_version"), state.version)
        if (await get_json(session, url, "/is_paused")).get("is_paused"):
            state.torn = True
            log.warning(
                "the vLLM server at %s is paused, its weights possibly mixed: it gets no "
                "request until the next weight update into it succeeds",
                url,
            )

    async def generate(
        self, session: aiohttp.ClientSession, state: ServerState, attempt: Attempt
    ) -> AttemptEnd:
        url, version = state.server.url, state.version  # exact: see "Versions" above
        body = completion_payload(
            self.models[url], attempt.input_ids, attempt.params, attempt.max_new_tokens
        )
        post = asyncio.ensure_future(_post(session, f"{url}/v1/completions", body))
        cancelled = asyncio.ensure_future(attempt.cancel.wait())
        await asyncio.wait({post, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        cancelled.cancel()
        if not post.done():  # closing the connection aborts the request in vLLM
            post.cancel()
            await asyncio.gather(post, return_exceptions=True)
            return AttemptEnd("abort")
        status, reply = post.result()
        if status != 200 or not isinstance(reply, dict) or not reply.get("choices"):
            if state.updating:  # failed by the update's pause: send it again
                return AttemptEnd("abort")
            log.warning("request %s refused by %s: %s %.300r", attempt.rid, url, status, reply)
            return AttemptEnd(None, error=True)
        tokens, end = read_choice(reply["choices"][0], version, self.eos_ids)
        if tokens:
            attempt.on_tokens(tokens)
        return end

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
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": path}}
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


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, object]:
    """(status, JSON reply or text) of a POST."""
    async with session.post(url, json=body) as resp:
        try:
            return resp.status, await resp.json(content_type=None)
        except ValueError:
            return resp.status, await resp.text()
