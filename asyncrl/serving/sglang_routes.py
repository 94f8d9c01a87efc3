"""sglang's control routes on the embedded engine's HTTP front (``asyncrl.serving.serve``),
answering as one sglang release: ``SglangRoutes(server, version).add_routes(app)``, the
release ``--sglang-version`` (default ``FRONT_SGLANG``, the newest the client supports).
``serve`` itself has ``/generate`` (``serve_protocol``); these are the rest of what the
remote engine's sglang client (``asyncrl.engine.server_api.SglangServerApi``) calls, and
the routes the tests use, with sglang's names, bodies and status codes (checked against
``python/sglang/srt/entrypoints/http_server.py`` of the releases in
``asyncrl.engine.sglang_api``):

- ``POST /abort_request`` {``rid``} or {``abort_all``}: the request of exactly ``rid``,
  if one is in flight, and every request whose rid starts with it (``EngineServer.abort``).
- ``POST /pause_generation`` {``mode``}, ``POST /continue_generation``: see ``serve``.
- ``POST /update_weights_from_disk`` {``model_path``, ``weight_version``, …}.
- ``GET /model_info`` (and its deprecated alias ``/get_model_info``): ``weight_version``.
- ``GET /server_info`` (and ``/get_server_info``): ``server_info_body``, sglang's server
  arguments plus ``version`` and ``internal_states`` (the engine's gauges).
- ``GET /get_weight_version``, ``/weight_version``: 404, as sglang answers since 0.5.10
  (with a ``detail`` naming ``/model_info`` before 0.5.21, which removed them).
- ``GET /health``, ``/health_generate``; ``GET|POST /flush_cache``; ``POST /slow_down``.

Not served: ``/init_weights_update_group``, ``/update_weights_from_distributed`` and the
``/begin_weight_update`` … ``/end_weight_update`` session around them (0.5.21 on): the
front takes weights from disk, or by vLLM's transfer over gloo (``vllm_transfer``).
"""

from __future__ import annotations

import logging

from aiohttp import web

from asyncrl.engine.sglang_api import parse_version
from asyncrl.serving.openai_api import json_response
from asyncrl.serving.serve_engine import EngineServer
from asyncrl.serving.serve_protocol import BadRequest, read_json

log = logging.getLogger("asyncrl.serve")

FRONT_SGLANG = "0.5.23"
"""The release the front answers as unless told: the newest the client supports."""
WEIGHT_VERSION_GONE = (0, 5, 21)
"""The release that removed ``/get_weight_version`` (404 with a pointer before)."""


def body_error(message: str) -> web.Response:
    """sglang's answer to a request body that fails validation (FastAPI's, made a 400)."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None}
    return json_response({**body, "code": 400}, 400)


class SglangRoutes:
    """The handlers of sglang's control routes, on one ``EngineServer``, as ``version``."""

    def __init__(self, server: EngineServer, version: str = FRONT_SGLANG) -> None:
        parsed = parse_version(version)
        if parsed is None:
            raise ValueError(f"--sglang-version: {version!r} is not a version such as 0.5.23")
        self.server, self.release, self.version_tuple = server, version, parsed

    def add_routes(self, app: web.Application) -> None:
        """Every route but ``/server_info``, which ``serve`` shares with vLLM's."""
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/pause_generation", self.pause_generation)
        app.router.add_post("/continue_generation", self.continue_generation)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/get_model_info", self.model_info)
        if self.version_tuple < WEIGHT_VERSION_GONE:
            app.router.add_get("/get_weight_version", self.weight_version)
            app.router.add_get("/weight_version", self.weight_version)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_route("*", "/flush_cache", self.flush_cache)
        app.router.add_post("/slow_down", self.slow_down)

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            return body_error(str(exc))
        rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            return body_error("rid must be a string and abort_all a boolean")
        if abort_all:
            await self.server.abort_all()
        elif rid:  # an empty rid is ignored, as in sglang
            await self.server.abort(rid)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            mode = (await read_json(request, empty_ok=True)).get("mode", "abort")
        except BadRequest as exc:
            return body_error(str(exc))
        if mode not in ("abort", "retract", "in_place"):
            return body_error(f"mode must be one of abort, retract, in_place; got {mode!r}")
        await self.server.pause(mode)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.server.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            return body_error(str(exc))
        path, label = body.get("model_path"), body.get("weight_version")
        if not isinstance(path, str) or (label is not None and not isinstance(label, str)):
            return body_error(f"model_path and weight_version must be strings: {body!r:.200}")
        if body.get("abort_all_requests"):
            await self.server.abort_all("Aborted by /update_weights_from_disk")
        try:
            await self.server.update_weights(path, label)
        except (ValueError, OSError, RuntimeError) as exc:  # as sglang: a failure is a 400
            failure = {"success": False, "message": f"Failed to update weights: {exc}"}
            return json_response({**failure, "num_paused_requests": 0}, 400)
        message = "Succeeded to update model weights."
        if label is not None:
            message += f" Weight version updated to {label}."
        log.info("weights from %s, version %s", path, self.server.weight_version)
        return json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def weight_version(self, request: web.Request) -> web.Response:
        detail = (
            "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
            "Please use '/model_info' instead."
        )
        return json_response({"detail": detail}, 404)

    async def model_info(self, request: web.Request) -> web.Response:
        server = self.server
        info = {
            "model_path": server.model_path,
            "tokenizer_path": server.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": server.weight_version,
        }
        return json_response(info)

    def server_info_body(self) -> dict:
        """sglang's ``/server_info``: the server's arguments (those of sglang's
        ``ServerArgs`` the front has), its gauges and the release it answers as. The
        front applies every request's ``sampling_seed``, which sglang does only with
        ``--enable-deterministic-inference``: it says so in those terms."""
        server = self.server
        stats = {**server.engine.status().metrics, "paused": server.paused}
        return {
            "model_path": server.model_path,
            "tokenizer_path": server.tokenizer_path,
            "device": server.engine.device.type,
            "max_running_requests": server.engine.cfg.max_slots,
            "context_length": server.engine.max_seq_len,
            "enable_deterministic_inference": True,
            "internal_states": [stats],
            "version": self.release,
        }

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.server.healthy else 503)

    async def flush_cache(self, request: web.Request) -> web.Response:
        # The embedded engine keeps no prefix cache between requests: nothing to flush.
        return web.Response(text="Cache flushed.\n")

    async def slow_down(self, request: web.Request) -> web.Response:
        """sglang's testing aid: sleep ``forward_sleep_time`` s after each step."""
        try:
            seconds = (await read_json(request)).get("forward_sleep_time")
        except BadRequest as exc:
            return body_error(str(exc))
        if seconds is not None and (not isinstance(seconds, int | float) or seconds < 0):
            return body_error(f"forward_sleep_time must be a number >= 0 or null, got {seconds!r}")
        self.server.sleep_after_step = float(seconds or 0.0)
        return json_response(None)
