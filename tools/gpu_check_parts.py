"""The CUDA parts of ``tools/gpu_check.py``, each run in a child process of its own: the
trainer's bf16 FSDP2 steps and the publish into the CUDA engine, the engine's decoding,
the NCCL broadcast. Each returns a result dict: ``ok`` and figures, or ``skipped`` and why.
``DEVICE`` is ``cuda``; a CPU test sets ``cpu`` to run the same logic on a tiny model
(bf16 compute is CUDA's, so there the trainer's own ``ok`` stays false).
"""

from __future__ import annotations

import gc
import math
import os
import random
import time
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.algorithms.losses import sft_loss
from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.models import ModelConfig, load_model, model_config
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import DistInfo, init_distributed, shutdown_distributed
from asyncrl.trainer.packing import TokenSequence, make_micro_batches

DEVICE = "cuda"
"""Where every part runs (see the module docstring)."""
GPU_ONLY_OPTIONS = ("activation_checkpointing", "cpu_offload")
"""TrainerConfig switches that only an accelerator exercises (each tried when it exists)."""


def random_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def sync() -> None:
    """Wait for the device's queued work, so a timing covers it."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_gb() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None


# ---- trainer and publish ---------------------------------------------------------------
def trainer_checks(model: str, out: Path) -> dict:
    """bf16 FSDP2 steps (plain, then with each GPU-only option), then the publish of the
    plain run's weights into the CUDA engine."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    (out / "rendezvous").unlink(missing_ok=True)
    info = init_distributed(DEVICE, str(out / "rendezvous"))  # NCCL on CUDA, one rank
    results, core = {}, None
    try:
        core, results["trainer"] = bf16_steps(model, info, TrainerConfig())
        results["publish"] = publish_check(core, model)
    except Exception as e:  # the figures so far still count
        results.setdefault("trainer", {"ok": False, "error": repr(e)[:500]})
        results.setdefault("publish", {"ok": False, "error": repr(e)[:500]})
    del core
    have = {f.name for f in fields(TrainerConfig)}
    for option in GPU_ONLY_OPTIONS:
        if option not in have:
            results[f"trainer_{option}"] = {"skipped": f"TrainerConfig has no {option}"}
            continue
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        try:
            _, results[f"trainer_{option}"] = bf16_steps(
                model, info, TrainerConfig(**{option: True})
            )
        except Exception as e:
            results[f"trainer_{option}"] = {"ok": False, "error": repr(e)[:500]}
    shutdown_distributed()
    return results


def bf16_steps(
    model: str, info: DistInfo, cfg: TrainerConfig, steps: int = 4
) -> tuple[TrainerCore, dict]:
    """``steps`` SFT updates on one fixed batch (32 × 256 tokens): the loss must fall."""
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    optim = OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant")
    core = TrainerCore(ModelConfig(path=model), cfg, optim, info, pad_id=0)
    rng = random.Random(0)
    vocab = core.model.config.vocab_size
    rows, length = (32, 256) if DEVICE == "cuda" else (8, 64)  # CPU: the tests' tiny run
    mask = [0] * (length // 8) + [1] * (length - length // 8)
    # Each row repeats a short phrase of its own: uniform random tokens are already at
    # their entropy under a random init, and no step can lower that loss.
    phrases = [random_ids(rng, vocab, 16) for _ in range(rows)]
    batch = [TokenSequence((p * length)[:length], mask) for p in phrases]
    micro = make_micro_batches(batch, 8192, "packed", 0, 1024)
    compute = layer_dtype(core, micro[0].to(info.device))
    losses, times = [], []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        stats = core.train_step(
            micro, lambda logits, mb: sft_loss(logits, mb.input_ids, mb.loss_mask)
        )
        sync()
        losses.append(stats.loss)
        times.append(time.perf_counter() - start)
    params = {str(p.dtype) for p in core.model.parameters()}
    step_s = sorted(times[1:])[len(times[1:]) // 2]  # the median after the first (warm-up)
    ok = all(map(math.isfinite, losses)) and losses[-1] < losses[0] and compute == torch.bfloat16
    return core, {
        "ok": ok,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "compute_dtype": str(compute),
        "param_dtypes": sorted(params),
        "step_s": round(step_s, 3),
        "tokens_per_s": round(sum(len(s) for s in batch) / step_s),
        "peak_gb": peak_gb(),
    }


@torch.no_grad()
def layer_dtype(core: TrainerCore, mb) -> torch.dtype:
    """The dtype the first decoder layer computes in (bf16 under FSDP's mixed precision
    on CUDA); the logits' own dtype depends on the transformers version."""
    kinds = set(getattr(core.model, "_no_split_modules", None) or [])
    # fully_shard swaps a layer's class for a subclass (FSDPQwen2DecoderLayer): match bases.
    layer = next(m for m in core.model.modules() if kinds & {c.__name__ for c in type(m).__mro__})
    seen: list[torch.dtype] = []

    def record(module, args, out) -> None:
        seen.append((out[0] if isinstance(out, tuple) else out).dtype)

    handle = layer.register_forward_hook(record)
    core.forward(mb)
    handle.remove()
    return seen[0]


@torch.no_grad()
def publish_check(core: TrainerCore, model: str) -> dict:
    """The trainer's weights staged into a decoding engine (fp32, as the trainer's master
    weights): the flip lands at a step boundary, the running requests' later tokens carry
    version 1, and a request started after it has the logprobs of a transformers forward
    with the trainer's weights (not the starting ones'). The running requests go on over
    the K/V computed before the flip (policy ``keep``), so only the new one is compared."""
    engine = EmbeddedEngine(
        model, EmbeddedEngineConfig(device=DEVICE, max_slots=8, max_seq_len=512)
    )
    engine.eos_ids = set()  # every request runs to max_new_tokens
    rng = random.Random(1)
    prompts = [random_ids(rng, core.model.config.vocab_size, 48) for _ in range(8)]
    completion: dict[str, list[tuple[int, float, int]]] = {}

    def submit(request_id: str, prompt: list[int]) -> None:
        completion[request_id] = []
        engine.submit(
            Request(request_id, prompt, SamplingParams(max_new_tokens=64, temperature=0.0))
        )

    def step() -> None:
        for t in engine.step().tokens:
            completion[t.request_id].append((t.token_id, t.logprob, t.version))

    for i, prompt in enumerate(prompts[1:]):
        submit(str(i), prompt)
    for _ in range(4):
        step()
    state = {name: t.detach().clone() for name, t in core.full_parameters().tensors}
    start = time.perf_counter()
    engine.stage_weights(state, 1)
    while engine.status().version < 1 and time.perf_counter() - start < 60:
        step()
    flip_s = time.perf_counter() - start
    submit("probe", prompts[0])
    while not engine.idle:
        step()
    engine.close()
    running = [[v for _, _, v in completion[str(i)]] for i in range(len(prompts) - 1)]
    flipped = all(v == sorted(v) and v[-1] == 1 for v in running)
    probe = completion["probe"]
    engine_lp = [lp for _, lp, _ in probe]
    diff_new = max_diff(reference_logprobs(model, state, prompts[0], probe), engine_lp)
    diff_old = max_diff(reference_logprobs(model, None, prompts[0], probe), engine_lp)
    return {
        "ok": flipped and {v for _, _, v in probe} == {1} and diff_new < 1e-3 < diff_old,
        "flip_s": round(flip_s, 3),
        "tokens_before_flip": sum(v.count(0) for v in running),
        "max_logprob_diff_trainer_weights": diff_new,
        "max_logprob_diff_start_weights": diff_old,
    }


def max_diff(a: list[float], b: list[float]) -> float:
    return float(f"{max(abs(x - y) for x, y in zip(a, b, strict=True)):.3g}")


def reference_logprobs(
    model: str, state: dict | None, prompt: list[int], completion: list[tuple[int, float, int]]
) -> list[float]:
    """Per-token logprobs of ``completion`` after ``prompt`` by transformers, in fp32 on
    CUDA, with ``state`` loaded (None: the model's own weights)."""
    hf = load_model(ModelConfig(path=model), DEVICE).eval()
    if state is not None:
        hf.load_state_dict(state, strict=False)
        if hf.config.tie_word_embeddings:
            hf.tie_weights()
    tokens = [t for t, _, _ in completion]
    ids = torch.tensor([prompt + tokens], device=DEVICE)
    logprobs = torch.log_softmax(hf(input_ids=ids).logits[0].float(), -1)
    at = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1, device=DEVICE)
    return logprobs[at, ids[0, at + 1]].tolist()


# ---- the engine alone --------------------------------------------------------------------
@torch.no_grad()
def engine_check(model: str) -> dict:
    """bf16 decoding of 128 greedy requests of 128 tokens over 64 slots: tokens/s, and how
    often the engine's greedy token is transformers' argmax (bf16, the same GPU)."""
    requests, new_tokens = (128, 128) if DEVICE == "cuda" else (16, 32)  # CPU: the tests'
    cfg = EmbeddedEngineConfig(device=DEVICE, dtype="bfloat16", max_slots=64, max_seq_len=512)
    engine = EmbeddedEngine(model, cfg)
    engine.eos_ids = set()
    rng = random.Random(2)
    vocab = model_config(model).vocab_size
    prompts = [random_ids(rng, vocab, rng.randint(32, 128)) for _ in range(requests)]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        engine.submit(Request(str(i), prompt, params))
    first: list[int] = []
    sync()
    start, tokens = time.perf_counter(), 0
    while not engine.idle:
        out = engine.step().tokens
        tokens += len(out)
        first += [t.token_id for t in out if t.request_id == "0"]
    sync()
    seconds = time.perf_counter() - start
    engine.close()
    hf = load_model(ModelConfig(path=model), DEVICE).to(torch.bfloat16).eval()
    ids = torch.tensor([prompts[0] + first], device=DEVICE)
    argmax = hf(input_ids=ids).logits[0, len(prompts[0]) - 1 : -1].argmax(-1).tolist()
    agreement = sum(a == b for a, b in zip(argmax, first)) / max(len(first), 1)
    return {
        "ok": tokens == requests * new_tokens and agreement >= 0.9,
        "tokens_per_s": round(tokens / seconds),
        "greedy_agreement": round(agreement, 3),
        "peak_gb": peak_gb(),
    }


# ---- NCCL between two GPUs -----------------------------------------------------------
def nccl_check(model: str) -> dict:
    if torch.cuda.device_count() < 2:
        return {
            "skipped": f"needs two GPUs and {torch.cuda.device_count()} are here (NCCL "
            f"refuses two ranks on one device; the trainer's steps ran over NCCL, one rank)"
        }
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(nccl_rank, args=(model, queue), nprocs=2, join=True)
    return queue.get()


def nccl_rank(rank: int, model: str, queue) -> None:
    """Rank 0 broadcasts the model's bf16 state dict tensor by tensor, as the NCCL
    publisher does within a bucket; rank 1 checks each tensor's sum against rank 0's."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    state = load_model(ModelConfig(path=model), "cuda").to(torch.bfloat16).state_dict()
    if rank == 1:
        state = {k: torch.zeros_like(v) for k, v in state.items()}
    sums = torch.tensor([v.double().sum().item() for v in state.values()], device=DEVICE)
    dist.broadcast(sums, 0)
    names, size = list(state), 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    for name in names:
        dist.broadcast(state[name], 0)
        size += state[name].numel() * state[name].element_size()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    got = torch.tensor([v.double().sum().item() for v in state.values()], device=DEVICE)
    if rank == 1:
        queue.put(
            {
                "ok": bool(torch.allclose(got, sums)),
                "bytes": size,
                "gb_per_s": round(size / seconds / 1e9, 2),
            }
        )
    dist.destroy_process_group()
