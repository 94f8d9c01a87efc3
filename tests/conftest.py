"""Shared fixtures: a tiny random-init Qwen2 model and its char tokenizer, built once; a
tinier one with the small Qwen-style BPE tokenizer and its chat template."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from asyncrl.chat_tokenizers import save_tokenizer, small_tokenizer
from asyncrl.models import (
    ModelConfig,
    TinyModelConfig,
    build_tiny_model,
    load_model,
    load_tokenizer,
)
from asyncrl.tasks import TaskConfig, build_task
from asyncrl.trainer.dist import init_distributed

ROOT = Path(__file__).resolve().parents[1]


def launch(experiment: str, *overrides: str, timeout: float = 300) -> str:
    """``launch/local.py experiments/EXPERIMENT overrides`` to its end; its output (stdout,
    then stderr: the launcher's ``[launch]`` lines), after asserting it succeeded (the
    tail of both streams if not)."""
    cmd = [sys.executable, "launch/local.py", f"experiments/{experiment}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


# Smaller than the demo's model so tests stay fast; same architecture and code path.
TEST_MODEL = TinyModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    max_positions=128,
    seed=0,
)


@pytest.fixture(scope="session")
def task():
    return build_task(TaskConfig(train_size=2000, eval_size=50))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, task):
    texts = [ex.prompt + ex.completion for ex in task.examples("train")]
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", texts, TEST_MODEL))


@pytest.fixture(scope="session")
def rm_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A reward model: the tiny policy's backbone with a random (nonzero) value head."""
    model = load_model(ModelConfig(path=tiny_model_dir, head="value"))
    torch.manual_seed(0)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    out = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(out)
    load_tokenizer(tiny_model_dir).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """A tiny random Qwen2 with the small Qwen-style tokenizer and its template."""
    tokenizer = small_tokenizer("qwen")
    out = tmp_path_factory.mktemp("chat-model")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return str(out)


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> dict[str, str]:
    """The real-vLLM tests' models (``tests/real_vllm.py``): a tied Qwen2 and an untied
    Llama, by name, with their BPE tokenizers and chat templates."""
    from .real_vllm import MODELS, build_model

    root = tmp_path_factory.mktemp("vllm-models")
    return {name: build_model(root / name, shape) for name, shape in MODELS.items()}


@pytest.fixture(scope="session")
def real_vllm_url(vllm_models, tmp_path_factory):
    """One real vLLM server on the tied Qwen2 for the session (``tests/real_vllm.py``):
    a test that changes its weights, label or pause state puts them back. Idle, it holds
    about 2.8 GB and no CPU."""
    from .real_vllm import vllm_server

    with vllm_server(vllm_models["qwen-tied"], tmp_path_factory.mktemp("vllm")) as url:
        yield url


@pytest.fixture(scope="session")
def dist_info(tmp_path_factory):
    """A one-rank gloo process group for in-process trainer cores (joined once; every
    later ``init_distributed`` in this process reuses it)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    return init_distributed("cpu", str(tmp_path_factory.mktemp("rdv") / "rendezvous"))


def wait_for_ranks(procs, timeout_s: float = 300) -> list[str]:
    """Wait for trainer-rank subprocesses (text stdout piped); each must exit 0, else the
    tail of its output is the failure message. Returns their outputs."""
    outputs = []
    for p in procs:
        output, _ = p.communicate(timeout=timeout_s)
        assert p.returncode == 0, output[-3000:]
        outputs.append(output)
    return outputs


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` whole: a sharded DTensor (FSDP2) gathered, a plain one as is."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole, by name."""
    return {name: full_tensor(p.grad) for name, p in model.named_parameters()}
