"""The embedded engine against a real vLLM server on this machine's CPUs, the figures of
``tools/bench_engine.py --vllm``: generated tokens/s at 1, 16 and 64 requests in flight.

Both run the same model (a tiny Qwen2 with a BPE tokenizer and heads 32 wide, vLLM's
smallest on a CPU; ``--model`` for another), the same prompts (random ids, 16 to 64
tokens), the same sampling (temperature 1, every request exactly ``--max-new-tokens``:
EOS is ignored by both) and one thread each (vLLM's CPU worker runs one torch thread on
two cores; the embedded engine is given one). The embedded engine runs in this process
with ``max_slots`` = the concurrency; vLLM is the CPU build from
``tools/vllm_server_env.sh`` (float32, eager unless ``--vllm-compiled``), driven as the
remote engine drives it: non-streamed ``/v1/completions`` with the chosen token's logprob
and token ids, at most ``concurrency`` in flight. Each concurrency is measured in
``--runs`` alternating runs (which engine goes first alternates); the figures are
medians. A figure to know, not a bar to meet.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import torch

from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.models import TinyModelConfig, model_config
from asyncrl.random_models import build_tiny_bpe_model

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 16, 64)

Requests = list[list[int]]


def tiny_bpe_model() -> str:
    """The BPE tiny model of ``experiments/bpe_sft.py`` (random weights), built here."""
    texts = [f"Calculate {a} + {b}. {a + b}" for a in range(100) for b in range(0, 100, 7)]
    spec = TinyModelConfig(tokenizer="qwen", tie_embeddings=True)
    return str(build_tiny_bpe_model(Path(tempfile.mkdtemp()) / "tiny-bpe", texts, spec))


def make_requests(count: int, vocab: int, seed: int) -> Requests:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(count)]


def embedded_rate(model_dir: str, requests: Requests, concurrency: int, new: int) -> float:
    cfg = EmbeddedEngineConfig(max_slots=concurrency, max_seq_len=256, threads=1)
    engine = EmbeddedEngine(model_dir, cfg)
    engine.eos_ids = set()  # every request makes exactly ``new`` tokens, as vLLM's below
    start = time.perf_counter()
    for i, prompt in enumerate(requests):
        params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=i)
        engine.submit(Request(str(i), prompt, params))
    tokens = 0
    while not engine.idle:
        tokens += len(engine.step().tokens)
    seconds = time.perf_counter() - start
    engine.close()
    assert tokens == new * len(requests), tokens
    return tokens / seconds


async def _vllm_rate(url: str, model: str, requests: Requests, concurrency: int, new: int):
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 1.0}
        body |= {"top_p": 1.0, "top_k": -1, "logprobs": 0, "return_token_ids": True}
        body["ignore_eos"] = True
        async with gate, session.post(f"{url}/v1/completions", json=body) as resp:
            reply = await resp.json()
        return len(reply["choices"][0]["token_ids"])

    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(session, p) for p in requests))
        seconds = time.perf_counter() - start
    assert sum(counts) == new * len(requests), counts
    return sum(counts) / seconds


def vllm_rate(url: str, model: str, requests: Requests, concurrency: int, new: int) -> float:
    return asyncio.run(_vllm_rate(url, model, requests, concurrency, new))


@contextlib.contextmanager
def vllm_server(model_dir: str, compiled: bool):
    """A real vLLM server (``tools/vllm_server_env.sh serve``) on a free port; its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--max-model-len", "256", "--max-num-seqs", str(max(CONCURRENCY))]
    cmd = ["bash", str(ROOT / "tools" / "vllm_server_env.sh"), "serve", model_dir, str(port)]
    env = {**os.environ, "VLLM_EAGER": "0" if compiled else "1"}  # compiled: vLLM's default
    log = open(Path(tempfile.mkdtemp()) / "vllm.log", "w")
    proc = subprocess.Popen(
        cmd + flags, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    url, start = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            if proc.poll() is not None or time.monotonic() - start > 600:
                raise RuntimeError(f"vLLM did not start; see {log.name}")
            time.sleep(1)
        print(f"vLLM ready in {time.monotonic() - start:.0f} s", file=sys.stderr)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def compare(model_dir: str, runs: int, new: int, compiled: bool) -> dict:
    """Every figure of the comparison, and the JSON line's fields."""
    torch.set_num_threads(1)
    vocab = model_config(model_dir).vocab_size
    rates: dict[str, list[float]] = {}
    with vllm_server(model_dir, compiled) as url:
        vllm_rate(url, model_dir, make_requests(4, vocab, 99), 4, 8)  # warm-up
        for run in range(runs):
            for c in CONCURRENCY:
                requests = make_requests(max(8, 4 * c), vocab, seed=run * 1000 + c)
                order = ("embedded", "vllm") if run % 2 == 0 else ("vllm", "embedded")
                for who in order:
                    if who == "embedded":
                        rate = embedded_rate(model_dir, requests, c, new)
                    else:
                        rate = vllm_rate(url, model_dir, requests, c, new)
                    rates.setdefault(f"{who}_{c}", []).append(rate)
            print(
                f"run {run}: " + ", ".join(f"{k}={v[-1]:.0f}" for k, v in rates.items()),
                file=sys.stderr,
            )
    med = {k: statistics.median(v) for k, v in rates.items()}
    out: dict = {"runs": runs, "max_new_tokens": new, "vllm_compiled": compiled}
    for c in CONCURRENCY:
        out[f"embedded_tokens_per_s_c{c}"] = round(med[f"embedded_{c}"], 1)
        out[f"vllm_tokens_per_s_c{c}"] = round(med[f"vllm_{c}"], 1)
        out[f"embedded_over_vllm_c{c}"] = round(med[f"embedded_{c}"] / med[f"vllm_{c}"], 3)
    return out
