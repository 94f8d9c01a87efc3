"""The remote engine against launched servers of asyncrl's sglang-compatible front
(``asyncrl.serving.serve``), the disk weight publisher, and a short RL run through the
real launcher with remote generators. The same engine against real sglang, and NCCL
weight updates (``NcclWeightPublisher``), need sglang and a CUDA GPU (``sglang`` and
``gpu`` markers) and are skipped elsewhere.

Why one file: one component, the remote engine, from its requests against launched servers
through its weight updates, version checks and config to a run of the launcher; the servers
are started once per module and shared.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zmq
from aiohttp import web

from asyncrl.config import ConfigError, apply_overrides, load_json, save_json
from asyncrl.engine import sglang_api as api
from asyncrl.engine.base import Finished, Request, SamplingParams
from asyncrl.engine.config import EngineConfig, RemoteEngineConfig
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.remote import RemoteEngine
from asyncrl.engine.weight_dirs import write_weights_dir
from asyncrl.interfaces import FullParameters
from asyncrl.metrics import read_metrics
from asyncrl.models import ModelConfig, load_model, load_tokenizer
from asyncrl.seeds import derive_seed
from asyncrl.stages.rl import RLExperiment
from asyncrl.trainer.publish import DiskWeightPublisher
from asyncrl.trainer.publish_sglang import NcclWeightPublisher
from asyncrl.transport import RunSite, TransportConfig, make_socket, read_endpoints
from asyncrl.wire import WeightsAnnounce, WeightsOnDisk, WireDecoder

from .sglang_client import serving
from .test_stops import first_stop

ROOT = Path(__file__).resolve().parents[1]
SGLANG = importlib.util.find_spec("sglang") is not None and torch.cuda.is_available()
needs_sglang = pytest.mark.skipif(not SGLANG, reason="needs sglang and a CUDA GPU")
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 3], [12, 13, 14, 15], [4, 4, 4, 4, 4, 4], [9]]


def remote_config(
    num_servers: int = 1, max_inflight: int = 64, server: str = "embedded", **remote
) -> EngineConfig:
    if server == "sglang":
        remote.setdefault("mem_fraction_static", 0.3)
    return EngineConfig(
        backend="remote",
        remote=RemoteEngineConfig(
            threads=1,
            server=server,
            num_servers=num_servers,
            max_inflight=max_inflight,
            startup_timeout_s=600 if server == "sglang" else 120,
            **remote,
        ),
    )


def drain(engine, request_ids, timeout_s: float = 60.0, on_tokens=None, on_step=None):
    """Step until every request finished: ({id: [GeneratedToken]}, {id: Finished});
    ``on_tokens(tokens)`` after a step that brought tokens, ``on_step()`` after each (an
    engine sends what was submitted only in a step)."""
    tokens, finished = {}, {}
    deadline = time.time() + timeout_s
    while set(finished) != set(request_ids):
        assert time.time() < deadline, (
            f"unfinished after {timeout_s}s: {set(request_ids) - set(finished)}"
        )
        out = engine.step()
        for t in out.tokens:
            tokens.setdefault(t.request_id, []).append(t)
        for f in out.finished:
            assert f.request_id not in finished, f"{f.request_id} finished twice"
            finished[f.request_id] = f
        if on_tokens is not None and out.tokens:
            on_tokens(tokens)
        if on_step is not None:
            on_step()
    return tokens, finished


def post(url: str, path: str, payload: dict) -> None:
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=30).read()


def server_stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as resp:
        return json.loads(resp.read())["internal_states"][0]


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir):
    engine = RemoteEngine(tiny_model_dir, remote_config(num_servers=2).remote)
    yield engine
    engine.close()
    assert all(s.server.process.poll() is not None for s in engine.servers)  # stopped


def test_greedy_tokens_and_logprobs_match_the_embedded_engine(two_servers, tiny_model_dir):
    """Across two servers (least busy first): the same tokens, logprobs within 1e-4,
    finish reasons and lengths as the embedded engine in this process; version 0."""
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    for r in requests:
        two_servers.submit(r)
    tokens, finished = drain(two_servers, [r.request_id for r in requests])
    local = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=8, threads=1))
    for r in requests:
        local.submit(r)
    want_tokens, want_finished = drain(local, [r.request_id for r in requests])
    local.close()
    for r in requests:
        got, want = tokens.get(r.request_id, []), want_tokens.get(r.request_id, [])
        assert [t.token_id for t in got] == [t.token_id for t in want]
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-4)
        assert {t.version for t in got} == {0}
        assert finished[r.request_id] == want_finished[r.request_id]
    # Both servers served requests.
    assert all(server_stats(url)["engine/prefill_tokens"] > 0 for url in two_servers.urls)
    status = two_servers.status()
    assert status.running == status.waiting == 0
    assert status.free_slots == 2 * 64


def test_sampled_requests_and_stop_tokens(two_servers):
    """Sampling with top-k/top-p reaches the server; a stop token ends with ``stop`` on it."""
    greedy = Request("g", [5, 6, 7], SamplingParams(max_new_tokens=10, temperature=0.0))
    two_servers.submit(greedy)
    tokens, _ = drain(two_servers, ["g"])
    stop_at = tokens["g"][2].token_id
    first = [t.token_id for t in tokens["g"]].index(stop_at)
    stopped = Request(
        "s", [5, 6, 7], SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_at])
    )
    sampled = Request("t", [5, 6, 7], SamplingParams(max_new_tokens=10, top_k=5, top_p=0.9))
    two_servers.submit(stopped)
    two_servers.submit(sampled)
    tokens, finished = drain(two_servers, ["s", "t"])
    assert finished["s"].reason in ("stop", "eos") and finished["s"].num_tokens == first + 1
    assert tokens["s"][-1].token_id == stop_at
    assert finished["t"].num_tokens == len(tokens["t"]) >= 1
    assert all(math.isfinite(t.logprob) and t.logprob <= 0 for t in tokens["t"])


def test_stop_strings_end_at_their_first_token(two_servers, tiny_model_dir):
    """Each free greedy run gives a two-token stop string (its tokens 4 and 5, which may
    occur earlier); with it the server ends the request at the first token whose decoded
    completion holds it, that token included, and the engine reports the string."""
    tokenizer = load_tokenizer(tiny_model_dir)
    free_params = SamplingParams(max_new_tokens=12, temperature=0.0)
    free = [Request(f"free{i}", p, free_params) for i, p in enumerate(PROMPTS)]
    for r in free:
        two_servers.submit(r)
    tokens, _ = drain(two_servers, [r.request_id for r in free])
    runs = {r.request_id: [t.token_id for t in tokens[r.request_id]] for r in free}
    stops = {
        rid: tokenizer.decode(ids[4:6])
        for rid, ids in runs.items()
        if len(ids) >= 6 and tokenizer.eos_token_id not in ids[:6]
    }
    assert len(stops) >= 3, runs
    cut = [
        Request(f"cut{rid}", PROMPTS[int(rid[4:])], SamplingParams(12, 0.0, stop=["?!", s]))
        for rid, s in stops.items()
    ]
    for r in cut:
        two_servers.submit(r)
    tokens, finished = drain(two_servers, [r.request_id for r in cut])
    for rid, stop in stops.items():
        n = first_stop(tokenizer, runs[rid], [stop])
        assert n is not None and n <= 6
        assert [t.token_id for t in tokens[f"cut{rid}"]] == runs[rid][:n]
        assert finished[f"cut{rid}"] == Finished(f"cut{rid}", "stop", n, stop)


def test_abort_a_running_request(two_servers):
    """Greedy on this prompt runs past 10 tokens without EOS; the abort lands long before."""
    for url in two_servers.urls:
        post(url, "/slow_down", {"forward_sleep_time": 0.05})
    try:
        params = SamplingParams(max_new_tokens=100, temperature=0.0)
        two_servers.submit(Request("long", [3, 4, 5], params))
        aborted = []

        def abort_once(tokens):
            if not aborted and len(tokens.get("long", [])) >= 2:
                two_servers.abort("long")
                aborted.append(True)

        tokens, finished = drain(two_servers, ["long"], on_tokens=abort_once)
    finally:
        for url in two_servers.urls:
            post(url, "/slow_down", {"forward_sleep_time": None})
    assert finished["long"].reason == "abort"
    assert 2 <= finished["long"].num_tokens == len(tokens["long"]) < 100
    assert two_servers.status().metrics["engine/aborted"] >= 1


def perturbed_weights(model_dir: str, out_dir: Path) -> Path:
    # Seeded: with the global generator the perturbation, and so the new weights' greedy
    # tokens (an EOS or not), depended on which tests ran before.
    model = load_model(ModelConfig(path=model_dir))
    gen = torch.Generator().manual_seed(0)
    state = {
        k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
        for k, v in model.state_dict().items()
    }
    return write_weights_dir(state, model_dir, out_dir)


def test_staged_tensors_reach_every_server(two_servers, tiny_model_dir, tmp_path):
    """``stage_weights`` (raw tensors, as the embedded engine takes them) writes a directory
    both servers load, one after the other; the engine's version then advances, and
    greedy tokens are the new weights' (the module's last use of the two servers). A
    directory staged with ``wait`` is in use when the call returns."""
    weights = perturbed_weights(tiny_model_dir, tmp_path / "v1")
    two_servers.stage_weights(load_model(ModelConfig(path=str(weights))).state_dict(), 1)
    deadline = time.time() + 60
    while two_servers.status().version < 1:
        assert time.time() < deadline, two_servers.status()
        two_servers.step()
    assert two_servers.status().metrics["engine/weight_updates"] == 1
    assert two_servers.status().staged_version == -1
    requests = [
        Request(f"w{i}", p, SamplingParams(max_new_tokens=6, temperature=0.0))
        for i, p in enumerate(PROMPTS[:4])
    ]
    for r in requests:
        two_servers.submit(r)
    tokens, _ = drain(two_servers, [r.request_id for r in requests])
    local = EmbeddedEngine(str(weights), EmbeddedEngineConfig(max_slots=8, threads=1))
    for r in requests:
        local.submit(r)
    want, _ = drain(local, [r.request_id for r in requests])
    local.close()
    for r in requests:
        assert {t.version for t in tokens[r.request_id]} == {1}
        assert [t.token_id for t in tokens[r.request_id]] == [
            t.token_id for t in want[r.request_id]
        ]
    two_servers.stage_weights(str(weights), 2, wait=True)
    status = two_servers.status()
    assert status.version == 2 and status.metrics["engine/weight_updates"] == 2
    assert all(state.version == 2 for state in two_servers.servers)


@pytest.mark.parametrize(
    "server",
    ["embedded", pytest.param("sglang", marks=[pytest.mark.sglang, pytest.mark.gpu, needs_sglang])],
)
def test_a_request_in_flight_across_a_weight_update_resumes(tiny_model_dir, tmp_path, server):
    """Weights v1 arrive while a request decodes: the server's pause ends it; the engine
    sends prompt + its tokens again, and the caller sees one request whose first tokens
    are version 0 and the rest version 1, ``max_new_tokens`` in all. The server
    prefilled the prompt, then the prompt plus the tokens before the interruption."""
    weights = perturbed_weights(tiny_model_dir, tmp_path / "v1")
    engine = RemoteEngine(tiny_model_dir, remote_config(max_inflight=1, server=server).remote)
    url = engine.urls[0]
    try:
        post(url, "/slow_down", {"forward_sleep_time": 0.03})
        prompt = [3, 4, 5, 6]
        engine.submit(Request("a", prompt, SamplingParams(max_new_tokens=40, temperature=0.0)))
        engine.submit(Request("queued", prompt, SamplingParams(max_new_tokens=40)))
        assert engine.status().waiting >= 1  # max_inflight=1: the second waits
        engine.abort("queued")
        updated = []

        def update_once(tokens):
            if not updated and len(tokens.get("a", [])) >= 5:
                engine.stage_weights(str(weights), 1)
                updated.append(True)

        tokens, finished = drain(engine, ["a", "queued"], on_tokens=update_once)
        post(url, "/slow_down", {"forward_sleep_time": None})
        versions = [t.version for t in tokens["a"]]
        before = versions.count(0)
        assert finished["queued"].reason == "abort" and finished["queued"].num_tokens == 0
        assert finished["a"].reason == "length" and finished["a"].num_tokens == 40
        assert len(versions) == 40 and versions == [0] * before + [1] * (40 - before)
        assert 5 <= before < 40
        status = engine.status()
        assert status.version == 1 and status.staged_version == -1
        stats = status.metrics
        assert stats["engine/resent"] == 1 and stats["engine/weight_updates"] == 1
        assert stats["engine/resent_tokens"] == len(prompt) + before
        if server == "sglang":  # its kernels are not the embedded engine's: no exact check
            return
        # What the server saw: the prompt, then prompt + the first tokens (re-prefilled).
        assert server_stats(url)["engine/prefill_tokens"] == len(prompt) + len(prompt) + before
        # The resumed tokens are the new weights' greedy continuation of the prefix.
        local = EmbeddedEngine(str(weights), EmbeddedEngineConfig(max_slots=2, threads=1))
        prefix = [t.token_id for t in tokens["a"][:before]]
        local.submit(
            Request(
                "b", prompt + prefix, SamplingParams(max_new_tokens=40 - before, temperature=0.0)
            )
        )
        want, _ = drain(local, ["b"])
        local.close()
        assert [t.token_id for t in tokens["a"][before:]] == [t.token_id for t in want["b"]]
        assert [t.logprob for t in tokens["a"][before:]] == pytest.approx(
            [t.logprob for t in want["b"]], abs=1e-4
        )
        engine.stage_weights(str(weights), 1)  # a republish of the same version: ignored
        assert engine.status().staged_version == -1
        engine.stage_weights(str(weights), 1, wait=True)  # already in use: returns at once
    finally:
        engine.close()


def test_sglang_protocol_reading():
    """Cumulative (sglang's default) and incremental streams give the same new tokens;
    versions fall back to the chunk's ``weight_version``; finish reasons map to asyncrl's."""
    entries = [[-0.5, 7, None], [-1.0, 8, None], [-1.5, 9, None]]
    cumulative = {"output_token_logprobs": entries[:2], "completion_tokens": 2}
    new, seen = api.new_tokens(cumulative, 0, 3)
    assert new == [(7, -0.5, 3), (8, -1.0, 3)] and seen == 2
    new, seen = api.new_tokens({"output_token_logprobs": entries, "completion_tokens": 3}, 2, 4)
    assert new == [(9, -1.5, 4)] and seen == 3
    incremental = {"output_token_logprobs": entries[2:], "completion_tokens": 3}
    assert api.new_tokens(incremental, 2, 4) == ([(9, -1.5, 4)], 3)
    ours = {**cumulative, "output_token_versions": ["1", "2"]}
    assert api.new_tokens(ours, 0, 5)[0] == [(7, -0.5, 1), (8, -1.0, 2)]
    assert api.as_version("default", 6) == 6 and api.as_version("12", 0) == 12
    assert api.finish_reason({"type": "stop", "matched": 2}, {2}) == ("eos", False)
    assert api.finish_reason({"type": "stop", "matched": 5}, {2}) == ("stop", False)
    assert api.finish_reason({"type": "length", "length": 4}, {2}) == ("length", False)
    assert api.finish_reason({"type": "abort", "message": "paused"}, {2}) == ("abort", False)
    assert api.finish_reason({"type": "abort", "status_code": 400}, {2}) == ("abort", True)
    seeded, unseeded = api.SglangServer((0, 5, 23), True), api.SglangServer((0, 5, 23))
    payload = api.generate_payload("r", [1, 2], SamplingParams(top_k=0, seed=3), 5, seeded)
    assert payload["sampling_params"] == {
        "max_new_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "sampling_seed": derive_seed(3, 2),  # keyed by the attempt's start
    }
    assert payload["stream"] and payload["return_logprob"]
    stops = SamplingParams(stop=["\n\n"], stop_token_ids=[4], top_k=5, seed=3)
    assert api.generate_payload("r", [1], stops, 5, unseeded)["sampling_params"] == {
        "max_new_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 5,
        "stop_token_ids": [4],
        "stop": ["\n\n"],
    }
    assert api.finish_reason({"type": "stop", "matched": "\n\n"}, {2}) == ("stop", False)
    assert api.matched_stop({"type": "stop", "matched": "\n\n"}) == "\n\n"
    assert api.matched_stop({"type": "stop", "matched": 2}) is None


def test_supported_sglang_versions():
    """``/server_info``'s ``version`` decides: 0.5.0 to 0.5.23 are driven, any other is
    refused naming the server, its version and the range; seeds go only to a server in
    sglang's deterministic mode; weight-update sessions from 0.5.21."""
    for ok in ("0.5.0", "0.5.10", "0.5.21.post1", "v0.5.23", "0.5.9rc0"):
        api.check_version("http://x:1", ok)
    for bad in ("0.4.9", "0.5.24", "0.6.0", "1.0.0", "asyncrl-embedded", None):
        with pytest.raises(RuntimeError, match="0.5.0 to 0.5.23") as info:
            api.check_version("http://x:1", bad)
        assert "http://x:1" in str(info.value) and repr(bad) in str(info.value)
    old = api.read_server("u", {"version": "0.5.20", "enable_deterministic_inference": True})
    new = api.read_server("u", {"version": "0.5.21", "enable_deterministic_inference": False})
    assert old.seeded and not old.weight_sessions
    assert new.weight_sessions and not new.seeded


def test_an_sglang_server_of_an_unsupported_version_is_refused(tiny_model_dir):
    """Attaching reads ``GET /server_info`` first (sglang has no ``/version``)."""

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.24"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    with serving(app) as url:
        cfg = RemoteEngineConfig(urls=[url], server="sglang", threads=1, startup_timeout_s=30)
        with pytest.raises(RuntimeError) as info:
            RemoteEngine(tiny_model_dir, cfg)
    message = str(info.value)
    assert url in message and "'0.5.24'" in message and "0.5.0 to 0.5.23" in message


def test_disk_publisher_writes_loadable_versions_and_prunes(tiny_model_dir, tmp_path):
    cfg = SimpleNamespace(
        run_dir=str(tmp_path / "run"),
        run_id="run",
        transport=TransportConfig(),
        model=ModelConfig(path=tiny_model_dir),
    )
    publisher = DiskWeightPublisher(RunSite(cfg.run_dir, cfg.run_id, cfg.transport), tiny_model_dir)
    ctx = zmq.Context()
    sub = make_socket(ctx, zmq.SUB, cfg.transport)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(read_endpoints(cfg.run_dir, "trainer")["weights"])
    time.sleep(0.3)  # let the subscription reach the publisher
    base = load_model(ModelConfig(path=tiny_model_dir)).state_dict()
    try:
        for version in (1, 2, 3):
            state = {k: v + version for k, v in base.items()}
            assert publisher.publish(version, FullParameters.of(state)) > 0
        publisher.republish()
        decoder = WireDecoder("run", expected=WeightsAnnounce | WeightsOnDisk)
        got = [decoder.decode(sub.recv()) for _ in range(4)]
    finally:
        publisher.close()
        ctx.destroy(linger=0)
    root = tmp_path / "run" / "weights"
    assert [(m.version, m.path) for m in got] == [(v, str(root / f"v{v}")) for v in (1, 2, 3, 3)]
    assert sorted(p.name for p in root.iterdir()) == ["v2", "v3"]  # pruned; no temporaries
    loaded = load_model(ModelConfig(path=str(root / "v3"))).state_dict()
    assert all(torch.equal(loaded[k], base[k] + 3) for k in base)
    assert (root / "v3" / "tokenizer.json").exists() and (root / "v3" / "config.json").exists()


def test_remote_config_is_checked(tiny_model_dir):
    def finalize(*overrides):
        cfg = RLExperiment(model=ModelConfig(path=tiny_model_dir), run_dir="runs/x")
        apply_overrides(cfg, ["engine.backend=remote", *overrides])
        cfg.finalize()
        return cfg

    finalize("engine.remote.server=embedded")
    with pytest.raises(ConfigError, match="engine.remote.num_servers"):
        finalize("engine.remote.num_servers=0")
    with pytest.raises(ConfigError, match="engine.remote.urls"):
        finalize("engine.remote.urls=localhost:30000")
    with pytest.raises(ConfigError, match="trainer.device=cpu"):
        finalize("engine.remote.weight_update=nccl", "trainer.device=cpu")
    with pytest.raises(ConfigError, match="weight_update=nccl needs sglang or vLLM"):
        finalize("engine.remote.weight_update=nccl", "engine.remote.server=embedded")
    with pytest.raises(ConfigError, match="placement=colocated"):
        finalize("placement=colocated")
    if not torch.cuda.is_available():  # a CPU trainer refuses NCCL updates at start
        cfg = finalize("engine.remote.weight_update=nccl")
        with pytest.raises(RuntimeError, match="weight_update=disk"):
            NcclWeightPublisher(cfg.site(), cfg.engine.remote, cfg.num_generators)


def test_engine_overrides_go_to_the_backend_sections(tmp_path):
    """Each backend's settings are under its own section; a key outside them names the
    section key it meant; a saved rollout config reads back the same."""
    cfg = RLExperiment(run_dir=str(tmp_path))
    apply_overrides(cfg, ["engine.embedded.max_slots=8", "engine.remote.threads=2"])
    assert cfg.engine.embedded.max_slots == 8 and cfg.engine.threads == 0  # embedded's
    apply_overrides(cfg, ["engine.backend=remote"])
    assert cfg.engine.threads == 2
    with pytest.raises(ConfigError, match="engine.embedded.max_slots"):
        apply_overrides(cfg, ["engine.max_slots=8"])
    save_json(cfg.rollout(), tmp_path / "rollout.json")
    assert load_json(tmp_path / "rollout.json").engine == cfg.engine


@pytest.mark.slow
def test_launcher_runs_tiny_grpo_with_remote_generators(tmp_path, tiny_model_dir):
    """The asynchronous loop with a generator driving a launched embedded server: versions
    advance at the trainer, at the generator (its server loads each published directory)
    and on consumed tokens; the loss is finite; old weight directories are pruned."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "launch/local.py",
        "experiments/tiny_grpo.py",
        f"run_dir={run_dir}",
        f"model.path={tiny_model_dir}",
        "rl.max_steps=4",
        "eval.every_steps=0",
        "task.train_size=200",
        "buffer.prompts_per_batch=2",
        "buffer.samples_per_prompt=4",
        "buffer.dynamic_sampling=false",
        "buffer.max_staleness=1",
        "engine.embedded.max_slots=8",
        "transport.heartbeat_s=0.2",
        "engine.backend=remote",
        "engine.remote.server=embedded",
        "engine.remote.max_inflight=8",
        "engine.remote.startup_timeout_s=120",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    records = [r for r in read_metrics(run_dir) if r["process"] == "trainer" and "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["train/loss"]) for r in records)
    counters = json.loads((run_dir / "buffer_counters.json").read_text())
    assert counters["buffer/version"] == 4
    assert counters["buffer/generator_version_max"] >= 2  # the server loaded published weights
    assert counters["buffer/newest_consumed_version"] >= 1
    assert counters["buffer/samples_consumed"] == 4 * 2 * 4
    summary = json.loads((run_dir / "generator_g0_summary.json").read_text())
    assert summary["weights_received"] >= 2 and summary["version"] >= 2
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v3", "v4"]
    assert (run_dir / "logs" / "generator_g0_server0.log").exists()
    servers = read_endpoints(run_dir, "servers-g0", timeout_s=1)
    assert list(servers) == ["0"]


@pytest.mark.sglang
@pytest.mark.gpu
@needs_sglang
def test_nccl_publisher_broadcasts_into_a_sglang_server(tiny_model_dir, tmp_path, dist_info):
    """Rank 0 joins an NCCL group with the server, broadcasts perturbed weights as v1; the
    server then generates the new weights' greedy tokens, reported as version 1."""
    from asyncrl.generator.worker import make_engine

    run_dir = tmp_path / "run"
    engine_cfg = remote_config(server="sglang", weight_update="nccl")
    cfg = SimpleNamespace(
        run_dir=str(run_dir),
        run_id="run",
        num_generators=1,
        transport=TransportConfig(),
        engine=engine_cfg,
    )
    engine = make_engine(cfg, tiny_model_dir, "g0")
    publisher = NcclWeightPublisher(
        RunSite(cfg.run_dir, "run", cfg.transport), engine_cfg.remote, 1
    )
    try:
        weights = perturbed_weights(tiny_model_dir, tmp_path / "v1")
        state = load_model(ModelConfig(path=str(weights))).state_dict()
        assert publisher.publish(1, FullParameters.of(state)) > 0
        engine.submit(Request("a", [3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0)))
        tokens, _ = drain(engine, ["a"])
        assert {t.version for t in tokens["a"]} == {1} and engine.status().version == 1
        local = EmbeddedEngine(str(weights), EmbeddedEngineConfig(max_slots=2, threads=1))
        local.submit(Request("a", [3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0)))
        want, _ = drain(local, ["a"])
        local.close()
        assert [t.token_id for t in tokens["a"]] == [t.token_id for t in want["a"]]
    finally:
        publisher.close()
        engine.close()
