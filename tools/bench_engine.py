"""Benchmark: the embedded engine against transformers' ``generate``, and decode-step
latency while weights are flipped; with ``--vllm``, against a real vLLM server on the CPU
instead (``tools/bench_engine_vllm.py`` says how).

Throughput: 256 requests with prompt lengths and ``max_new_tokens`` drawn log-uniformly
over wide ranges, on the tiny model, one thread, greedy, EOS disabled so each request
produces exactly its ``max_new_tokens``. The engine runs them with continuous batching
over ``--concurrency`` slots; ``generate`` runs the same requests in order, in static
batches of the same size (left-padded, each batch decoding until its longest request is
done). Only each request's own tokens count for both.

Shared prefill: the same number of requests in groups of ``--group`` with one prompt (a
GRPO group's samples, lengths drawn as above), through the engine with ``share_prefill``
on and off, alternating within each run.

Flip latency: all slots are filled, then decode steps are timed with no flips and with
new weights staged every 10 steps (policy ``keep``: the flip itself; ``recompute`` also
re-prefills every running sequence, reported apart). Each figure is the median over
``--runs`` runs. Ends with one JSON line:

    {"engine_tokens_per_s": ..., "hf_tokens_per_s": ..., "speedup": ...,
     "grouped_shared_tokens_per_s": ..., "grouped_each_tokens_per_s": ...,
     "share_prefill_speedup": ..., "step_ms_p99_flipping": ..., "step_ms_p99_steady": ...}
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.models import (
    ModelConfig,
    TinyModelConfig,
    build_tiny_model,
    load_model,
    model_config,
)


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def make_requests(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, vocab) for _ in range(log_uniform(rng, 4, 200))],
            log_uniform(rng, 4, 200),
        )
        for _ in range(n)
    ]


def engine_throughput(model_dir: str, requests, concurrency: int, share: bool = True) -> float:
    cfg = EmbeddedEngineConfig(max_slots=concurrency, max_seq_len=512, share_prefill=share)
    engine = EmbeddedEngine(model_dir, cfg)
    engine.eos_ids = set()  # lengths come from max_new_tokens, as in the HF run
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):
        engine.submit(Request(str(i), prompt, SamplingParams(max_new_tokens=n, temperature=0.0)))
    tokens = 0
    while not engine.idle:
        tokens += len(engine.step().tokens)
    seconds = time.perf_counter() - start
    engine.close()
    assert tokens == sum(n for _, n in requests)
    return tokens / seconds


@torch.no_grad()
def hf_throughput(model_dir: str, requests, concurrency: int) -> float:
    model = load_model(ModelConfig(path=model_dir)).eval()
    start = time.perf_counter()
    for b in range(0, len(requests), concurrency):
        batch = requests[b : b + concurrency]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=0,
        )
    return sum(n for _, n in requests) / (time.perf_counter() - start)


def step_latencies(
    model_dir: str, concurrency: int, steps: int, flip_every: int, policy: str
) -> list[float]:
    cfg = EmbeddedEngineConfig(max_slots=concurrency, max_seq_len=512, flip_policy=policy)
    engine = EmbeddedEngine(model_dir, cfg)
    engine.eos_ids = set()
    rng = random.Random(1)
    base = load_model(ModelConfig(path=model_dir)).state_dict()  # the engine's weights
    vocab = model_config(model_dir).vocab_size
    for i in range(concurrency):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))]
        engine.submit(
            Request(str(i), prompt, SamplingParams(max_new_tokens=steps + 8, temperature=0.0))
        )
    engine.step()  # prefill all; from here on every step is a decode step
    times = []
    for s in range(steps):
        if flip_every and s % flip_every == flip_every - 1:
            # Fresh tensors each time, as a receiver thread would hand them over.
            version = engine.status().version + 1
            engine.stage_weights({k: v.clone() for k, v in base.items()}, version)
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1000)
    flips = engine.status().metrics["engine/flips"]
    engine.close()
    if flip_every:
        assert flips >= steps // flip_every - 2, flips
    return times


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="", help="HF model dir (default: build the demo's tiny model)"
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--group", type=int, default=4, help="requests per prompt (shared prefill)")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="instead: the embedded engine against a real vLLM server on the CPU "
        "(tools/bench_engine_vllm.py; needs tools/vllm_server_env.sh install)",
    )
    parser.add_argument("--vllm-compiled", action="store_true", help="vLLM with torch.compile")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="with --vllm")
    return parser.parse_args()


def one_run(model_dir: str, args: argparse.Namespace, run: int) -> dict[str, float]:
    """Every figure of run ``run``: throughputs, speedups and p99 step times (ms)."""
    requests = make_requests(args.requests, model_config(model_dir).vocab_size, seed=run)
    engine_rate = engine_throughput(model_dir, requests, args.concurrency)
    hf_rate = hf_throughput(model_dir, requests, args.concurrency)
    grouped = [r for r in requests[: args.requests // args.group] for _ in range(args.group)]
    order = (True, False) if run % 2 == 0 else (False, True)  # alternate who goes first
    rates = {
        share: engine_throughput(model_dir, grouped, args.concurrency, share) for share in order
    }

    def latency(flip_every: int, policy: str) -> float:
        return p99(
            step_latencies(model_dir, args.concurrency, args.latency_steps, flip_every, policy)
        )

    return {
        "engine": engine_rate,
        "hf": hf_rate,
        "speedup": engine_rate / hf_rate,
        "shared": rates[True],
        "each": rates[False],
        "share_speedup": rates[True] / rates[False],
        "steady": latency(0, "keep"),
        "keep": latency(10, "keep"),
        "recompute": latency(10, "recompute"),
    }


def summary(med: dict[str, float], args: argparse.Namespace) -> dict[str, float]:
    """The final JSON line: the median of each figure over the runs."""
    return {
        "engine_tokens_per_s": round(med["engine"], 1),
        "hf_tokens_per_s": round(med["hf"], 1),
        "speedup": round(med["speedup"], 3),
        "grouped_shared_tokens_per_s": round(med["shared"], 1),
        "grouped_each_tokens_per_s": round(med["each"], 1),
        "share_prefill_speedup": round(med["share_speedup"], 3),
        "group": args.group,
        "step_ms_p99_flipping": round(med["keep"], 3),
        "step_ms_p99_steady": round(med["steady"], 3),
        "step_ms_p99_flipping_recompute": round(med["recompute"], 3),
        "runs": args.runs,
        "concurrency": args.concurrency,
        "threads": args.threads,
    }


def main() -> None:
    args = parse_args()
    if args.vllm:
        from bench_engine_vllm import compare, tiny_bpe_model

        model = args.model or tiny_bpe_model()
        print(json.dumps(compare(model, args.runs, args.max_new_tokens, args.vllm_compiled)))
        return
    torch.set_num_threads(args.threads)
    model_dir = args.model
    if not model_dir:
        alphabet = [chr(c) for c in range(32, 127)]
        model_dir = str(
            build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", alphabet, TinyModelConfig())
        )
    figures: dict[str, list[float]] = {}
    for run in range(args.runs):
        for name, value in one_run(model_dir, args, run).items():
            figures.setdefault(name, []).append(value)
        print(
            f"run {run}: " + ", ".join(f"{k}={v[-1]:.2f}" for k, v in figures.items()),
            file=sys.stderr,
        )
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(json.dumps(summary(med, args)))


if __name__ == "__main__":
    main()
