"""Benchmark: peak memory of one trainer rank, one rank against two, without and with a
KL reference.

Each configuration starts its ranks as separate processes side by side (gloo, one thread
each); every rank builds the ``TrainerCore`` of ``--model`` (float32), and with ``--kl``
the frozen reference, then takes ``--steps`` real AdamW steps (``TrainerCore.train_step``)
over packed micro-batches of its share of a fixed global batch of synthetic sequences
(two steps: the second is the first with AdamW's state, and holds the peak).
The loss is the completion tokens' NLL, plus with a reference the k3 KL to it (the
reference logprobs come from ``add_reference_logprobs``, as in the RL step). A rank's
peak is its peak resident set (``VmHWM`` in ``/proc/self/status``) at the end, which
covers loading, every forward/backward and the optimizer steps; ``above_start`` is that
peak less the resident set before the model was built (the interpreter and its
libraries, the same in every rank). ``--old-loading`` runs the loading of before 2026-12
for comparison: every rank loads the whole model before sharding, and the reference is
an unsharded copy on every rank.

Micro-batch size: the logits of a micro-batch are ``tokens × vocab`` floats, and with
Qwen2.5's 151936-entry vocabulary that is 0.6 MB a token, held several times over (the
logits, their log-softmax, their gradient). That activation peak is the same on every
rank whatever the rank count, while the parameters, gradients and AdamW state are what
sharding divides; ``--micro-batch-tokens 256`` keeps the logits near 0.16 GB, a fraction
of the 2.7 GB of model state, as a real run keeps its micro-batches small beside its
model. More ranks take fewer micro-batches each, not smaller ones.

Allocator: glibc serves tensors under its mmap threshold from its heap, and that threshold
rises (to 32 MB) as large tensors are freed, so on this model most tensors (a decoder
layer's weights are 3–17 MB) end up in the heap, whose freed pages stay resident. VmHWM
then counts gigabytes that no tensor holds (at the end of a step, 2 GB above the live
state on the 24-layer Qwen2.5-0.5B). ``--mmap-threshold BYTES`` fixes glibc's threshold
(``trainer.malloc_mmap_threshold``) in every rank, so freed tensors go back to the system and
the peak is that of the memory the trainer holds; the default leaves glibc as it is.
``last_step_s_*`` time each configuration's last step (its cost: mapping fresh pages
where the heap would reuse them), for runs with and without the threshold side by side.

Ends with one JSON line:

    {"params", "peak_gb_1rank", "peak_gb_2ranks_max", "ratio",
     "peak_gb_1rank_kl", "peak_gb_2ranks_kl_max", "ratio_kl",
     "last_step_s_1rank", "last_step_s_2ranks_max", ...}

The default model is SmolLM2-135M's exact shape, ~100M parameters of which the tied
embedding is a fifth; build it once with ``tools/make_model.py --shape smollm2-135m --dtype
float32 --out runs/models/smollm2-135m``. (Qwen2.5-0.5B cut to a few layers is mostly its
embedding, which every rank gathers whole in the root unit: sharding barely divides it.)
``--reduce-every-micro-batch`` and ``--mmap-threshold`` default to the trainer's defaults.

Run: ``.venv/bin/python tools/bench_trainer_memory.py`` (``--old-loading`` for the old path).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from asyncrl.algorithms.losses import kl_estimate, sft_loss
from asyncrl.balance import split_balanced
from asyncrl.logprobs import token_logprobs
from asyncrl.loop.batch import add_reference_logprobs
from asyncrl.models import ModelConfig, load_model
from asyncrl.trainer import core as core_module
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore, frozen_model, shard_model
from asyncrl.trainer.dist import (
    DistInfo,
    init_distributed,
    set_malloc_mmap_threshold,
    shutdown_distributed,
)
from asyncrl.trainer.packing import MicroBatch, TokenSequence, make_micro_batches

KL_COEF = 0.05


def resident_gb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process in GB, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError(f"no {field} in /proc/self/status")


def global_batch(vocab: int, sequences: int, seed: int = 0) -> list[TokenSequence]:
    """Fixed synthetic sequences of 96–224 tokens, a third prompt, the rest targets."""
    rng = random.Random(seed)
    out = []
    for _ in range(sequences):
        length = rng.randint(96, 224)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        out.append(TokenSequence(ids, [0] * (length // 3) + [1] * (length - length // 3)))
    return out


def loss_fn(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
    """NLL of the targets ``[rows, T]``, plus β·k3 KL to the reference when there is one."""
    loss, metrics = sft_loss(logits, mb.input_ids, mb.loss_mask)
    if "reference" in mb.fields:
        logprobs = token_logprobs(logits, mb.input_ids)
        kl = kl_estimate(logprobs, mb.fields["reference"].to(logprobs.device), "k3")
        loss = loss + KL_COEF * (kl * mb.loss_mask).sum()
    return loss, metrics


def old_sharded_model(model_cfg: ModelConfig, info: DistInfo, cfg=None):
    """The loading before 2026-12: the whole model on every rank, then sharded."""
    return shard_model(load_model(model_cfg, info.device), info, cfg)


def worker(args: argparse.Namespace) -> None:
    """One rank: build, step, write its figures as JSON to ``args.out``."""
    torch.set_num_threads(1)
    trainer_cfg = TrainerConfig(
        micro_batch_tokens=args.micro_batch_tokens,
        reduce_every_micro_batch=args.reduce_every_micro_batch,
        malloc_mmap_threshold=args.mmap_threshold,
    )
    set_malloc_mmap_threshold(trainer_cfg.malloc_mmap_threshold)  # as ``stage_main`` does
    info = init_distributed("cpu", args.rendezvous)
    start_gb = resident_gb("VmRSS")
    model_cfg = ModelConfig(path=args.model)
    optim = OptimConfig(lr=1e-5, warmup_steps=0, schedule="constant")
    if args.old_loading:
        with mock.patch.object(core_module, "sharded_model", old_sharded_model):
            core = TrainerCore(model_cfg, trainer_cfg, optim, info, pad_id=0)
        reference = load_model(model_cfg, info.device).eval() if args.kl else None
    else:
        core = TrainerCore(model_cfg, trainer_cfg, optim, info, pad_id=0)
        reference = frozen_model(model_cfg, info) if args.kl else None
    loaded_gb = resident_gb("VmHWM")
    batch = global_batch(core.model.config.vocab_size, args.sequences)
    mine = split_balanced([len(s) for s in batch], info.world_size)[info.rank]
    losses, step_s = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        micro = make_micro_batches(
            [batch[i] for i in mine], args.micro_batch_tokens, "packed", 0, args.row_tokens
        )
        if reference is not None:
            add_reference_logprobs(reference, micro, info.device, 1.0)
        losses.append(core.train_step(micro, loss_fn).loss)
        step_s.append(time.perf_counter() - start)
    result = {
        "rank": info.rank,
        "params": sum(p.numel() for p in core.model.parameters()),
        "start_gb": start_gb,
        "peak_after_load_gb": loaded_gb,
        "peak_gb": resident_gb("VmHWM"),
        "resident_end_gb": resident_gb("VmRSS"),
        "losses": losses,
        "last_step_s": step_s[-1],
    }
    Path(args.out).write_text(json.dumps(result))
    shutdown_distributed()


def run_ranks(args: argparse.Namespace, world: int, kl: bool, tmp: Path) -> list[dict]:
    """Start ``world`` ranks of this script side by side; each rank's figures."""
    name = f"w{world}{'_kl' if kl else ''}"
    procs, outs = [], []
    for rank in range(world):
        out = tmp / f"{name}_{rank}.json"
        cmd = [sys.executable, __file__, "--worker", "--out", str(out)]
        cmd += ["--rendezvous", str(tmp / f"{name}.rdv"), "--model", args.model]
        cmd += ["--steps", str(args.steps), "--sequences", str(args.sequences)]
        cmd += ["--micro-batch-tokens", str(args.micro_batch_tokens)]
        cmd += ["--row-tokens", str(args.row_tokens)]
        cmd += ["--kl"] * kl + ["--old-loading"] * args.old_loading
        cmd += [
            "--reduce-every-micro-batch"
            if args.reduce_every_micro_batch
            else "--no-reduce-every-micro-batch"
        ]
        cmd += ["--mmap-threshold", str(args.mmap_threshold)]
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        env.pop("MASTER_ADDR", None)
        procs.append(subprocess.Popen(cmd, env=env))
        outs.append(out)
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"{name}: ranks exited with {codes}")
    return [json.loads(out.read_text()) for out in outs]


def summary(runs: dict[str, list[dict]]) -> dict:
    """The closing JSON line: each configuration's largest rank peak, and the ratios."""
    out: dict = {"params": runs["w1"][0]["params"]}
    for suffix in ("", "_kl"):
        if f"w1{suffix}" not in runs:
            continue
        one = runs[f"w1{suffix}"][0]
        two = runs[f"w2{suffix}"]
        out[f"peak_gb_1rank{suffix}"] = round(one["peak_gb"], 3)
        out[f"peak_gb_2ranks{suffix}_max"] = round(max(r["peak_gb"] for r in two), 3)
        out[f"ratio{suffix}"] = round(out[f"peak_gb_2ranks{suffix}_max"] / one["peak_gb"], 3)
        above_one = one["peak_gb"] - one["start_gb"]
        above_two = max(r["peak_gb"] - r["start_gb"] for r in two)
        out[f"above_start_gb_1rank{suffix}"] = round(above_one, 3)
        out[f"above_start_gb_2ranks{suffix}_max"] = round(above_two, 3)
        out[f"ratio_above_start{suffix}"] = round(above_two / above_one, 3)
        out[f"resident_end_gb_1rank{suffix}"] = round(one["resident_end_gb"], 3)
        end_two = max(r["resident_end_gb"] for r in two)
        out[f"resident_end_gb_2ranks{suffix}_max"] = round(end_two, 3)
        out[f"start_gb{suffix}"] = round(one["start_gb"], 3)
        out[f"last_step_s_1rank{suffix}"] = round(one["last_step_s"], 2)
        out[f"last_step_s_2ranks{suffix}_max"] = round(max(r["last_step_s"] for r in two), 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="runs/models/smollm2-135m")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per configuration")
    p.add_argument("--sequences", type=int, default=4, help="sequences in the global batch")
    p.add_argument("--micro-batch-tokens", type=int, default=256)
    p.add_argument("--row-tokens", type=int, default=256)
    p.add_argument(
        "--no-kl", action="store_true", help="skip the configurations with a KL reference"
    )
    p.add_argument("--old-loading", action="store_true", help="every rank loads the whole model")
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=TrainerConfig.malloc_mmap_threshold,
        help="trainer.malloc_mmap_threshold (bytes) in every rank, e.g. 131072; 0: glibc's",
    )
    p.add_argument(
        "--reduce-every-micro-batch",
        action=argparse.BooleanOptionalAction,
        default=TrainerConfig.reduce_every_micro_batch,
        help="trainer.reduce_every_micro_batch: gradient shards, not whole, between micro-batches",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kl", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kl in (False,) if args.no_kl else (False, True):
            for world in (1, 2):
                ranks = run_ranks(args, world, kl, Path(tmp))
                runs[f"w{world}{'_kl' if kl else ''}"] = ranks
                print(f"# ranks={world} kl={kl}: {json.dumps(ranks)}", file=sys.stderr)
    extra = {"old_loading": args.old_loading, "mmap_threshold": args.mmap_threshold}
    extra["reduce_every_micro_batch"] = args.reduce_every_micro_batch
    print(json.dumps(summary(runs) | extra))


if __name__ == "__main__":
    main()
