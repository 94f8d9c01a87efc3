"""The remote engine against a real vLLM server (the CPU build, ``tests/real_vllm.py``):
what the front could not show. Behavior logprobs equal the trainer's recomputation; a
request interrupted by an update keeps each token's version; seeded requests do not
crash a CPU server; tied and untied models load published weights from disk; and the
trainer's weight-transfer payloads are what vLLM's own types take."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.config import RemoteEngineConfig
from asyncrl.engine.remote import RemoteEngine
from asyncrl.engine.weight_dirs import write_weights_dir
from asyncrl.models import ModelConfig, load_model
from asyncrl.trainer.publish_vllm import init_info, update_info
from asyncrl.trainer.transfer_senders import GlooSender

from .real_vllm import (
    VLLM_PYTHON,
    generated_tokens,
    real_vllm,
    restore_server,
    vllm_server,
    wait_until,
)
from .test_remote_engine import drain
from .test_vllm_client import trainer_logprobs

pytestmark = real_vllm


def attached(url: str, model_dir: str, **remote) -> RemoteEngine:
    cfg = RemoteEngineConfig(urls=[url], server="vllm", threads=1, startup_timeout_s=60, **remote)
    return RemoteEngine(model_dir, cfg)


def trainer_state(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """New weights as the trainer publishes them: its parameters, perturbed, a tied one
    once (the LM head of a tied model is not among them)."""
    model = load_model(ModelConfig(path=model_dir))
    gen = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
        for name, p in model.named_parameters()
    }


def greedy_of(model_dir: str, prompt: list[int], count: int) -> list[int]:
    """transformers' greedy continuation: what a server must sample at temperature 0."""
    model = load_model(ModelConfig(path=model_dir)).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def weight_info(url: str) -> str:
    out = subprocess.run(["curl", "-s", f"{url}/weight_info"], capture_output=True, text=True)
    return json.loads(out.stdout)["weight_version"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_behavior_logprobs_equal_the_trainers_recomputation(
    real_vllm_url, vllm_models, temperature
):
    """``--logprobs-mode processed_logprobs``: each token's logprob is the trainer's
    ``log_softmax(logits / T)`` for it, to float32 kernel rounding."""
    model_dir = vllm_models["qwen-tied"]
    engine = attached(real_vllm_url, model_dir)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 3], [12, 13, 14, 15]]
    try:
        params = SamplingParams(max_new_tokens=16, temperature=temperature)
        for i, prompt in enumerate(prompts):
            engine.submit(Request(f"r{i}", prompt, params))
        tokens, finished = drain(engine, [f"r{i}" for i in range(len(prompts))])
    finally:
        engine.close()
    for i, prompt in enumerate(prompts):
        got = tokens[f"r{i}"]
        want = trainer_logprobs(model_dir, prompt, [t.token_id for t in got], temperature)
        assert [t.logprob for t in got] == pytest.approx(want, abs=1e-3)
        assert finished[f"r{i}"].num_tokens == len(got)


def test_seeded_requests_prefilled_in_chunks_do_not_crash_a_cpu_server(real_vllm_url, vllm_models):
    """Seeded requests whose prompts outgrow vLLM's 2048-token prefill budget get prefilled
    in chunks; vLLM 0.32 on a CPU then crashes its engine ("CPU Generator does not use
    offset") if they carry a seed. The client learns the server's device at attach and
    sends none: every request finishes, and the server answers after."""
    engine = attached(real_vllm_url, vllm_models["qwen-tied"])
    gen = torch.Generator().manual_seed(0)
    try:
        for i in range(12):
            prompt = torch.randint(5, 600, (450,), generator=gen).tolist()
            params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=i)
            engine.submit(Request(f"s{i}", prompt, params))
        _, finished = drain(engine, [f"s{i}" for i in range(12)], timeout_s=120)
        assert {f.reason for f in finished.values()} <= {"eos", "length"}
        engine.submit(Request("after", [3, 4, 5], SamplingParams(max_new_tokens=4)))
        assert drain(engine, ["after"])[1]["after"].reason in ("eos", "length")
    finally:
        engine.close()


def test_an_update_mid_request_keeps_each_tokens_version(real_vllm_url, vllm_models, tmp_path):
    """Long requests decoding when new weights come: the client pauses the server, drains
    it, has it load the directory, labels it (``/weight_info``) and resumes; the requests
    go on under the new weights and their tokens carry the version that sampled them.
    The update comes once the server has generated a few tokens of each (its own count),
    so they are decoding then, far from their 400."""
    model_dir = vllm_models["qwen-tied"]
    new = write_weights_dir(trainer_state(model_dir, 1), model_dir, tmp_path / "v1")
    engine = attached(real_vllm_url, model_dir, max_inflight=16)
    v0 = engine.status().version
    prompts = {f"r{i}": [3, 4, 5 + i] for i in range(16)}
    try:
        for rid, prompt in prompts.items():
            engine.submit(Request(rid, prompt, SamplingParams(max_new_tokens=400, temperature=0)))
        before = generated_tokens(real_vllm_url)
        first = engine.step()  # sends them
        wait_until(
            lambda: generated_tokens(real_vllm_url) - before >= 3 * len(prompts),
            60,
            "the server generating",
        )
        engine.stage_weights(str(new), v0 + 1)
        more, finished = drain(engine, list(prompts), timeout_s=120)
        for t in first.tokens:
            more.setdefault(t.request_id, []).insert(0, t)
        both = 0
        for rid, got in more.items():
            versions = [t.version for t in got]
            assert versions == sorted(versions) and set(versions) <= {v0, v0 + 1}, versions
            both += set(versions) == {v0, v0 + 1}
            after = [t.token_id for t in got if t.version == v0 + 1]
            if after and finished[rid].reason == "length":  # the new weights' greedy tokens
                prefix = prompts[rid] + [t.token_id for t in got if t.version == v0]
                assert after[:5] == greedy_of(str(new), prefix, 5)[: len(after[:5])]
        assert both >= 1, "no request was decoding when the update came"
        assert weight_info(real_vllm_url) == str(v0 + 1)
    finally:  # the session's server gets its weights back for the tests after this one
        engine.close()
        restore_server(real_vllm_url, model_dir)


@pytest.fixture(scope="module")
def llama_url(vllm_models, tmp_path_factory):
    with vllm_server(vllm_models["llama-untied"], tmp_path_factory.mktemp("llama")) as url:
        yield url


@pytest.mark.parametrize("name", ["qwen-tied", "llama-untied"])
def test_tied_and_untied_models_load_published_weights(name, vllm_models, tmp_path, request):
    """The trainer's state (a tied LM head once, an untied one apart) written as a
    directory loads into vLLM (``reload_weights``): its greedy tokens are transformers'
    on the new weights, its label the version."""
    url = request.getfixturevalue("real_vllm_url" if name == "qwen-tied" else "llama_url")
    model_dir = vllm_models[name]
    state = trainer_state(model_dir, 2)
    assert ("lm_head.weight" in state) == (name == "llama-untied")
    new = write_weights_dir(state, model_dir, tmp_path / "v5")
    engine = attached(url, model_dir)
    try:
        engine.stage_weights(str(new), 5, wait=True)
        assert weight_info(url) == "5"
        engine.submit(Request("g", [3, 4, 5, 6], SamplingParams(max_new_tokens=8, temperature=0)))
        tokens, _ = drain(engine, ["g"])
        assert [t.token_id for t in tokens["g"]] == greedy_of(str(new), [3, 4, 5, 6], 8)
        assert {t.version for t in tokens["g"]} == {5}
    finally:
        engine.close()
        restore_server(url, model_dir)


def test_transfer_payloads_are_what_vllms_own_types_take(tmp_path):
    """The weight transfer's bodies against the installed vLLM's worker types: the
    ``init_info`` builds ``NCCLWeightTransferInitInfo`` (``packed`` is there), the
    ``update_info`` builds ``NCCLWeightTransferUpdateInfo`` (which has no ``packed``), and
    the calls the NCCL sender makes exist with the arguments it passes."""
    state = {"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.zeros(4, 2)}
    wire = {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}
    payloads = {
        "init_nccl": init_info("127.0.0.1", 29500, 2, wire),
        "init_gloo": init_info("127.0.0.1", 29500, 2, GlooSender.wire()),
        "update": update_info(state),
    }
    script = """
import inspect, json, sys
from vllm.distributed.weight_transfer import nccl_common, packed_tensor
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
p = json.load(open(sys.argv[1]))
for name in ("init_nccl", "init_gloo"):
    info = nccl_common.NCCLWeightTransferInitInfo(**p[name])
    assert info.packed == p[name]["packed"] and info.rank_offset == 1, info
NCCLWeightTransferUpdateInfo(**p["update"])
try:
    NCCLWeightTransferUpdateInfo(**p["update"], packed=True)
    raise SystemExit("update_info took packed")
except TypeError:
    pass
inspect.signature(nccl_common.trainer_init).bind({"master_address": "h"}, rank=0)
inspect.signature(packed_tensor.packed_nccl_broadcast_producer).bind(
    iter(()), None, 0, lambda item: item[1], 1 << 20, 2)
assert packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES > 0 < packed_tensor.DEFAULT_PACKED_NUM_BUFFERS
print("ok")
"""
    path = tmp_path / "payloads.json"
    path.write_text(json.dumps(payloads))
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", script, str(path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_reading_the_server_at_attach(real_vllm_url, vllm_models):
    """What the client learns of the real server: its release, its device (a CPU: no
    seeds), its served model; and that the requests it sends are accepted as sent."""
    engine = attached(real_vllm_url, vllm_models["qwen-tied"])
    try:
        server = engine.api.servers[real_vllm_url]
        assert server.version == (0, 32) and server.device == "cpu" and not server.seeded
        assert engine.api.models[real_vllm_url] == vllm_models["qwen-tied"]
        start = time.monotonic()
        engine.submit(Request("x", [3, 4], SamplingParams(max_new_tokens=3, seed=1)))
        assert drain(engine, ["x"])[1]["x"].num_tokens >= 1
        assert time.monotonic() - start < 30
    finally:
        engine.close()


def test_the_models_are_what_they_claim(vllm_models):
    """The tied Qwen2 ties its head, the untied Llama does not (what the weight test
    relies on), each with a chat template."""
    for name, tied in (("qwen-tied", True), ("llama-untied", False)):
        config = json.loads((Path(vllm_models[name]) / "config.json").read_text())
        assert config["tie_word_embeddings"] is tied
        tokenizer_config = json.loads(
            (Path(vllm_models[name]) / "tokenizer_config.json").read_text()
        )
        assert (
            "chat_template" in tokenizer_config
            or (Path(vllm_models[name]) / "chat_template.jinja").exists()
        )
