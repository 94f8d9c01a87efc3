"""vLLM's server routes for RL, beyond the OpenAI ones, on the embedded engine's HTTP
front (``asyncrl.serving.serve``): with them the front answers what the remote engine's
vLLM client (``asyncrl.engine.vllm_client``) sends, so that client is tested on CPU
beside the real server. ``VllmApi(server, version).add_routes(app)`` adds them, answering
as vLLM release ``version`` (``--vllm-version``, default ``FRONT_VLLM``) where releases
differ; ``asyncrl.serving.openai_api`` serves ``/v1/completions`` (vLLM's
``return_token_ids`` and, from 0.33, ``weight_versions``), and its disconnect handling
is vLLM's abort: a request whose connection closes is aborted.

Routes, with vLLM's names and shapes (``vllm/entrypoints/rl/online/api_router.py``, the
dev routes ``.../serve/dev/rpc/`` and ``.../serve/dev/server_info/``; vLLM serves them
with ``VLLM_SERVER_DEV_MODE=1``, this front always):

- ``GET /version`` {``version``}: the release this front answers as.
- ``GET /server_info`` {``vllm_config``: a text naming the model and ``device_config``}.
- ``POST /pause?mode=abort|wait|keep&clear_cache=…`` {``status: "paused"``}: ``abort``
  ends every request in flight with finish reason abort and its tokens so far; ``wait``
  lets them finish first; ``keep`` freezes them. A new request waits for ``POST
  /resume`` {``status: "resumed"``} (0.32, and ``keep`` always), or (0.33 on, ``abort``
  and ``wait``) is refused with 503 and vLLM's "Generation is paused" error. ``GET
  /is_paused`` {``is_paused``}.
- ``POST /abort_requests`` {``request_ids``} ({} or [] aborts all) {``status:
  "aborted"``, ``aborted``: how many were asked}. A request id is the response's ``id``.
- ``POST /collective_rpc`` {``method: "reload_weights"``, ``kwargs: {"weights_path",
  "is_checkpoint_format"}``} {``results: [null]``}: load an HF directory (without
  ``weights_path``: the directory served now). No other method is implemented.
- ``POST /update_weight_version`` {``new_version``} {``success``, ``new_version``} and
  ``GET /weight_info`` {``weight_version``}: the label of the weights in use (the
  front's ``--weight-version`` at start, ``"default"`` unless given).
- ``POST /reset_prefix_cache``: 200; the embedded engine keeps no prefix cache.

Errors have vLLM's shape, ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status. vLLM's weight transfer (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/get_world_size``) is served over gloo instead of NCCL (``asyncrl.serving.vllm_transfer``).
Not implemented: ``/sleep``, ``/wake_up``, ``/weight_checker``, ``/pause/step`` (all 404).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from asyncrl.engine.vllm_requests import parse_version
from asyncrl.serving.openai_api import error_response, json_response
from asyncrl.serving.serve_engine import EngineServer
from asyncrl.serving.serve_protocol import BadRequest, read_json
from asyncrl.serving.vllm_transfer import FrontTransfer

FRONT_VLLM = "0.34.0"
"""The release the front answers as unless told: the newest the client supports."""
PAUSED = "Generation is paused. Please retry after it resumes."
"""vLLM's refusal (0.33 on) of a request that reaches a server paused to abort or wait."""
PAUSE_MODES = {"abort": "abort", "keep": "in_place", "wait": "in_place"}
"""vLLM's pause modes, as the ``EngineServer``'s (``wait`` first lets requests finish)."""


def _flag(value: str, name: str) -> bool:
    """A boolean query parameter, read as FastAPI reads one."""
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise BadRequest(f"{name} must be a boolean, got {value!r}")


class VllmApi:
    """The handlers of vLLM's RL routes, on one ``EngineServer``, as release ``version``."""

    def __init__(self, server: EngineServer, version: str = FRONT_VLLM) -> None:
        parsed = parse_version(version)
        if parsed is None:
            raise ValueError(f"--vllm-version: {version!r} is not a version such as 0.34.0")
        self.server, self.release, self.version_tuple = server, version, parsed

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/version", self.version)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_get("/is_paused", self.is_paused)
        app.router.add_post("/abort_requests", self.abort_requests)
        app.router.add_post("/collective_rpc", self.collective_rpc)
        app.router.add_post("/update_weight_version", self.update_weight_version)
        app.router.add_get("/weight_info", self.weight_info)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        FrontTransfer(self.server, self.version_tuple).add_routes(app)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": self.release})

    async def server_info(self, request: web.Request) -> web.Response:
        device = self.server.engine.device.type
        config = f"model={self.server.model_path!r}, device_config={device}"
        return json_response({"vllm_config": config, "vllm_env": {}, "system_env": {}})

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            why = f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}"
            return error_response(why, param="mode")
        try:
            _flag(request.query.get("clear_cache", "true"), "clear_cache")  # no cache here
        except BadRequest as exc:
            return error_response(str(exc), param="clear_cache")
        if mode != "keep" and self.version_tuple >= (0, 33):
            self.server.refusing = PAUSED  # new requests get a 503 from here on
        if mode == "wait":
            while self.server.flights:  # new requests keep coming until the pause
                await asyncio.sleep(0.01)
        await self.server.pause(PAUSE_MODES[mode])
        return json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.server.refusing = None
        await self.server.resume()
        return json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return json_response({"is_paused": self.server.paused})

    async def abort_requests(self, request: web.Request) -> web.Response:
        try:
            ids = (await read_json(request, empty_ok=True)).get("request_ids")
        except BadRequest as exc:
            return error_response(str(exc))
        if ids and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            return error_response("request_ids must be a list of strings", param="request_ids")
        if not ids:
            ids = list(self.server.flights)
            await self.server.abort_all("Aborted by /abort_requests")
        else:
            for rid in ids:  # an unknown or finished id is ignored, as in vLLM
                await self.server.abort(rid, "Aborted by /abort_requests")
        return json_response({"status": "aborted", "aborted": len(ids)})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, empty_ok=True)
        except BadRequest as exc:
            return error_response(str(exc))
        if body.get("method") != "reload_weights":
            why = f"method {body.get('method')!r} is not implemented (only reload_weights)"
            return error_response(why, param="method")
        kwargs = body.get("kwargs") or {}
        path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
        if path is not None and not isinstance(path, str):
            return error_response("kwargs.weights_path must be a string", param="kwargs")
        unknown = set(kwargs) - {"weights_path", "is_checkpoint_format"}
        if unknown:  # vLLM's worker method takes no others
            why = f"reload_weights() got unexpected keyword arguments {sorted(unknown)}"
            return error_response(why, 500)
        try:
            await self.server.update_weights(path or self.server.model_path, None)
        except (ValueError, OSError, RuntimeError) as exc:
            return error_response(f"reload_weights failed: {exc}", 500)
        return json_response({"results": [None]})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            label = (await read_json(request, empty_ok=True)).get("new_version")
        except BadRequest as exc:
            return error_response(str(exc))
        if not isinstance(label, str):
            return error_response(
                f"new_version must be a string, got {label!r:.80}", param="new_version"
            )
        self.server.labels[self.server.engine.version] = label
        return json_response({"success": True, "new_version": label})

    async def weight_info(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.server.weight_version})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.Response(status=200)
