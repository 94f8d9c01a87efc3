"""vLLM's weight transfer, driven end to end on CPU: trainer rank 0's
``VllmTransferPublisher`` sends versions into asyncrl's front (which speaks vLLM's
weight-transfer routes over gloo) when the remote engine's vLLM client asks, after pausing
and draining the server. The same calls, with vLLM's NCCL engine on both ends, are what
``engine.remote.weight_update=nccl`` makes against real vLLM (``tools/gpu_check.sh``)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
import zmq

from asyncrl.buffer.config import RolloutConfig
from asyncrl.config import ConfigError, load_experiment
from asyncrl.engine.base import PushFailed, Request, SamplingParams
from asyncrl.engine.config import EngineConfig, RemoteEngineConfig
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.remote import RemoteEngine
from asyncrl.generator.weights import TrainerPush
from asyncrl.interfaces import FullParameters
from asyncrl.metrics import read_metrics
from asyncrl.models import ModelConfig, load_model
from asyncrl.trainer.publish import weight_publisher
from asyncrl.trainer.publish_vllm import VllmTransferPublisher
from asyncrl.wire import TransferAsk, TransferDone, WeightsByTransfer, WireDecoder, encode

from .test_remote_engine import drain, perturbed_weights
from .test_vllm_client import VLLM, launched_front, run_tiny_grpo

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def transfer_config(run_dir, remote: RemoteEngineConfig) -> RolloutConfig:
    """A generator's config with ``remote`` servers (the publisher takes its site)."""
    return RolloutConfig(
        run_dir=str(run_dir), run_id="run", engine=EngineConfig(backend="remote", remote=remote)
    )


def call(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of a GET, or of a POST of ``body``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{url}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def greedy(engine, prompt: list[int]) -> list:
    engine.submit(Request("a", prompt, GREEDY))
    tokens, _ = drain(engine, ["a"])
    return tokens["a"]


def test_the_trainer_sends_versions_into_a_vllm_api_server(tiny_model_dir, tmp_path):
    """Two versions through one group: the server then generates each version's greedy
    tokens with the logprobs of an engine loaded with those weights, labelled by version;
    an ask for a version the trainer has moved past is refused, naming both."""
    with launched_front(tiny_model_dir, tmp_path) as url:
        remote = RemoteEngineConfig(
            urls=[url], server="vllm", weight_update="gloo", threads=1, request_timeout_s=60
        )
        cfg = transfer_config(tmp_path / "run", remote)
        with sending(cfg, tiny_model_dir) as (publisher, engine, push):
            for version in (1, 2):
                check_a_version(publisher, engine, push, version, tmp_path, tiny_model_dir, 1e-5)
                assert call(url, "/weight_info") == (200, {"weight_version": str(version)})
            assert publisher.transfers == 2 and list(publisher.senders) == [url]
            with pytest.raises(PushFailed, match=r"v1 is not the newest here \(v2\)") as e:
                push(url, 1)
            assert not e.value.touched
            # Refused untouched: an ask its generator gave up on, another trainer's.
            late = ask_raw(publisher, url, 2, publisher.lineage, deadline=time.time() - 1)
            other = ask_raw(publisher, url, 2, "another", deadline=time.time() + 60)
            assert (late.ok, late.touched, other.ok, other.touched) == (False,) * 4
            assert "after its deadline" in late.why and "another trainer's" in other.why
            assert publisher.transfers == 2


def test_a_server_torn_by_a_failed_transfer_waits_paused_for_the_next(tiny_model_dir, tmp_path):
    """A push that fails once it may have touched the server's weights leaves it paused
    and out of rotation (requests wait, none runs on mixed weights under the old label,
    no lease is taken for it), also for a generator restarted meanwhile, which finds it
    paused; the next successful transfer resumes it, even of an older version (a trainer
    restarted from a checkpoint), and the waiting request runs on it."""
    with launched_front(tiny_model_dir, tmp_path) as url:
        remote = RemoteEngineConfig(
            urls=[url], server="vllm", weight_update="gloo", threads=1, request_timeout_s=60
        )
        cfg = transfer_config(tmp_path / "run", remote)
        with sending(cfg, tiny_model_dir) as (publisher, engine, push):
            check_a_version(publisher, engine, push, 2, tmp_path, tiny_model_dir, 1e-5)

            def torn(url: str, version: int) -> None:
                raise PushFailed("the broadcast broke half-way", touched=True)

            engine.stage_weights(torn, 3)
            wait_until(lambda: engine.servers[0].torn, "the failed push was never tried")
            assert call(url, "/is_paused") == (200, {"is_paused": True})
            assert engine.status().free_slots == 0
            engine.submit(Request("a", [3, 4, 5], GREEDY))
            time.sleep(1.0)
            out = engine.step()
            assert not out.tokens and engine.status().running == 0  # it waits, unsent
            engine.close()  # its generator dies; the one restarted attaches:
            with contextlib.closing(RemoteEngine(tiny_model_dir, remote)) as restarted:
                assert restarted.servers[0].torn and restarted.servers[0].version == 2
                assert restarted.status().free_slots == 0
                restarted.submit(Request("a", [3, 4, 5], GREEDY))
                time.sleep(0.5)
                assert restarted.status().running == 0
                older = perturbed_weights(tiny_model_dir, tmp_path / "v1")
                state = load_model(ModelConfig(path=str(older))).state_dict()
                publisher.publish(1, FullParameters.of(state))
                restarted.stage_weights(push, 1)
                wait_until(lambda: not restarted.servers[0].torn, "the torn server stayed out")
                assert call(url, "/is_paused") == (200, {"is_paused": False})
                tokens, _ = drain(restarted, ["a"])
                assert tokens["a"] and {t.version for t in tokens["a"]} == {1}
                assert restarted.servers[0].version == 1


def wait_until(condition, message: str, timeout_s: float = 30.0) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, message
        time.sleep(0.05)


def ask_raw(publisher, url: str, version: int, lineage: str, deadline: float) -> TransferDone:
    """The publisher's answer to one ``TransferAsk``, sent as a generator sends it."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.connect(publisher.endpoint)
        ask = TransferAsk(
            run_id="run",
            worker_id="g9",
            version=version,
            url=url,
            lineage=lineage,
            deadline=deadline,
        )
        sock.send(encode(ask))
        assert sock.poll(30_000)
        return WireDecoder("run", expected=TransferDone).decode(sock.recv())
    finally:
        ctx.destroy(linger=0)


@contextlib.contextmanager
def sending(cfg: RolloutConfig, model_dir: str):
    """(the trainer's publisher, a remote engine on ``cfg``'s servers, its TrainerPush)."""
    publisher = weight_publisher(cfg.site(), model_dir, cfg.engine, num_generators=1)
    assert isinstance(publisher, VllmTransferPublisher)
    engine = RemoteEngine(model_dir, cfg.engine.remote, log_dir=cfg.run_dir)
    ctx, stop = zmq.Context(), threading.Event()
    header = WeightsByTransfer(
        run_id=cfg.run_id, version=0, endpoint=publisher.endpoint, lineage=publisher.lineage
    )
    try:
        yield publisher, engine, TrainerPush(cfg, "g0", header, ctx, stop)
    finally:
        engine.close()
        publisher.close()
        ctx.destroy(linger=0)


def check_a_version(publisher, engine, push, version, tmp_path, model_dir, tol):
    """Publish ``version`` (odd: perturbed weights; even: the model's), have the engine
    ask for it, and compare its greedy tokens with an embedded engine's on those weights."""
    weights = perturbed_weights(model_dir, tmp_path / f"v{version}") if version % 2 else model_dir
    state = load_model(ModelConfig(path=str(weights))).state_dict()  # on the CPU, as gathered
    publisher.publish(version, FullParameters.of(state))
    engine.stage_weights(push, version, wait=True)
    got = greedy(engine, [3, 4, 5])
    assert {t.version for t in got} == {version}
    local = EmbeddedEngine(str(weights), EmbeddedEngineConfig(max_slots=2, threads=1))
    want = greedy(local, [3, 4, 5])
    local.close()
    assert [t.token_id for t in got] == [t.token_id for t in want]
    assert all(math.isclose(g.logprob, w.logprob, abs_tol=tol) for g, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not VLLM, reason="needs vllm and a CUDA GPU")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU")
def test_the_trainer_sends_versions_into_vllm_over_nccl(tiny_model_dir, tmp_path):
    """The same against ``vllm serve`` launched with vLLM's NCCL weight-transfer engine:
    the server on the first GPU, the trainer's rank 0 on the last."""
    torch.cuda.set_device(torch.cuda.device_count() - 1)
    remote = RemoteEngineConfig(
        server="vllm",
        weight_update="nccl",
        mem_fraction_static=0.2,
        max_seq_len=128,
        extra_args=["--enforce-eager", "--dtype", "float32"],
    )
    cfg = transfer_config(tmp_path / "run", remote)
    with sending(cfg, tiny_model_dir) as (publisher, engine, push):
        for version in (1, 2):  # vLLM computes in its own kernels: logprobs close, not equal
            check_a_version(publisher, engine, push, version, tmp_path, tiny_model_dir, 2e-2)
        assert publisher.transfers == 2


def test_the_fronts_transfer_routes_answer_vllms_errors(tiny_model_dir, tmp_path):
    """Malformed: a 400; what vLLM's workers refuse (out of order, ``packed`` in
    ``update_info``, where vLLM's ``NCCLWeightTransferUpdateInfo`` has no such field): a
    500 with their message. vLLM's error shape, nothing applied."""
    with launched_front(tiny_model_dir, tmp_path) as url:
        assert call(url, "/get_world_size") == (200, {"world_size": 1})
        info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
        packed = {**info, "packed": True}
        cases = [
            ("/update_weights", {}, 400, "Missing 'update_info'"),
            ("/init_weight_transfer_engine", {"init_info": {"master_port": 1}}, 400, "address"),
            ("/start_weight_update", {}, 500, "not initialized"),
            ("/update_weights", {"update_info": packed}, 500, "Invalid update_info"),
            ("/update_weights", {"update_info": info}, 500, "start_weight_update must be"),
            ("/finish_weight_update", {"weight_version": "1"}, 500, "without a matching start"),
        ]
        for path, body, code, message in cases:
            status, answer = call(url, path, body)
            assert status == code, (path, answer)
            assert message in answer["error"]["message"] and answer["error"]["code"] == code
        assert call(url, "/weight_info") == (200, {"weight_version": "default"})


def test_the_transfer_settings_are_checked_before_a_run(tiny_model_dir):
    base = load_experiment("experiments/tiny_grpo.py")
    gloo = RemoteEngineConfig(server="vllm", weight_update="gloo")
    with pytest.raises(ValueError, match="needs engine.remote.server=vllm and the front's"):
        gloo.check()  # no urls: it would launch real vLLM, which speaks NCCL
    remote = RemoteEngineConfig(server="vllm", weight_update="gloo", urls=["http://h:1"])
    base.engine = EngineConfig(backend="remote", remote=remote)
    base.num_generators = 2
    with pytest.raises(ConfigError, match="every generator would attach to the same servers"):
        base.check_remote()
    base.num_generators = 1
    base.engine.remote = RemoteEngineConfig(server="vllm", weight_update="nccl")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="vllm does not import here"):
            base.check_remote()


@pytest.mark.slow
def test_launcher_runs_tiny_grpo_with_weights_sent_by_vllms_transfer(tiny_model_dir, tmp_path):
    """The asynchronous loop with its generator attached to the front through vLLM's API and
    weights sent by the trainer over gloo: no weights directory is written, the front runs
    published versions, and consumed tokens carry them."""
    run_dir = tmp_path / "run"
    with launched_front(tiny_model_dir, tmp_path) as front:
        proc = run_tiny_grpo(run_dir, tiny_model_dir, front, "engine.remote.weight_update=gloo")
        label = call(front, "/weight_info")[1]["weight_version"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    losses = [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert not (run_dir / "weights").exists()
    counters = json.loads((run_dir / "buffer_counters.json").read_text())
    assert counters["buffer/generator_version_max"] >= 2
    assert counters["buffer/newest_consumed_version"] >= 1
    summary = json.loads((run_dir / "generator_g0_summary.json").read_text())
    assert summary["weights_received"] >= 2 and int(label) >= 2
