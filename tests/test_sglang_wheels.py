"""asyncrl's calls to sglang, checked against each pinned release's own route table and
request types (``tests/sglang_wheels.py`` parses them from the released wheels, which
``tools/sglang_wheels.sh`` fetches; skipped when they cannot be fetched, unless
``ASYNCRL_REQUIRE_SGLANG_WHEELS=1``). sglang has no CPU build, so no real server runs
here: what the client (``SglangServerApi``) and the trainer's ``NcclWeightPublisher``
send is recorded by a stub that answers as the release (its routes, 404 elsewhere, 422
for a body its struct refuses, and from 0.5.21 sglang's 400 for a distributed update
outside a begin/end session), and every call is checked: its method and path are the
release's, its body's keys are fields of the struct that route parses, with every
required one, of the declared JSON types; the sampling keys are ``SamplingParams``'.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
import torch
from aiohttp import web

from asyncrl.engine.base import SamplingParams
from asyncrl.engine.config import RemoteEngineConfig
from asyncrl.engine.remote_weights import ServerState
from asyncrl.engine.server_api import Attempt, SglangServerApi
from asyncrl.engine.servers import Server
from asyncrl.engine.sglang_api import SglangServer, check_version, generate_payload, parse_version
from asyncrl.interfaces import FullParameters
from asyncrl.serving.sglang_routes import SglangRoutes
from asyncrl.trainer.publish_sglang import NcclWeightPublisher
from asyncrl.transport import RunSite, TransportConfig, write_endpoints

from .sglang_client import serving
from .sglang_wheels import PINNED, Release, problems, release

SESSION = ("POST", "/begin_weight_update")


@pytest.fixture(scope="module", params=PINNED)
def rel(request) -> Release:
    return release(request.param)


class Stub:
    """An sglang server of release ``rel`` that records every call (method, path, body)."""

    def __init__(self, rel: Release, deterministic: bool = False) -> None:
        self.rel, self.deterministic = rel, deterministic
        self.calls: list[tuple[str, str, dict | None]] = []
        self.session_open = False
        self.app = web.Application()
        self.app.router.add_route("*", "/{path:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path, method = "/" + request.match_info["path"], request.method
        body = await request.json() if request.can_read_body else None
        self.calls.append((method, path, body))
        if not self.rel.serves(method, path):
            return web.json_response({"detail": "Not Found"}, status=404)
        refused = self.rel.body_problems(path, body or {}) if method == "POST" else []
        if refused:  # FastAPI's validation error
            return web.json_response({"detail": refused}, status=422)
        if path == "/generate":
            return await self.generate(request, body)
        refusal = self.session_refusal(path)
        if refusal:
            return web.json_response({"success": False, "message": refusal}, status=400)
        return web.json_response(self.answer(path))

    def session_refusal(self, path: str) -> str:
        """sglang's weight-update session rules (0.5.21 on): why a call is refused."""
        if path == "/begin_weight_update":
            opened, self.session_open = self.session_open, True
            return "a weight-update session is already open" if opened else ""
        if path == "/end_weight_update":
            opened, self.session_open = self.session_open, False
            return "" if opened else "no weight-update session is open"
        if path == "/update_weights_from_distributed" and self.rel.serves(*SESSION):
            return "" if self.session_open else "must run between begin and end_weight_update"
        return ""

    def answer(self, path: str) -> dict:
        if path == "/server_info":
            version = self.rel.version
            return {"version": version, "enable_deterministic_inference": self.deterministic}
        if path == "/model_info":
            return {"model_path": "m", "weight_version": "3", "is_generation": True}
        return {"success": True, "message": "Success"}

    async def generate(self, request: web.Request, body: dict) -> web.StreamResponse:
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": 2,
            "weight_version": "3",
            "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
        }
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        event = {"text": "", "output_ids": [7, 8], "meta_info": meta}
        await response.write(b"data: " + web.json_response(event).body + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    def paths(self, skip: tuple[str, ...] = ()) -> list[str]:
        return [path for _, path, _ in self.calls if path not in skip]


def check_calls(stub: Stub) -> None:
    """Every recorded call is one of the release's routes, with a body its struct takes."""
    for method, path, body in stub.calls:
        assert stub.rel.serves(method, path), f"sglang {stub.rel.version} has no {method} {path}"
        if method == "POST":
            assert stub.rel.body_problems(path, body) == [], (stub.rel.version, path, body)


def front_routes(version: str) -> set[tuple[str, str]]:
    """The sglang routes asyncrl's front serves answering as ``version``."""
    app = web.Application()
    SglangRoutes(None, version).add_routes(app)  # registering touches no server
    # aiohttp adds HEAD to each GET (Starlette too); sglang's table lists no HEAD.
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    routes |= {(m, p) for m in ("GET", "POST") for (star, p) in routes if star == "*"}
    return routes | {("POST", "/generate"), ("GET", "/server_info"), ("GET", "/get_server_info")}


def test_the_session_rule_and_supported_range_match_the_release(rel):
    """``SglangServer.weight_sessions`` (``SESSIONS_FROM``) holds for exactly the releases
    whose route table has the begin/end session, and every pinned release is supported."""
    server = SglangServer(check_version("http://x", rel.version))
    assert (
        server.weight_sessions == rel.serves(*SESSION) == rel.serves("POST", "/end_weight_update")
    )
    assert rel.serves("POST", "/update_weights_from_distributed")


@pytest.mark.parametrize("deterministic", [False, True])
def test_generate_payloads_fit_the_releases_types(rel, deterministic):
    """Every ``/generate`` body the client builds: ``GenerateReqInput``'s fields, and
    ``sampling_params`` keys ``SamplingParams`` takes (``sampling_seed`` only where the
    server applies it); ``top_k`` never 0, which sglang refuses (-1 is all)."""
    server = SglangServer(parse_version(rel.version), deterministic)
    cases = [
        SamplingParams(),
        SamplingParams(temperature=0.0, top_k=5, stop=["\n\n", "END"], stop_token_ids=[2]),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=0, seed=3),
    ]
    for params in cases:
        body = generate_payload("req#0#", [1, 2, 3], params, 8, server)
        assert rel.body_problems("/generate", body) == []
        sampling = body["sampling_params"]
        assert problems(sampling, rel.sampling, "SamplingParams") == []
        assert ("sampling_seed" in sampling) == (deterministic and params.seed is not None)
        assert sampling.get("top_k", -1) == -1 or sampling["top_k"] >= 1


def test_the_clients_calls_fit_the_release(rel, caplog):
    """``SglangServerApi`` attaches (``/server_info`` then ``/model_info``; a server that
    ignores seeds is said once), generates, aborts and loads weights from disk: each call
    is the release's, with a body its struct takes, and one the front serves too."""
    stub = Stub(rel)

    async def drive(url: str) -> ServerState:
        client, state = SglangServerApi({2}), ServerState(Server(url), 0)
        params = SamplingParams(max_new_tokens=2, seed=5)
        async with aiohttp.ClientSession() as session:
            with caplog.at_level(logging.WARNING, logger="asyncrl.remote"):
                await client.attach(session, state)
                await client.attach(session, state)  # a reattach says nothing again
            tokens = []
            attempt = Attempt("a#0#", [1, 2], params, 2, tokens.extend, asyncio.Event())
            assert (await client.generate(session, state, attempt)).reason == "length"
            assert tokens == [(7, -0.5, 3), (8, -0.25, 3)]
            await client.abort(session, url, "a#0#")
            assert await client.load_weights(session, state, "/w/v4", 4, None)
        return state

    with serving(stub.app) as url:
        assert asyncio.run(drive(url)).version == 3
    check_calls(stub)
    assert stub.paths() == [
        "/server_info",
        "/model_info",
        "/server_info",
        "/model_info",
        "/generate",
        "/abort_request",
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert "sampling_seed" not in stub.calls[4][2]["sampling_params"]
    assert len([r for r in caplog.records if "--enable-deterministic-inference" in r.message]) == 1
    served = front_routes(rel.version)
    assert {(method, path) for method, path, _ in stub.calls} <= served


def test_the_fronts_routes_are_the_releases(rel):
    """Answering as the release, the front serves only routes sglang has, and the removed
    ``/get_weight_version`` exactly where sglang still routes it (to a 404)."""
    served = front_routes(rel.version)
    assert [(m, p) for m, p in served if m != "*" and not rel.serves(m, p)] == []
    for path in ("/get_weight_version", "/weight_version"):
        assert (("GET", path) in served) == rel.serves("GET", path)


class Broadcast:
    """``NcclBroadcast``'s part without GPUs: records the group and what is sent."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, str]] = []
        self.sent: list[list[tuple[int, ...]]] = []

    def join(self, address: str, port: int, world_size: int, name: str) -> None:
        self.groups.append((world_size, name))

    def send(self, tensors: list[torch.Tensor]) -> None:
        self.sent.append([tuple(t.shape) for t in tensors])

    def leave(self) -> None:
        pass


def publisher(tmp_path, urls: list[str]) -> tuple[NcclWeightPublisher, Broadcast]:
    """An ``NcclWeightPublisher`` for one generator's ``urls``, one tensor per bucket."""
    run_dir = tmp_path / "run"
    write_endpoints(run_dir, "servers-g0", {str(i): url for i, url in enumerate(urls)})
    remote = RemoteEngineConfig(
        server="sglang", weight_update="nccl", urls=urls, nccl_bucket_mb=0, request_timeout_s=30
    )
    site = RunSite(str(run_dir), "run", TransportConfig())
    broadcast = Broadcast()
    return NcclWeightPublisher(site, remote, 1, broadcast), broadcast


STATE = {
    "embed.weight": torch.zeros(4, 2, dtype=torch.bfloat16),
    "norm.weight": torch.ones(2),
    "head.weight": torch.zeros(4, 2, dtype=torch.bfloat16),
}


def test_the_nccl_publishers_calls_fit_the_release(rel, tmp_path):
    """Two publishes: the server's release read once, the group formed once; then per
    version pause, a begin/end session around the distributed updates exactly where the
    release has one, one update per bucket (the last labelled), continue."""
    stub = Stub(rel)
    with serving(stub.app) as url:
        nccl, broadcast = publisher(tmp_path, [url])
        for version in (1, 2):
            nccl.publish(version, FullParameters.of(STATE))
        nccl.close()
    check_calls(stub)
    session = rel.serves(*SESSION)
    begin, end = (["/begin_weight_update"], ["/end_weight_update"]) if session else ([], [])
    updates = ["/update_weights_from_distributed"] * len(STATE)
    one = ["/pause_generation", *begin, *updates, *end, "/continue_generation"]
    assert stub.paths() == ["/server_info", "/init_weights_update_group", *one, *one]
    assert broadcast.groups == [(2, "asyncrl_weights_0")]
    assert broadcast.sent == [[tuple(t.shape)] for t in STATE.values()] * 2
    bodies = [body for _, path, body in stub.calls if path == updates[0]]
    assert [b.get("weight_version") for b in bodies] == [None, None, "1", None, None, "2"]
    assert [b["names"] for b in bodies[:3]] == [[name] for name in STATE]


def test_the_nccl_publisher_learns_each_servers_release(tmp_path):
    """A 0.5.20 and a 0.5.23 server in one group: only the 0.5.23 one gets the session."""
    old, new = Stub(release("0.5.20")), Stub(release("0.5.23"))
    with serving(old.app) as old_url, serving(new.app) as new_url:
        nccl, broadcast = publisher(tmp_path, [old_url, new_url])
        nccl.publish(1, FullParameters.of(STATE))
    for stub in (old, new):
        check_calls(stub)
    assert "/begin_weight_update" not in old.paths()
    assert new.paths().count("/begin_weight_update") == new.paths().count("/end_weight_update") == 1
    assert broadcast.groups == [(3, "asyncrl_weights_0")]
    ranks = [
        body["rank_offset"]
        for stub in (old, new)
        for _, p, body in stub.calls
        if p == "/init_weights_update_group"
    ]
    assert ranks == [1, 2]
