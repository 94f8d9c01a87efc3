"""A parametric GPU cost model for the simulator, and sweeps of the generator:trainer
split and η up to ~1,024 GPUs.

**Every number here is an assumption, not a measurement**: datasheet peaks (H100-SXM-like
by default) times efficiencies picked as typical, a model's shape guessed from its
parameter count. Nothing in this file was calibrated on a GPU run; use it to rank
configurations and see trends, and calibrate ``SimParams`` from a measured GPU run
(``asyncrl.sim.calibrate``) before trusting absolute figures.

Per generator engine (tensor parallel over ``tp`` GPUs), one decode step with b sequences
of mean context c (prompt + half the mean response):

    step(b) = overhead + [TP: 2 · layers · all-reduce latency] + 2N bytes / (tp · HBM · eff_bw)
              + b · ( kv_bytes_per_token · c / (tp · HBM · eff_bw) + 2N / (tp · peak · eff_decode) )
    prefill, and a flip's re-prefill, per token: 2N / (tp · peak · mfu_prefill)

(memory and compute terms are added, not overlapped: pessimistic near the roofline's
knee). The trainer (FSDP over T GPUs, bf16 weights, fp32 Adam) per token:
``6N / (T · peak · mfu_train)`` for the step and ``2N / (…)`` for the proximal-logprob
forward; per step the un-overlapped share of FSDP's traffic (≈ 3 · 2N bytes per GPU over
the slowest link). Weights (2N bytes) go out by **NCCL** (gather to rank 0, then a
broadcast: each 2N / network bandwidth) or **disk** (rank 0 writes at ``disk`` speed;
generator nodes read in parallel, bounded by the shared filesystem's aggregate). Memory:
the trainer needs ≥ 20N bytes over its GPUs; an engine's tp is the smallest power of two
whose memory holds the weights in 60 %; its slots are what the rest holds as KV cache.

Many identical engines are simulated as one generator with all their slots
(``SimConfig.engine_replicas``): a fluid approximation that keeps a 1,024-GPU sweep fast.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Literal

from asyncrl.sim.model import SimConfig, SimParams
from asyncrl.sim.simulate import run_simulation


@dataclass
class GpuSpec:
    """One accelerator and its links (assumed figures; override any of them)."""

    name: str = "h100-like (assumed)"
    peak_flops: float = 989e12
    """Dense bf16 FLOP/s."""
    hbm_bytes_per_s: float = 3.35e12
    memory_bytes: float = 80e9
    nvlink_bytes_per_s: float = 450e9
    """Per GPU, one direction, inside a node."""
    network_bytes_per_s: float = 50e9
    """Per GPU between nodes (400 Gb/s)."""
    gpus_per_node: int = 8
    disk_bytes_per_s: float = 2e9
    """One node writing or reading a weights directory."""
    shared_fs_bytes_per_s: float = 100e9
    """Aggregate read bandwidth of the shared filesystem."""
    decode_bandwidth_efficiency: float = 0.7
    decode_compute_efficiency: float = 0.5
    prefill_mfu: float = 0.5
    train_mfu: float = 0.4
    step_overhead_s: float = 0.002
    """Scheduling, sampling and kernel launches per decode step."""
    allreduce_latency_s: float = 10e-6
    collective_overlap: float = 0.7
    """Share of FSDP's gathers/reductions hidden behind compute."""


@dataclass
class Workload:
    """The RL job: model size, lengths, batch, filtering, weight transport (assumptions)."""

    model_params: float = 7e9
    prompt_tokens: int = 256
    response_mean: float = 1024.0
    response_max: int = 8192
    response_sigma: float = 0.8
    """Response lengths are log-normal with this σ, clipped to ``response_max``."""
    prompts_per_batch: int = 512
    samples_per_prompt: int = 16
    filter_probability: float = 0.3
    """Dynamic sampling: probability a finished group has all-equal rewards."""
    weight_sync: Literal["nccl", "disk"] = "nccl"
    max_slots: int = 512
    """Cap on an engine's concurrent sequences."""


def layers(n_params: float) -> int:
    """A transformer's depth for its size (Llama-like shapes; an assumption)."""
    for limit, depth in ((2e9, 24), (10e9, 32), (20e9, 40), (40e9, 64), (100e9, 80)):
        if n_params <= limit:
            return depth
    return 126


def kv_bytes_per_token(n_params: float) -> float:
    """bf16 K and V of one token over all layers with grouped-query attention, 8 KV heads
    of 128: Llama-3-8B's 128 KiB, scaled by depth (an assumption)."""
    return 2 * layers(n_params) * 8 * 128 * 2


def tensor_parallel(n_params: float, gpu: GpuSpec) -> int:
    tp = 1
    while 2 * n_params > 0.6 * tp * gpu.memory_bytes:
        tp *= 2
    return tp


def response_histogram(w: Workload, points: int = 64) -> dict[int, float]:
    """Log-normal response lengths (mean ``response_mean``), clipped, as a histogram."""
    mu = math.log(w.response_mean) - w.response_sigma**2 / 2
    normal, hist = NormalDist(), {}
    for i in range(points):
        z = normal.inv_cdf((i + 0.5) / points)
        length = int(min(w.response_max, max(1, round(math.exp(mu + w.response_sigma * z)))))
        hist[length] = hist.get(length, 0.0) + 1.0
    return hist


def engine_shape(w: Workload, gpu: GpuSpec) -> tuple[int, int]:
    """(tp, slots) of one generator engine."""
    tp = tensor_parallel(w.model_params, gpu)
    kv_budget = 0.9 * tp * gpu.memory_bytes - 2 * w.model_params
    per_seq = kv_bytes_per_token(w.model_params) * (w.prompt_tokens + w.response_mean)
    return tp, max(1, min(w.max_slots, int(kv_budget / per_seq)))


def min_trainer_gpus(w: Workload, gpu: GpuSpec) -> int:
    return math.ceil(20 * w.model_params / gpu.memory_bytes)


def gpu_params(w: Workload, gpu: GpuSpec, trainer_gpus: int, generator_nodes: int) -> SimParams:
    """``SimParams`` of a job on ``trainer_gpus`` trainer GPUs feeding generators on
    ``generator_nodes`` nodes (which matter only for reading weights from disk)."""
    n, tp = w.model_params, tensor_parallel(w.model_params, gpu)
    bw, ctx = (
        gpu.hbm_bytes_per_s * gpu.decode_bandwidth_efficiency,
        w.prompt_tokens + w.response_mean / 2,
    )
    tp_latency = 2 * layers(n) * gpu.allreduce_latency_s if tp > 1 else 0.0
    prefill = 2 * n / (tp * gpu.peak_flops * gpu.prefill_mfu)
    train_flops = trainer_gpus * gpu.peak_flops * gpu.train_mfu
    link = gpu.nvlink_bytes_per_s if trainer_gpus <= gpu.gpus_per_node else gpu.network_bytes_per_s
    gather = 2 * n / gpu.network_bytes_per_s
    if w.weight_sync == "nccl":
        publish = gather + 2 * n / gpu.network_bytes_per_s
        sync = publish
    else:
        publish = gather + 2 * n / gpu.disk_bytes_per_s
        read = max(
            2 * n / gpu.disk_bytes_per_s, 2 * n * generator_nodes / gpu.shared_fs_bytes_per_s
        )
        sync = publish + read
    return SimParams(
        decode_fixed_s=gpu.step_overhead_s + tp_latency + 2 * n / (tp * bw),
        decode_per_seq_s=kv_bytes_per_token(n) * ctx / (tp * bw)
        + 2 * n / (tp * gpu.peak_flops * gpu.decode_compute_efficiency),
        prefill_per_token_s=prefill,
        recompute_per_token_s=prefill,
        flip_fixed_s=0.0,
        message_s=0.001,
        weight_sync_s=sync,
        train_per_token_s=6 * n / train_flops,
        train_fixed_s=(1 - gpu.collective_overlap) * 3 * 2 * n / link,
        prep_per_token_s=2 * n / train_flops,
        publish_s=publish,
        eval_s=0.0,
        completion_lengths=response_histogram(w),
        prompt_lengths={w.prompt_tokens: 1.0},
        filter_schedule=[(0, w.filter_probability)],
        gen_parallel_fraction=0.0,
        train_parallel_fraction=0.0,
        source=f"gpu model: {gpu.name}",
        notes=["assumed GPU figures, not measured"],
    )


def point_config(
    w: Workload,
    slots: int,
    engines: int,
    max_staleness: int | None,
    colocated: bool,
    steps: int,
) -> SimConfig:
    """The simulated job of one sweep point: all ``engines`` as one generator's replicas,
    one trainer rank, no core limit, stopped after ``steps`` trainer steps."""
    return SimConfig(
        placement="colocated" if colocated else "async",
        num_generators=1,
        engine_slots=slots,
        engine_replicas=max(1, engines),
        engine_threads=1,
        max_prefill_tokens=max(16384, 4 * w.prompt_tokens),
        trainer_ranks=1,
        trainer_threads=1,
        prompts_per_batch=w.prompts_per_batch,
        samples_per_prompt=w.samples_per_prompt,
        max_staleness=0 if colocated else max_staleness,
        dynamic_sampling=True,
        max_new_tokens=w.response_max,
        eval_every=0,
        cores=1 << 30,
        duration_s=1e7,
        max_steps=steps,
    )


def sweep_point(
    w: Workload,
    gpu: GpuSpec,
    total_gpus: int,
    trainer_gpus: int,
    max_staleness: int | None,
    colocated: bool = False,
    steps: int = 16,
) -> dict[str, Any]:
    """Simulate one split (or the colocated placement on every GPU) for at least ``steps``
    trainer steps, and ``2·(η + 2)`` (40 unbounded) so that throughput is read over the second
    half, after the first η batches' warm-up."""
    steps = max(steps, 40 if max_staleness is None else 2 * (max_staleness + 2))
    tp, slots = engine_shape(w, gpu)
    gen_gpus = total_gpus if colocated else total_gpus - trainer_gpus
    engines = gen_gpus // tp
    train_on = total_gpus if colocated else trainer_gpus
    nodes = max(1, math.ceil(gen_gpus / gpu.gpus_per_node))
    params = gpu_params(w, gpu, train_on, nodes)
    cfg = point_config(w, slots, engines, max_staleness, colocated, steps)
    if colocated:  # weights stay in the process: no transfer, no publish
        params = dataclasses.replace(params, publish_s=0.0, weight_sync_s=0.0)
    sim = run_simulation(params, cfg)
    ends = sim.trainer.step_ends
    warm = max(1, len(ends) // 2)
    span = ends[-1][0] - ends[warm - 1][0]
    tokens = sum(k for _, k in ends[warm:])
    hist = sim.buffer.staleness
    consumed = sum(hist.values())
    t = sim.loop.now
    return {
        "placement": "colocated" if colocated else "async",
        "max_staleness": 0 if colocated else max_staleness,
        "total_gpus": total_gpus,
        "trainer_gpus": train_on,
        "generator_gpus": gen_gpus,
        "tp": tp,
        "engines": engines,
        "slots_per_engine": slots,
        "trained_tokens_per_s": tokens / span if span > 0 else 0.0,
        "trained_tokens_per_s_per_gpu": tokens / span / total_gpus if span > 0 else 0.0,
        "step_s": span / (len(ends) - warm) if len(ends) > warm else None,
        "generator_idle_fraction": 1 - sum(g.busy_s for g in sim.generators) / t,
        "generator_slot_fill": sum(g.batch_s for g in sim.generators)
        / (sum(g.slots for g in sim.generators) * t),
        "trainer_idle_fraction": sim.trainer.wait_s / t,
        "mean_staleness": sum(k * v for k, v in hist.items()) / consumed if consumed else 0.0,
        "weight_sync_s": params.weight_sync_s,
        "publish_s": params.publish_s,
    }


def split_candidates(w: Workload, gpu: GpuSpec, total_gpus: int, points: int = 7) -> list[int]:
    """Trainer GPU counts to try: multiples of a node (or of 1 below a node) from 1/8 to
    7/8 of the GPUs, at least what the trainer's memory needs, leaving one engine."""
    tp = tensor_parallel(w.model_params, gpu)
    unit = gpu.gpus_per_node if total_gpus >= 4 * gpu.gpus_per_node else 1
    lo = max(min_trainer_gpus(w, gpu), unit)
    out = set()
    for i in range(1, points + 1):
        t = max(lo, round(total_gpus * i / (points + 1) / unit) * unit)
        if total_gpus - t >= tp:
            out.add(t)
    return sorted(out)


def sweep(
    w: Workload, gpu: GpuSpec, total_gpus: int, etas: list[int | None], steps: int = 16
) -> list[dict[str, Any]]:
    rows = [
        sweep_point(w, gpu, total_gpus, t, eta, steps=steps)
        for t in split_candidates(w, gpu, total_gpus)
        for eta in etas
    ]
    rows.append(sweep_point(w, gpu, total_gpus, total_gpus, 0, colocated=True, steps=steps))
    return rows
