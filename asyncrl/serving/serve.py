"""An sglang-compatible HTTP server in front of the embedded engine.

asyncrl drives sglang over its native HTTP API; this server speaks the same API on top
of ``EmbeddedEngine``, answering as one sglang release (``--sglang-version``, default
0.5.23, the newest the client supports), so the sglang client runs and is tested on
machines without a GPU, and runs unchanged against a real sglang server. Start it with

    python -m asyncrl.serving.serve --model DIR --port 30000

This module is the HTTP layer (aiohttp) and the entry point. ``serve_engine.EngineServer``
owns the engine and the task that steps it, so requests from every connection batch
together; ``serve_protocol`` parses ``/generate`` bodies and shapes the responses;
``sglang_routes`` has sglang's other routes, and ``openai_api`` adds OpenAI's endpoints
on the same engine.

Endpoints (sglang's names and shapes): ``POST /generate`` (``serve_protocol``), and
(``sglang_routes``) ``POST /abort_request`` (``rid``, matched by prefix as sglang does,
or ``abort_all``), ``POST /pause_generation``, ``POST /continue_generation``, ``POST
/update_weights_from_disk``, ``GET /model_info``, ``GET /server_info`` (``version``),
their deprecated ``/get_`` aliases, ``GET /health`` and ``/health_generate``, ``GET|POST
/flush_cache``, ``POST /slow_down``; and OpenAI's (vLLM's flavour, see
``asyncrl.serving.openai_api``): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``; and vLLM's RL routes (``asyncrl.serving.vllm_api``): ``GET /version``,
``POST /pause``, ``/resume``, ``/abort_requests``, ``/collective_rpc`` (reload_weights),
``/update_weight_version``, ``GET /weight_info``, ``/is_paused``, and vLLM's weight
transfer over gloo (``asyncrl.serving.vllm_transfer``). ``GET /server_info`` answers
sglang's keys and vLLM's in one object.

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
- An unknown ``sampling_params`` key (vLLM's ``seed``) is a 400 naming it; sglang
  answers 500 (its ``SamplingParams(**keys)`` raises a TypeError it does not catch).
- Not implemented: batch requests (a list of prompts), stop regexes, ``ignore_eos``,
  penalties, prompt and top logprobs, ``max_new_tokens=0`` (all answered with 400);
  weights load from ``*.safetensors`` only (``load_format`` is ignored); sglang's
  distributed weight updates (``/init_weights_update_group``,
  ``/update_weights_from_distributed``, and the ``/begin_weight_update`` …
  ``/end_weight_update`` session 0.5.21 requires around them): 404.
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
from asyncrl.serving.openai_api import OpenAIApi, json_response
from asyncrl.serving.serve_engine import EngineServer, Flight
from asyncrl.serving.serve_protocol import BadRequest, parse_generate, read_json
from asyncrl.serving.sglang_routes import FRONT_SGLANG, SglangRoutes
from asyncrl.serving.vllm_api import FRONT_VLLM, VllmApi

log = logging.getLogger("asyncrl.serve")


# ---- HTTP ----------------------------------------------------------------------------------
SERVER: web.AppKey[EngineServer] = web.AppKey("server", EngineServer)


def _generate_error(message: str) -> web.Response:
    return json_response({"error": {"message": message}}, 400)  # sglang's shape for /generate


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
        return json_response({"error": {"message": str(exc)}}, 503)
    try:
        if not inp.stream:
            while flight.gen.finish_reason is None:
                await flight.changed.wait()
                flight.changed.clear()
            return json_response(server.response(flight))
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


def _server_info(sglang: SglangRoutes, vllm: VllmApi):
    """``GET /server_info``, which sglang and vLLM both serve: one object with both
    answers (their keys differ), sglang's server arguments and ``version``, vLLM's
    ``vllm_config``. sglang's deprecated ``/get_server_info`` is the same."""

    async def server_info(request: web.Request) -> web.Response:
        vllm_info = msgspec.json.decode((await vllm.server_info(request)).body)
        return json_response({**vllm_info, **sglang.server_info_body()})

    return server_info


def build_app(
    server: EngineServer, vllm_version: str = FRONT_VLLM, sglang_version: str = FRONT_SGLANG
) -> web.Application:
    """The front's routes; sglang's as release ``sglang_version`` answers them, vLLM's as
    ``vllm_version``."""
    app = web.Application(client_max_size=256 * 1024**2)
    app[SERVER] = server
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    sglang, vllm = SglangRoutes(server, sglang_version), VllmApi(server, vllm_version)
    sglang.add_routes(app)
    # Before vLLM's own /server_info: aiohttp serves the first route added for a path.
    info = _server_info(sglang, vllm)
    app.router.add_get("/server_info", info)
    app.router.add_get("/get_server_info", info)
    OpenAIApi(server, vllm_version).add_routes(app)
    vllm.add_routes(app)  # vLLM's RL routes: /version, /pause, ...
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
    p.add_argument(
        "--sglang-version",
        default=FRONT_SGLANG,
        help="the sglang release whose API the sglang routes answer as (/server_info's "
        "version; before 0.5.21 /get_weight_version answers 404 with a pointer)",
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
    app = build_app(server, args.vllm_version, args.sglang_version)
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
