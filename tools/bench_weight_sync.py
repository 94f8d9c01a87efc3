"""Benchmark: weights to a generator in buckets by deltas, against the full fp32 publish,
over real optimizer steps of a real-shape model.

    python tools/bench_weight_sync.py [--model runs/models/qwen2.5-0.5b-2l] [--steps 8]
        [--dtype bfloat16|train] [--lr 1e-6] [--bucket-mb 64] [--anchor-every 50]

The trainer is the real FSDP2 core on ``--ranks`` gloo ranks (processes); each step is
an AdamW step on a next-token loss, after which the same version is published twice, in
alternating order: the full fp32 state gathered to rank 0 and sent as one message of raw
frames (the publish before buckets, to a subscriber that receives it), and through
``BucketPublisher``. Another process is a generator: an embedded engine decoding four
requests without pause, its ``WeightsIntake`` rebuilding each version and staging it,
the engine flipping between two steps. ``publish_s`` is the trainer's part: the call,
plus the next optimizer step's wait for the parameters to be read (``readout.wait``);
the gathering, copying, encoding and sending run on threads meanwhile, ``sender_s``
being the sender thread's first bucket to its last. At the end the engine's weights are compared, by CRC-32 of
each parameter, with the trainer's as the wire dtype rounds them. The learning rate is
RL's usual 1e-6: Adam moves each weight by about that much, below bf16's resolution for
most of them, so bf16 deltas are mostly zero bytes, and fp32 ones change the low bytes.
Ends with one JSON line:

    {"params", "full_bytes", "delta_bytes_median", "delta_ratio", "publish_s_median",
     "fp32_full_publish_s_median", "publish_speedup", "sender_s_median", "stage_s_median",
     "flip_ms_p99", "steady_step_ms_p50", "equal_after_updates", ...}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import torch
import zmq

from asyncrl.algorithms.losses import sft_loss
from asyncrl.buffer.config import RolloutConfig
from asyncrl.models import ModelConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import init_distributed, shutdown_distributed
from asyncrl.trainer.packing import TokenSequence, make_micro_batches
from asyncrl.trainer.publish import NoWeightPublisher
from asyncrl.transport import (
    TransportConfig,
    WeightSyncConfig,
    bind,
    make_socket,
    read_endpoints,
    write_endpoints,
)
from asyncrl.weights.frames import encode_tensors
from asyncrl.weights.sender import BucketPublisher

RUN_ID = "bench-weights"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="runs/models/qwen2.5-0.5b-2l")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (versions)")
    parser.add_argument("--dtype", choices=["bfloat16", "train"], default="bfloat16")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--anchor-every", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=192, help="tokens per training step")
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks (FSDP2, gloo)")
    parser.add_argument("--generator", default="", help=argparse.SUPPRESS)  # the child's run dir
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def config(run_dir: str, args: argparse.Namespace) -> RolloutConfig:
    weights = WeightSyncConfig(
        dtype=args.dtype, bucket_mb=args.bucket_mb, anchor_every=args.anchor_every
    )
    return RolloutConfig(run_dir=run_dir, run_id=RUN_ID, transport=TransportConfig(weights=weights))


def crcs(named) -> dict[str, int]:
    return {
        name: zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy()) for name, t in named
    }


# ---- the generator process --------------------------------------------------------------
def generator(args: argparse.Namespace) -> None:
    from asyncrl.engine.base import Request, SamplingParams
    from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from asyncrl.generator.stats import GeneratorStats
    from asyncrl.generator.weights import WeightsIntake

    run_dir = Path(args.generator)
    torch.set_num_threads(1)
    cfg = config(str(run_dir), args)
    engine = EmbeddedEngine(args.model, EmbeddedEngineConfig(max_slots=4, max_seq_len=160))
    ctx, stop, stats = zmq.Context(), threading.Event(), GeneratorStats()
    intake = WeightsIntake(cfg, "g0", engine, stats, ctx, stop)
    vocab = min(14000, engine.weights.active.model.config.vocab_size)
    drain = threading.Thread(target=drain_baseline, args=(run_dir, cfg, ctx, stop), daemon=True)
    drain.start()
    rng, steady, flips, n, deadline = random.Random(0), [], [], 0, None
    final = run_dir / "final.json"
    while True:
        if final.exists():
            if engine.status().version == json.loads(final.read_text())["version"]:
                break
            deadline = deadline or time.monotonic() + 120
            if time.monotonic() > deadline:  # reported as it stands: not equal
                break
        while engine.status().running + engine.status().waiting < 4:
            prompt = [rng.randrange(3, vocab) for _ in range(16)]
            params = SamplingParams(max_new_tokens=rng.randint(32, 128), seed=n)
            engine.submit(Request(f"r{n}", prompt, params))
            n += 1
        before = engine.status().version
        start = time.perf_counter()
        out = engine.step()
        (flips if out.version != before else steady).append(time.perf_counter() - start)
        status = engine.status()
        stats.observe_weights(status.version, status.staged_version)
    stop.set()
    stage_s, _ = stats.weight_timings()
    result = {
        "stage_s": stage_s,
        "flip_s": flips,
        "steady_s": steady,
        "anchors_asked": intake.anchors_asked,
        "version": engine.status().version,
        "bad_frames": dict(intake.decoder.errors),
        "crcs": crcs(engine.weights.active.model.named_parameters()),
    }
    (run_dir / "generator.json").write_text(json.dumps(result))
    intake.join(timeout=5)
    ctx.destroy(linger=0)


def drain_baseline(run_dir: Path, cfg, ctx: zmq.Context, stop: threading.Event) -> None:
    """Receive the full fp32 publishes, as a generator did, and drop them."""
    endpoint = read_endpoints(run_dir, "baseline", timeout_s=600)["weights"]
    sub = make_socket(
        ctx, zmq.SUB, cfg.transport, max_message_bytes=cfg.transport.max_weights_bytes
    )
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while not stop.is_set():
        if sub.poll(200):
            sub.recv_multipart(copy=False)


# ---- the trainer process ----------------------------------------------------------------
def train_step(core: TrainerCore, rng: random.Random, tokens: int) -> None:
    seqs, vocab = [], min(14000, core.model.config.vocab_size)
    for _ in range(max(1, tokens // 48)):
        ids = [rng.randrange(3, vocab) for _ in range(48)]
        seqs.append(TokenSequence(ids, [0] * 8 + [1] * 40))
    micro = make_micro_batches(seqs, 4096, "packed", 0, 512, 1, False)
    core.train_step(micro, lambda logits, mb: sft_loss(logits, mb.input_ids, mb.loss_mask))


def publish_full_fp32(core: TrainerCore, sock: zmq.Socket, version: int, rank: int) -> float:
    """The publish before buckets: the whole fp32 state gathered to rank 0 (every rank
    joins), sent as one message of frames."""
    start = time.perf_counter()
    state = core.full_state_dict()
    if rank == 0:
        sock.send_multipart(encode_tensors(version, RUN_ID, state), copy=False)
    return time.perf_counter() - start


def start_children(args: argparse.Namespace, run_dir: Path) -> list[subprocess.Popen]:
    """The generator, then trainer ranks 1 … n-1, each logging to RUN_DIR/NAME.log."""
    kids = [("generator", ["--generator", str(run_dir)])]
    kids += [
        (f"rank{r}", ["--rank", str(r), "--run-dir", str(run_dir)]) for r in range(1, args.ranks)
    ]
    procs = []
    for name, extra in kids:
        log = open(run_dir / f"{name}.log", "wb")  # noqa: SIM115 (the child's whole life)
        cmd = [sys.executable, __file__, *extra, *sys.argv[1:]]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    return procs


def trainer(args: argparse.Namespace, run_dir: Path, rank: int = 0) -> dict | None:
    """Every rank trains and publishes; rank 0 also sends, and returns the figures."""
    children = start_children(args, run_dir) if rank == 0 else []
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank))
    info = init_distributed("cpu", str(run_dir / "rendezvous"))
    optim = OptimConfig(lr=args.lr, warmup_steps=0, schedule="constant")
    core = TrainerCore(ModelConfig(path=args.model), TrainerConfig(), optim, info, pad_id=0)
    fence = timed(core.readout)
    cfg, ctx = config(str(run_dir), args), zmq.Context()
    baseline = make_socket(ctx, zmq.PUB, cfg.transport)
    if rank == 0:
        endpoint = bind(baseline, cfg.transport, run_dir, "b")
        write_endpoints(run_dir, "baseline", {"weights": endpoint})
    publisher = BucketPublisher(cfg.site()) if rank == 0 else NoWeightPublisher()
    rng, times = (
        random.Random(0),
        {"new": [], "full": [], "step_after_new": [], "step_after_full": []},
    )
    try:
        publisher.publish(0, core.full_parameters(0))
        last = "new"
        for version in range(1, args.steps + 1):
            fence["s"] = 0.0
            start = time.perf_counter()
            train_step(core, rng, args.tokens)
            times[f"step_after_{last}"].append(time.perf_counter() - start)
            if last == "new" and version > 1:
                times["new"][-1] += fence["s"]  # the trainer's part: the call and the fence
            # Alternate, ending on the bucket publisher, whose version the engine must hold.
            last = "new" if (args.steps - version) % 2 == 0 else "full"
            if last == "new":
                times["new"].append(publisher.publish(version, core.full_parameters(version)))
            else:
                times["full"].append(publish_full_fp32(core, baseline, version, rank))
        core.readout.wait()
        times["new"] = times["new"][:-1]  # the last one had no step after it to overlap
        wire = torch.bfloat16 if args.dtype == "bfloat16" else None
        expected = crcs(  # the trainer's weights as the wire rounds them, in the engine's fp32
            (n, t.to(wire or t.dtype).float()) for n, t in core.full_parameters().tensors
        )
        if rank == 0:
            publisher.wait_sent()
            (run_dir / "final.json").write_text(json.dumps({"version": args.steps}))
    finally:
        publisher.close()
        ctx.destroy(linger=0)
        shutdown_distributed()  # every rank meets here before rank 0 waits for its children
    if rank != 0:
        return None
    try:
        gen = finish(children, run_dir)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    return figures(args, core, publisher, times, gen, expected)


def timed(readout) -> dict:
    """Time spent in ``readout.wait`` (the optimizer step's fence), in ``["s"]``."""
    spent, wait = {"s": 0.0}, readout.wait

    def waiting() -> None:
        start = time.perf_counter()
        wait()
        spent["s"] += time.perf_counter() - start

    readout.wait = waiting
    return spent


def finish(children: list[subprocess.Popen], run_dir: Path) -> dict:
    for child, name in zip(children, ["generator", *(f"rank{i}" for i in range(1, 99))]):
        if child.wait(timeout=600) != 0:
            tail = (run_dir / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} failed:\n{tail}")
    return json.loads((run_dir / "generator.json").read_text())


def figures(args, core, publisher, times, gen, expected) -> dict:
    new_s, full_s = times["new"], times["full"]
    deltas = [r for r in publisher.history if r["kind"] == "delta"]
    full_bytes = publisher.history[0]["full_bytes"]
    delta_bytes = statistics.median(r["bytes"] for r in deltas) if deltas else float("nan")
    flips_ms = sorted(s * 1000 for s in gen["flip_s"])
    return {
        "params": sum(p.numel() for p in core.model.parameters()),
        "dtype": args.dtype,
        "steps": args.steps,
        "full_bytes": full_bytes,
        "fp32_full_bytes": sum(p.numel() * 4 for p in core.model.parameters()),
        "delta_bytes_median": delta_bytes,
        "delta_ratio": delta_bytes / full_bytes,
        "publish_s_median": statistics.median(new_s),
        "fp32_full_publish_s_median": statistics.median(full_s),
        "publish_speedup": statistics.median(full_s) / statistics.median(new_s),
        "sender_s_median": statistics.median(r["send_s"] for r in publisher.history[1:]),
        "step_s_after_new_median": statistics.median(times["step_after_new"]),
        "step_s_after_full_median": statistics.median(times["step_after_full"]),
        "ranks": args.ranks,
        "stage_s_median": statistics.median(gen["stage_s"]) if gen["stage_s"] else None,
        "flips": len(flips_ms),
        "flip_ms_p99": flips_ms[min(len(flips_ms) - 1, int(0.99 * len(flips_ms)))]
        if flips_ms
        else None,
        "steady_step_ms_p50": statistics.median(gen["steady_s"]) * 1000,
        "anchors": sum(r["kind"] == "anchor" for r in publisher.history),
        "anchors_asked": gen["anchors_asked"],
        "generator_version": gen["version"],
        "bad_frames": gen["bad_frames"],
        "equal_after_updates": gen["crcs"] == expected,
    }


def main() -> None:
    args = parse_args()
    if args.generator:
        generator(args)
        return
    torch.set_num_threads(1)  # the generator and each rank: one core each at most
    if args.rank:
        trainer(args, Path(args.run_dir), args.rank)
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    print(json.dumps(trainer(args, tmp)), flush=True)
    shutil.rmtree(tmp)  # kept when the run failed: the generator's log is there


if __name__ == "__main__":
    main()
