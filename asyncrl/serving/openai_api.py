"""OpenAI's completion API, vLLM's flavour, on the embedded engine's HTTP server
(``asyncrl.serving.serve``): an agent or evaluation written against the ``openai`` client
runs on the embedded engine and gets back what RL needs (token ids, logprobs, versions).

``OpenAIApi(server, vllm_version).add_routes(app)`` adds ``POST /v1/completions``, ``POST
/v1/chat/completions`` and ``GET /v1/models``: each request is parsed and its response
shaped by ``asyncrl.serving.openai_protocol`` (which also says where this departs from
vLLM), and joins the ``EngineServer`` batch; its id is its ``rid``. A request that
reaches a vLLM front paused to abort or wait is refused with 503 (vLLM 0.33 on).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from aiohttp import web

from asyncrl.engine.vllm_requests import parse_version
from asyncrl.serving.openai_protocol import (
    Completion,
    chat_completion_body,
    completion_body,
    error_body,
    models_body,
    parse_chat,
    parse_completion,
)
from asyncrl.serving.serve_engine import EngineServer, Flight
from asyncrl.serving.serve_protocol import BadRequest, WrongType, decode_body


# ---- HTTP --------------------------------------------------------------------------------
def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )


def error_response(message: str, status: int = 400, param: str | None = None) -> web.Response:
    return json_response(error_body(message, status, param), status)


class OpenAIApi:
    """The OpenAI endpoints' handlers, on one ``EngineServer``."""

    def __init__(self, server: EngineServer, vllm_version: str = "0.34.0") -> None:
        self.server = server
        self.model = server.model_path
        """The served name: the model loaded at start (weight updates keep it)."""
        self.spans = (parse_version(vllm_version) or (0, 0)) >= (0, 33)
        """Whether ``return_weight_versions`` is answered (vLLM 0.33 on)."""

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)

    async def completions(self, request: web.Request) -> web.Response:
        return await self._answer(request, parse_completion, completion_body)

    async def chat_completions(self, request: web.Request) -> web.Response:
        return await self._answer(request, parse_chat, chat_completion_body)

    async def models(self, request: web.Request) -> web.Response:
        return json_response(models_body(self.model, self.server.engine.max_seq_len))

    async def _answer(self, request: web.Request, parse: Callable, shape: Callable) -> web.Response:
        if self.server.refusing:  # vLLM (0.33 on) paused to abort or wait
            return json_response(error_body(self.server.refusing, 503), 503)
        try:
            req = parse(decode_body(await request.read()), self.server)
            flights = [self.server.submit(one) for one in req.samples()]
        except BadRequest as exc:
            param = getattr(exc, "param", None)
            schema = getattr(exc, "schema", isinstance(exc, WrongType))
            return json_response(error_body(str(exc), 400, param, schema), 400)
        except RuntimeError as exc:  # the engine failed: /health reads 503 too
            return json_response(error_body(str(exc), 503), 503)
        try:
            for flight in flights:
                while flight.gen.finish_reason is None:
                    await flight.changed.wait()
                    flight.changed.clear()
        finally:
            for flight in flights:
                if flight.gen.finish_reason is None:  # the client went away
                    self.server.abort_soon(flight.gen.input.rid, "client disconnected")
        for flight in flights:
            finish = flight.gen.finish_reason
            if finish["type"] == "abort" and finish.get("status_code"):  # the server's failure
                status = finish["status_code"]
                return json_response(error_body(finish["message"], status), status)
        cs = [self._completion(flight, req.logprobs) for flight in flights]
        options = {"logprobs": req.logprobs, "return_token_ids": req.return_token_ids}
        if req.weight_versions and self.spans:
            options["weight_versions"] = True
        return json_response(shape(cs if req.n > 1 else cs[0], self.model, **options))

    def _completion(self, flight: Flight, logprobs: bool) -> Completion:
        gen, finish = flight.gen, flight.gen.finish_reason
        matched = finish.get("matched")
        stop_ids = gen.input.params.stop_token_ids
        # vLLM's stop_reason: a stop string or stop token id; None for EOS.
        stop_reason = matched if isinstance(matched, str) or matched in stop_ids else None
        texts = [self.server.decode([t], False) for t in gen.output_ids] if logprobs else []
        return Completion(
            id=gen.input.rid,
            text=self.server.response(flight)["text"],
            finish_reason=finish["type"],
            stop_reason=stop_reason,
            prompt_ids=list(gen.input.prompt_ids),
            token_ids=list(gen.output_ids),
            logprobs=list(gen.logprobs),
            token_texts=texts,
            versions=list(gen.versions),
        )
