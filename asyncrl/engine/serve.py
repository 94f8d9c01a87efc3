"""An sglang-compatible HTTP server in front of the embedded engine.

asyncrl drives sglang over its native HTTP API; this server speaks the same API (sglang
0.5.x) on top of ``EmbeddedEngine``, so the sglang client runs and is tested on machines
without a GPU, and runs unchanged against a real sglang server. Start it with

    python -m asyncrl.engine.serve --model DIR --port 30000

This module is the HTTP layer (aiohttp) and the entry point. ``serve_engine.EngineServer``
owns the engine and the task that steps it, so requests from every connection batch
together; ``serve_protocol`` parses ``/generate`` bodies and shapes the responses, and
``openai_api`` adds OpenAI's endpoints on the same engine.

Endpoints (sglang's names and shapes; see serve_protocol for ``/generate``):
``POST /generate``, ``POST /abort_request`` (``rid`` or ``abort_all``),
``POST /pause_generation``, ``POST /continue_generation``, ``POST
/update_weights_from_disk``, ``GET /get_weight_version``, ``GET /get_model_info``,
``GET /get_server_info``, ``GET /health`` and ``/health_generate``, ``GET|POST
/flush_cache``, ``POST /slow_down``; and OpenAI's (vLLM's flavour, see
``asyncrl.engine.openai_api``): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``; and vLLM's RL routes (``asyncrl.engine.vllm_api``): ``GET /version``,
``POST /pause``, ``/resume``, ``/abort_requests``, ``/collective_rpc`` (reload_weights),
``/update_weight_version``, ``GET /weight_info``, ``/is_paused``, and vLLM's weight
transfer over gloo (``asyncrl.engine.vllm_transfer``).

Where this server departs from sglang, and why:

- ``meta_info["output_token_versions"]`` (not in sglang) gives each token's weight
  version: the RL trainer needs a version per token, sglang reports one per response.
  ``weight_version`` is the version of the latest token's weights. Versions are sglang's
  strings (``--weight-version``, default ``"default"``; an update without a
  ``weight_version`` keeps the label, as sglang does).
- ``/update_weights_from_disk`` does not wait for in-flight requests to finish (sglang
  holds a lock until they do): the weights are read off the decode path and flipped in
  between two steps, so running sequences switch versions mid-sequence (their cache is
  recomputed, ``flip_policy="recompute"``). ``abort_all_requests`` is honoured.
- ``/pause_generation`` takes sglang's ``mode``: ``"abort"`` (the default, and the only
  behaviour of sglang before modes existed) aborts every in-flight request, returning
  its tokens so far; ``"in_place"`` and ``"retract"`` keep them (retract equals in_place
  here: the embedded cache survives a pause). In every mode no step runs until
  ``/continue_generation``; new requests are accepted and wait.
- ``/slow_down`` (sglang's testing aid) sleeps ``forward_sleep_time`` s after each step.
- Stop strings are looked for in the completion decoded with special tokens skipped
  (vLLM's way; sglang's check sees their text too), so a special token is stopped at
  with ``stop_token_ids``, never with a string.
- Not implemented: batch requests (a list of prompts), stop regexes, ``ignore_eos``,
  penalties, prompt and top logprobs, ``max_new_tokens=0`` (all answered with 400);
  weights load from ``*.safetensors`` only (``load_format`` is ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import msgspec
from aiohttp import web

from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.openai_api import OpenAIApi
from asyncrl.engine.serve_engine import EngineServer, Flight
from asyncrl.engine.serve_protocol import BadRequest, parse_generate, read_json
from asyncrl.engine.vllm_api import FRONT_VLLM, VllmApi

log = logging.getLogger("asyncrl.serve")


# ---- HTTP ----------------------------------------------------------------------------------
SERVER: web.AppKey[EngineServer] = web.AppKey("server", EngineServer)


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )


def _generate_error(message: str) -> web.Response:
    return _json({"error": {"message": message}}, 400)  # sglang's shape for /generate


def _body_error(message: str) -> web.Response:
    # sglang's shape for a request body that fails validation (FastAPI's, made a 400).
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None}
    return _json({**body, "code": 400}, 400)


async def generate(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    try:
        inp = parse_generate(
            await read_json(request),
            vocab_size=server.vocab_size,
            max_seq_len=server.engine.max_seq_len,
            encode=server.tokenizer.encode,
        )
        flight = server.submit(inp)
    except BadRequest as exc:
        return _generate_error(str(exc))
    except RuntimeError as exc:  # the engine failed: /health reads 503 too
        return _json({"error": {"message": str(exc)}}, 503)
    try:
        if not inp.stream:
            while flight.gen.finish_reason is None:
                await flight.changed.wait()
                flight.changed.clear()
            return _json(server.response(flight))
        return await _stream(request, server, flight)
    finally:
        if flight.gen.finish_reason is None:  # the client went away
            server.abort_soon(inp.rid, "client disconnected")


async def _stream(request: web.Request, server: EngineServer, flight: Flight) -> web.StreamResponse:
    """Server-sent events, ``data: {json}\\n\\n`` each, cumulative, then ``data: [DONE]``."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    sent = 0
    while True:
        await flight.changed.wait()
        flight.changed.clear()
        gen = flight.gen
        done = gen.finish_reason is not None
        if done or len(gen.output_ids) - sent >= gen.input.stream_interval:
            sent = len(gen.output_ids)
            await response.write(b"data: " + msgspec.json.encode(server.response(flight)) + b"\n\n")
        if done:
            break
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def abort_request(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    try:
        body = await read_json(request)
    except BadRequest as exc:
        return _body_error(str(exc))
    rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(abort_all, bool):
        return _body_error("rid must be a string and abort_all a boolean")
    if abort_all:
        await server.abort_all()
    elif rid:
        await server.abort(rid)  # an unknown or finished rid is ignored, as in sglang
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.Response:
    try:
        mode = (await read_json(request, empty_ok=True)).get("mode", "abort")
    except BadRequest as exc:
        return _body_error(str(exc))
    if mode not in ("abort", "retract", "in_place"):
        return _body_error(f"mode must be one of abort, retract, in_place; got {mode!r}")
    await request.app[SERVER].pause(mode)
    return _json({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await request.app[SERVER].resume()
    return _json({"message": "Generation continued successfully.", "status": "ok"})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    try:
        body = await read_json(request)
    except BadRequest as exc:
        return _body_error(str(exc))
    path, label = body.get("model_path"), body.get("weight_version")
    if not isinstance(path, str) or (label is not None and not isinstance(label, str)):
        return _body_error(f"model_path and weight_version must be strings: {body!r:.200}")
    if body.get("abort_all_requests"):
        await server.abort_all("Aborted by /update_weights_from_disk")
    try:
        await server.update_weights(path, label)
    except (ValueError, OSError, RuntimeError) as exc:  # as sglang: a failure is a 400
        failure = {"success": False, "message": f"Failed to update weights: {exc}"}
        return _json({**failure, "num_paused_requests": 0}, 400)
    message = "Succeeded to update model weights."
    if label is not None:
        message += f" Weight version updated to {label}."
    log.info("weights from %s, version %s", path, server.weight_version)
    return _json({"success": True, "message": message, "num_paused_requests": 0})


async def get_weight_version(request: web.Request) -> web.Response:
    return _json({"weight_version": request.app[SERVER].weight_version})


async def get_model_info(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    return _json(
        {
            "model_path": server.model_path,
            "tokenizer_path": server.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": server.weight_version,
        }
    )


async def get_server_info(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    stats = {**server.engine.status().metrics, "paused": server.paused}
    return _json(
        {
            "model_path": server.model_path,
            "tokenizer_path": server.tokenizer_path,
            "max_running_requests": server.engine.cfg.max_slots,
            "context_length": server.engine.max_seq_len,
            "weight_version": server.weight_version,
            "internal_states": [stats],
            "version": "asyncrl-embedded",
        }
    )


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[SERVER].healthy else 503)


async def flush_cache(request: web.Request) -> web.Response:
    # The embedded engine keeps no prefix cache between requests: nothing to flush.
    return web.Response(text="Cache flushed.\n")


async def slow_down(request: web.Request) -> web.Response:
    try:
        seconds = (await read_json(request)).get("forward_sleep_time")
    except BadRequest as exc:
        return _body_error(str(exc))
    if seconds is not None and (not isinstance(seconds, int | float) or seconds < 0):
        return _body_error(f"forward_sleep_time must be a number >= 0 or null, got {seconds!r}")
    request.app[SERVER].sleep_after_step = float(seconds or 0.0)
    return _json(None)


def build_app(server: EngineServer, vllm_version: str = FRONT_VLLM) -> web.Application:
    """The front's routes; vLLM's as release ``vllm_version`` answers them."""
    app = web.Application(client_max_size=256 * 1024**2)
    app[SERVER] = server
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_get("/get_weight_version", get_weight_version)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_post("/slow_down", slow_down)
    OpenAIApi(server, vllm_version).add_routes(app)
    VllmApi(server, vllm_version).add_routes(app)  # vLLM's RL routes: /version, /pause, ...
    return app


# ---- entry point ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # The second spelling of each option is sglang's launch_server flag.
    p.add_argument("--model", "--model-path", dest="model", required=True, help="HF model dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-slots", "--max-running-requests", dest="max_slots", type=int, default=64)
    p.add_argument("--max-seq-len", "--context-length", dest="max_seq_len", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--weight-version", default="default", help="label of the initial weights")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--vllm-version",
        default=FRONT_VLLM,
        help="the vLLM release whose API the vLLM routes answer as (0.32: requests wait out a "
        "pause, no weight_versions; 0.33 on: 503 while paused, weight_versions)",
    )
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM (exit status 0) or an engine failure (1)."""
    cfg = EmbeddedEngineConfig(
        max_slots=args.max_slots,
        max_seq_len=args.max_seq_len,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
    )
    engine = EmbeddedEngine(args.model, cfg)
    server = EngineServer(engine, args.model, args.weight_version)
    app = build_app(server, args.vllm_version)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stepping = asyncio.create_task(server.run())
    stopping = asyncio.create_task(stop.wait())
    log.info("ready: http://%s:%d (model %s)", args.host, args.port, args.model)
    await asyncio.wait([stepping, stopping], return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down")
    failed = stepping.done()
    if failed:
        stepping.exception()  # logged by run(); retrieved so asyncio does not warn again
    server.healthy = False
    if not failed:
        await server.abort_all("server shutting down", 503)  # open streams end cleanly
        stepping.cancel()
    stopping.cancel()
    await runner.cleanup()
    server.close()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sys.exit(asyncio.run(serve(args)))


if __name__ == "__main__":
    main()
