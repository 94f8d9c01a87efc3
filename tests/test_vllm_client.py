"""The remote engine's vLLM client (``engine.remote.server=vllm``) against asyncrl's front
(``python -m asyncrl.serving.serve``, which also speaks vLLM's API), side by side with the
sglang client on the same front: what both clients must do alike is one test run with
each (``api``). Then the client's own reading of vLLM's responses, its refusal of an
unsupported vLLM version, its launch settings, and, where vLLM imports and a GPU is
present (``gpu``), the same engine driving a launched ``vllm serve``.

Why one file: one client, vLLM's, run side by side with sglang's on the same front
(``api``), then its own reading of vLLM's responses and versions; the front is started once
per module and shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.error
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from aiohttp import web

from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.config import RemoteEngineConfig
from asyncrl.engine.remote import RemoteEngine
from asyncrl.engine.servers import VLLM_CPU_KV_GB, die_with_parent, server_command, server_env
from asyncrl.engine.vllm_requests import (
    TESTED_VLLM,
    VllmServer,
    check_version,
    completion_payload,
    read_choice,
)
from asyncrl.logprobs import token_logprobs
from asyncrl.metrics import read_metrics
from asyncrl.models import ModelConfig, load_model
from asyncrl.seeds import derive_seed
from asyncrl.serving.vllm_api import FRONT_VLLM

from .sglang_client import free_port, wait_healthy
from .test_remote_engine import ROOT, drain, perturbed_weights, post, server_stats

VLLM = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 3], [12, 13, 14, 15]]


@contextlib.contextmanager
def launched_front(model_dir: str, log_dir: Path, vllm_version: str = FRONT_VLLM):
    """asyncrl's front in a subprocess (as the smoke run attaches to it), its vLLM routes
    answering as release ``vllm_version``; yields its URL."""
    port, log_path = free_port(), log_dir / f"front-{vllm_version}.log"
    cmd = [sys.executable, "-m", "asyncrl.serving.serve", "--model", model_dir]
    cmd += ["--port", str(port), "--max-slots", "16", "--max-seq-len", "128", "--threads", "1"]
    cmd += ["--vllm-version", vllm_version]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path, timeout=120)
        yield url
    finally:
        proc.terminate()
    assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def front(tiny_model_dir, tmp_path_factory):
    with launched_front(tiny_model_dir, tmp_path_factory.mktemp("front")) as url:
        yield url


@pytest.fixture(scope="module")
def front_032(tiny_model_dir, tmp_path_factory):
    """The front as vLLM 0.32: no ``weight_versions`` (the client stamps each attempt with
    its server's version), requests held through a pause (the client closes them)."""
    with launched_front(tiny_model_dir, tmp_path_factory.mktemp("front"), "0.32.0") as url:
        yield url


def front_url(api: str, request) -> str:
    """The front an ``api`` parameter runs against: ``vllm-0.32`` the 0.32 one."""
    return request.getfixturevalue("front_032" if api == "vllm-0.32" else "front")


def attached(url: str, model_dir: str, api: str, **remote) -> RemoteEngine:
    """A remote engine attached to ``url``, driving it through ``api``'s client. The front
    is shared by a module's tests: the weights label one test leaves would make the next
    attach take the front as another run's (torn), so it is cleared first."""
    server = "vllm" if api.startswith("vllm") else api
    with contextlib.suppress(urllib.error.HTTPError):  # a server without the route
        post(url, "/update_weight_version", {"new_version": "default"})
    cfg = RemoteEngineConfig(urls=[url], server=server, threads=1, startup_timeout_s=60, **remote)
    return RemoteEngine(model_dir, cfg)


def trainer_logprobs(model_dir: str, prompt: list[int], tokens: list[int], temperature: float):
    """What the trainer recomputes for ``tokens`` after ``prompt`` (T = 1 when greedy)."""
    model = load_model(ModelConfig(path=model_dir)).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits
    lp = token_logprobs(logits, ids, temperature if temperature > 0 else 1.0)
    return lp[0, len(prompt) :].tolist()


def once_server_tokens(url: str, count: int, action, timeout_s: float = 30.0):
    """A ``drain`` step hook: ``action()`` once the front's engine has generated ``count``
    more tokens than at this call (vLLM's client sees tokens only when a response ends)."""
    start, deadline, done = server_stats(url)["engine/tokens"], time.time() + timeout_s, []

    def hook() -> None:
        if done:
            return
        assert time.time() < deadline, f"fewer than {count} tokens in {timeout_s:.0f} s"
        if server_stats(url)["engine/tokens"] - start >= count:
            done.append(action())

    return hook


# ---- both clients on the front ------------------------------------------------------------
@pytest.mark.parametrize("api", ["sglang", "vllm", "vllm-0.32"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_the_trainers_recomputation(tiny_model_dir, api, temperature, request):
    """Each token's behavior logprob is what the trainer recomputes for it, at the sampling
    temperature; every token carries the server's version."""
    engine = attached(front_url(api, request), tiny_model_dir, api)
    try:
        params = SamplingParams(max_new_tokens=10, temperature=temperature)
        for i, prompt in enumerate(PROMPTS):
            engine.submit(Request(f"r{i}", prompt, params))
        tokens, finished = drain(engine, [f"r{i}" for i in range(len(PROMPTS))])
        version = engine.status().version
    finally:
        engine.close()
    for i, prompt in enumerate(PROMPTS):
        got = tokens[f"r{i}"]
        want = trainer_logprobs(tiny_model_dir, prompt, [t.token_id for t in got], temperature)
        assert [t.logprob for t in got] == pytest.approx(want, abs=1e-4)
        assert {t.version for t in got} == {version}
        assert finished[f"r{i}"].num_tokens == len(got)
        assert finished[f"r{i}"].reason in ("eos", "length")


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_stop_tokens_and_strings_end_alike(front, tiny_model_dir, api):
    engine = attached(front, tiny_model_dir, api)
    try:
        greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
        engine.submit(Request("free", [5, 6, 7], greedy))
        free = [t.token_id for t in drain(engine, ["free"])[0]["free"]]
        assert len(free) >= 6
        stop_id = free[3]
        by_id = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop_id])
        engine.submit(Request("id", [5, 6, 7], by_id))
        tokens, finished = drain(engine, ["id"])
        assert [t.token_id for t in tokens["id"]] == free[: free.index(stop_id) + 1]
        assert finished["id"].reason == "stop" and finished["id"].matched is None
    finally:
        engine.close()


@pytest.mark.parametrize("api", ["sglang", "vllm", "vllm-0.32"])
def test_a_request_interrupted_by_a_weight_update_resumes_keeping_versions(
    tiny_model_dir, tmp_path, api, request
):
    """New weights arrive while a request decodes: the update ends it on the server, the
    engine resends prompt + tokens, and the caller sees one request whose first tokens
    carry the old version and the rest the new one. The front then gets its weights back."""
    front = front_url(api, request)
    weights = perturbed_weights(tiny_model_dir, tmp_path / "new")
    engine = attached(front, tiny_model_dir, api, max_inflight=4)
    try:
        v0 = engine.status().version
        post(front, "/slow_down", {"forward_sleep_time": 0.03})
        engine.submit(Request("a", [3, 4, 5, 6], SamplingParams(max_new_tokens=40, temperature=0)))
        update = once_server_tokens(front, 5, lambda: engine.stage_weights(str(weights), v0 + 1))
        tokens, finished = drain(engine, ["a"], on_step=update)
        post(front, "/slow_down", {"forward_sleep_time": None})
        versions = [t.version for t in tokens["a"]]
        before = versions.count(v0)
        assert finished["a"].reason == "length" and finished["a"].num_tokens == 40
        assert versions == [v0] * before + [v0 + 1] * (40 - before) and 5 <= before < 40
        status = engine.status()
        assert status.version == v0 + 1 and status.metrics["engine/resent"] == 1
        engine.stage_weights(tiny_model_dir, v0 + 2, wait=True)  # the front's weights back
    finally:
        post(front, "/slow_down", {"forward_sleep_time": None})
        engine.close()


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_abort_ends_the_request_on_the_server(front, tiny_model_dir, api):
    """An abort ends the request at once with its tokens so far, and the server stops
    generating it: for vLLM by closing the connection, which the front (as vLLM) takes
    as an abort."""
    engine = attached(front, tiny_model_dir, api)
    try:
        aborted = server_stats(front)["engine/aborted"]
        post(front, "/slow_down", {"forward_sleep_time": 0.05})
        # Greedy on this prompt runs past 10 tokens without EOS; the abort lands long before.
        params = SamplingParams(max_new_tokens=100, temperature=0.0)
        engine.submit(Request("long", [3, 4, 5], params))
        abort = once_server_tokens(front, 3, lambda: engine.abort("long"))
        _, finished = drain(engine, ["long"], on_step=abort)
        assert finished["long"].reason == "abort" and finished["long"].num_tokens < 100
        deadline = time.time() + 30
        while server_stats(front)["engine/running"] and time.time() < deadline:
            time.sleep(0.05)
        assert server_stats(front)["engine/running"] == 0
        assert server_stats(front)["engine/aborted"] == aborted + 1
    finally:
        post(front, "/slow_down", {"forward_sleep_time": None})
        engine.close()


@pytest.mark.parametrize("api", ["vllm", "vllm-0.32"])
def test_a_groups_samples_go_as_one_request(tiny_model_dir, api, request):
    """Unseeded requests of one prompt and sampling (a GRPO group) go to vLLM as one
    request of ``n`` samples: each still gets its own tokens, with the logprobs the
    trainer recomputes; one aborted alone ends ``abort``, the others finish."""
    url = front_url(api, request)
    engine = attached(url, tiny_model_dir, api)
    sent = []
    original = engine.api.generate_group

    async def recording(session, state, attempts):
        sent.append(len(attempts))
        return await original(session, state, attempts)

    engine.api.generate_group = recording
    try:
        params = SamplingParams(max_new_tokens=8, temperature=0.9)
        for i in range(4):
            engine.submit(Request(f"g{i}", [3, 4, 5], params))
        tokens, finished = drain(engine, [f"g{i}" for i in range(4)])
        assert sent == [4]
        for i in range(4):
            got = tokens[f"g{i}"]
            want = trainer_logprobs(tiny_model_dir, [3, 4, 5], [t.token_id for t in got], 0.9)
            assert [t.logprob for t in got] == pytest.approx(want, abs=1e-4)
            assert finished[f"g{i}"].num_tokens == len(got)
        post(url, "/slow_down", {"forward_sleep_time": 0.02})
        long = SamplingParams(max_new_tokens=60, temperature=0.9)
        for group in range(5):  # the tiny model samples EOS about one token in twenty
            ids = [f"h{group}.{i}" for i in range(3)]
            for rid in ids:
                engine.submit(Request(rid, [6, 7, 8], long))
            abort = once_server_tokens(url, 3, lambda rid=ids[1]: engine.abort(rid))
            _, finished = drain(engine, ids, on_step=abort)
            if finished[ids[1]].reason != "eos":  # else it ended before the abort came
                break
        assert finished[ids[1]].reason == "abort"
        assert {finished[ids[0]].reason, finished[ids[2]].reason} <= {"length", "eos"}
    finally:
        post(url, "/slow_down", {"forward_sleep_time": None})
        engine.close()


def test_a_vllm_server_found_paused_gets_no_request_until_weights_load(front, tiny_model_dir):
    """A server paused when a generator attaches (the one before died after a transfer into
    it failed part-way) is taken as torn: requests wait unsent, no slot is offered for
    leases, and the next update from disk resumes it; the request then runs there."""
    post(front, "/pause?mode=abort", {})
    engine = attached(front, tiny_model_dir, "vllm")
    try:
        version = engine.status().version
        assert engine.servers[0].torn and engine.status().free_slots == 0
        engine.submit(Request("a", [3, 4, 5], SamplingParams(max_new_tokens=4, temperature=0)))
        engine.step()  # it would be sent here
        time.sleep(0.5)
        assert engine.status().running == 0
        engine.stage_weights(tiny_model_dir, version + 1, wait=True)
        assert not engine.servers[0].torn
        tokens, _ = drain(engine, ["a"])
        assert [t.version for t in tokens["a"]] == [version + 1] * 4
    finally:
        post(front, "/resume", {})
        engine.close()


def test_a_vllm_server_labelled_by_an_earlier_client_waits_for_this_runs_weights(
    front, tiny_model_dir
):
    """A server labelled v8 (by another run, whose versions this one's would never pass)
    is taken as torn: nothing runs there until this run's weights load, even older ones."""
    engine = attached(front, tiny_model_dir, "vllm")
    engine.close()
    post(front, "/update_weight_version", {"new_version": "8"})
    engine = RemoteEngine(tiny_model_dir, RemoteEngineConfig(urls=[front], server="vllm"))
    try:
        assert engine.servers[0].torn and engine.status().free_slots == 0
        engine.submit(Request("a", [3, 4, 5], SamplingParams(max_new_tokens=4, temperature=0)))
        engine.step()
        time.sleep(0.5)
        assert engine.status().running == 0
        engine.stage_weights(tiny_model_dir, 1, wait=True)
        assert not engine.servers[0].torn and engine.status().version == 1
        tokens, _ = drain(engine, ["a"])
        assert [t.version for t in tokens["a"]] == [1] * 4
    finally:
        post(front, "/update_weight_version", {"new_version": "default"})
        engine.close()


def run_tiny_grpo(
    run_dir: Path, model_dir: str, url: str, *overrides: str
) -> subprocess.CompletedProcess:
    """Four steps of the tiny GRPO demo, its generator attached to ``url`` as vLLM."""
    cmd = [sys.executable, "launch/local.py", "experiments/tiny_grpo.py", f"run_dir={run_dir}"]
    cmd += [f"model.path={model_dir}", "rl.max_steps=4", "eval.every_steps=0"]
    cmd += ["task.train_size=200", "buffer.prompts_per_batch=2", "buffer.samples_per_prompt=4"]
    cmd += ["buffer.dynamic_sampling=false", "buffer.max_staleness=1"]
    cmd += ["transport.heartbeat_s=0.2", "engine.backend=remote", "engine.remote.server=vllm"]
    cmd += [f"engine.remote.urls=[{url!r}]".replace("'", '"'), "engine.remote.max_inflight=8"]
    cmd += overrides
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_launcher_runs_tiny_grpo_with_a_generator_on_vllms_api(tiny_model_dir, tmp_path):
    """The asynchronous loop with its generator attached to a fresh front (weights version
    0) through vLLM's API: the front loads each published directory (``/collective_rpc``),
    the generator's version follows, consumed tokens carry the new versions."""
    run_dir = tmp_path / "run"
    with launched_front(tiny_model_dir, tmp_path) as front:
        proc = run_tiny_grpo(run_dir, tiny_model_dir, front)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    losses = [
        r["train/loss"]
        for r in read_metrics(run_dir)
        if r["process"] == "trainer" and "train/loss" in r
    ]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    counters = json.loads((run_dir / "buffer_counters.json").read_text())
    assert counters["buffer/generator_version_max"] >= 2  # the front loaded published weights
    assert counters["buffer/newest_consumed_version"] >= 1
    summary = json.loads((run_dir / "generator_g0_summary.json").read_text())
    assert summary["weights_received"] >= 2 and summary["version"] >= 2


# ---- the vLLM client's own -----------------------------------------------------------------
def test_reading_vllm_choices():
    """token_ids and logprobs line up; versions are the server's unless the choice has
    ``weight_versions`` spans (0.33 on); finish reasons map to asyncrl's (EOS is a stop
    with no stop_reason)."""
    choice = {
        "token_ids": [7, 8, 2],
        "logprobs": {"token_logprobs": [-0.5, -1.0, -0.25]},
        "finish_reason": "stop",
        "stop_reason": None,
    }
    tokens, end = read_choice(choice, 3, {2})
    assert tokens == [(7, -0.5, 3), (8, -1.0, 3), (2, -0.25, 3)] and end.reason == "eos"
    assert read_choice({**choice, "stop_reason": 8}, 3, {2})[1].reason == "stop"
    assert read_choice({**choice, "stop_reason": 2}, 3, {2})[1].reason == "eos"
    end = read_choice({**choice, "stop_reason": "\n\n"}, 3, {2})[1]
    assert (end.reason, end.matched) == ("stop", "\n\n")
    assert read_choice({**choice, "finish_reason": "length"}, 3, {2})[1].reason == "length"
    assert read_choice({**choice, "finish_reason": "abort"}, 3, {2})[1].reason == "abort"
    spans = [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 3}]
    assert [v for _, _, v in read_choice({**choice, "weight_versions": spans}, 3, {2})[0]] == [
        4,
        4,
        5,
    ]
    with pytest.raises(ValueError, match="token_ids"):
        read_choice({**choice, "logprobs": None}, 3, {2})
    with pytest.raises(ValueError, match="finish_reason"):
        read_choice({**choice, "finish_reason": "weird"}, 3, {2})
    params = SamplingParams(temperature=0.7, top_k=0, seed=5, stop=["\n\n"], stop_token_ids=[4])
    body = completion_payload("m", [1, 2], params, 6, VllmServer((0, 32), "cuda"))
    assert body == {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 6,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "logprobs": 0,
        "return_token_ids": True,
        "seed": derive_seed(5, 2),  # keyed by the attempt's start
        "stop_token_ids": [4],
        "stop": ["\n\n"],
    }
    # From 0.33 each choice says which weights sampled its tokens; on a CPU before 0.34 a
    # seed would crash vLLM's engine on a chunked prefill: none is sent.
    assert completion_payload("m", [1, 2], params, 6, VllmServer((0, 33)))["return_weight_versions"]
    for server in (VllmServer((0, 32), "cpu"), VllmServer((0, 33), "cpu")):
        assert "seed" not in completion_payload("m", [1, 2], params, 6, server)
    assert "seed" in completion_payload("m", [1, 2], params, 6, VllmServer((0, 34), "cpu"))


def test_supported_vllm_versions():
    for ok in (TESTED_VLLM, "0.32.0", "0.33.2.dev7+g0123abc", "v0.33.1", "0.34.0"):
        check_version("http://x", ok)
    for bad in ("0.31.9", "0.35.0", "1.0.0", "main", None):
        with pytest.raises(RuntimeError, match=TESTED_VLLM):
            check_version("http://x", bad)


def test_a_server_of_an_unsupported_vllm_version_is_refused(tiny_model_dir):
    """Attaching checks ``GET /version`` first; the error names both versions."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.10.1"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    runner = web.AppRunner(app)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner.addresses[0][1]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        with pytest.raises(RuntimeError) as info:
            attached(f"http://127.0.0.1:{port}", tiny_model_dir, "vllm")
        assert "'0.10.1'" in str(info.value) and TESTED_VLLM in str(info.value)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_vllm_launch_settings(tiny_model_dir, monkeypatch):
    """A launched vLLM is its OpenAI server module (``vllm serve`` fails in the CPU build,
    named ``vllm-cpu``) run by its own interpreter, and gets the logprobs the trainer
    recomputes, its RL routes (dev mode), its share of GPU memory, and GPUs from ``index
    * tp_size``; with NCCL updates, vLLM's NCCL weight-transfer engine; without a GPU, a
    bounded KV cache."""
    cfg = RemoteEngineConfig(server="vllm", tp_size=2, mem_fraction_static=0.3, max_seq_len=64)
    cmd = server_command(replace(cfg, python="/venvs/vllm/bin/python"), tiny_model_dir, 31000, 1, 0)
    assert cmd[:4] == [
        "/venvs/vllm/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
    ]
    assert "--dtype" not in cmd
    assert server_command(replace(cfg, dtype="float32"), tiny_model_dir, 1, 0, 0)[-2:] == [
        "--dtype",
        "float32",
    ]
    joined = " ".join(cmd)
    assert "--logprobs-mode processed_logprobs" in joined and "--port 31000" in joined
    assert "--gpu-memory-utilization 0.3" in joined and "--max-model-len 64" in joined
    assert "--tensor-parallel-size 2" in joined and "--weight-transfer-config" not in joined
    nccl = server_command(replace(cfg, weight_update="nccl"), tiny_model_dir, 31000, 1, 0)
    assert nccl[-2:] == ["--weight-transfer-config", '{"backend": "nccl"}']
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    env = server_env(cfg, 1)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert server_env(cfg, 0)["VLLM_CPU_KVCACHE_SPACE"] == VLLM_CPU_KV_GB
    assert server_env(RemoteEngineConfig(server="sglang"), 0) is None


# ---- real vLLM ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not VLLM, reason="needs vllm and a CUDA GPU")
def test_the_engine_drives_a_launched_vllm_server(tiny_model_dir, tmp_path):
    """``vllm serve`` launched by the engine: logprobs close to the trainer's recomputation
    (vLLM computes in reduced precision), weights from disk as a new version."""
    cfg = RemoteEngineConfig(
        server="vllm",
        mem_fraction_static=0.2,
        max_seq_len=128,
        extra_args=["--enforce-eager", "--dtype", "float32"],
    )
    engine = RemoteEngine(tiny_model_dir, cfg, log_dir=tmp_path / "logs")
    try:
        params = SamplingParams(max_new_tokens=10, temperature=0.7)
        engine.submit(Request("a", PROMPTS[1], params))
        tokens, _ = drain(engine, ["a"], timeout_s=300)
        got = tokens["a"]
        want = trainer_logprobs(tiny_model_dir, PROMPTS[1], [t.token_id for t in got], 0.7)
        assert [t.logprob for t in got] == pytest.approx(want, abs=2e-2)
        weights = perturbed_weights(tiny_model_dir, tmp_path / "v1")
        engine.stage_weights(str(weights), 1, wait=True)
        engine.submit(Request("b", PROMPTS[1], SamplingParams(max_new_tokens=6, temperature=0)))
        tokens, _ = drain(engine, ["b"], timeout_s=300)
        assert {t.version for t in tokens["b"]} == {1} and engine.status().version == 1
    finally:
        engine.close()
