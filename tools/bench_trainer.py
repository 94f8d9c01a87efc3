"""Benchmark: trainer tokens/s on the tiny model, packed against padded micro-batches, or
with ``--group-size N``, GRPO groups with their prompt shared against packed flat.

Both layouts train on the same variable-length sequences (lengths drawn log-uniformly
over a wide range, as RL completions are) with the same token budget per micro-batch,
through the real FSDP2 trainer core on one gloo rank. With ``--group-size`` each batch is
groups of N completions (lengths drawn the same way) after one ``--prompt-len`` prompt,
as an RL batch is. Layouts alternate so machine noise hits both alike; the figure is the
median over rounds of the batch's tokens (every sequence whole, no padding) per second.
Ends with one JSON line:

    {"packed_tokens_per_s": ..., "padded_tokens_per_s": ..., "speedup": ...}
    {"shared_tokens_per_s": ..., "packed_tokens_per_s": ..., "speedup": ...}  (groups)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncrl.algorithms.losses import sft_loss
from asyncrl.models import ModelConfig, TinyModelConfig, build_tiny_model
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import DistInfo, init_distributed, shutdown_distributed
from asyncrl.trainer.packing import TokenSequence, make_micro_batches


def variable_length_batch(
    rng: random.Random, size: int, vocab: int, lo: int, hi: int
) -> list[TokenSequence]:
    seqs = []
    for _ in range(size):
        length = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        prompt = max(1, length // 3)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        seqs.append(TokenSequence(ids, [0] * prompt + [1] * (length - prompt)))
    return seqs


def grouped_batch(
    rng: random.Random, size: int, group: int, prompt_len: int, vocab: int, lo: int, hi: int
) -> list[TokenSequence]:
    """``size`` sequences in groups of ``group`` sharing one prompt each."""
    seqs = []
    for _ in range(size // group):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for _ in range(group):
            length = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            ids = prompt + [rng.randrange(3, vocab) for _ in range(length)]
            seqs.append(TokenSequence(ids, [0] * prompt_len + [1] * length))
    return seqs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="", help="HF model dir (default: build the demo's tiny model)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each times both layouts")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per layout per round")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--row-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--group-size", type=int, default=1, help=">1: GRPO groups, shared prompt vs flat"
    )
    parser.add_argument("--prompt-len", type=int, default=18, help="with --group-size")
    return parser.parse_args()


def build_core(args: argparse.Namespace, tmp: Path) -> tuple[TrainerCore, DistInfo]:
    """The real trainer core on one rank, on ``--model`` or a freshly built tiny model."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    info = init_distributed("auto", str(tmp / "rendezvous"))
    model_dir = args.model
    if not model_dir:
        alphabet = [chr(c) for c in range(32, 127)]
        spec = TinyModelConfig(max_positions=max(512, args.max_len))
        model_dir = str(build_tiny_model(tmp / "tiny", alphabet, spec))
    optim = OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant")
    core = TrainerCore(ModelConfig(path=model_dir), TrainerConfig(), optim, info, pad_id=0)
    return core, info


def make_batches(args: argparse.Namespace, vocab: int) -> list[list[TokenSequence]]:
    """One batch per optimizer step, the same for every layout."""
    rng = random.Random(0)
    if args.group_size > 1:
        return [
            grouped_batch(
                rng, args.batch, args.group_size, args.prompt_len, vocab, args.min_len, args.max_len
            )
            for _ in range(args.steps)
        ]
    return [
        variable_length_batch(rng, args.batch, vocab, args.min_len, args.max_len)
        for _ in range(args.steps)
    ]


def time_layouts(
    args: argparse.Namespace, core: TrainerCore, batches: list[list[TokenSequence]]
) -> dict[str, list[float]]:
    """Tokens/s of each layout in each round (layouts alternate within a round)."""
    grouped = args.group_size > 1
    # name -> (layout, share_prefix)
    layouts = (
        {"shared": ("packed", True), "packed": ("packed", False)}
        if grouped
        else {"packed": ("packed", False), "padded": ("padded", False)}
    )
    group = args.group_size if grouped else 1
    rates: dict[str, list[float]] = {name: [] for name in layouts}

    def loss_fn(logits, mb):
        return sft_loss(logits, mb.input_ids, mb.loss_mask)

    def micro_batches(batch, name):
        layout, share = layouts[name]
        return make_micro_batches(
            batch, args.micro_batch_tokens, layout, 0, args.row_tokens, group, share
        )

    for name in rates:  # warm-up, untimed
        core.train_step(micro_batches(batches[0], name), loss_fn)
    for _ in range(args.rounds):
        for layout in rates:
            tokens, seconds = 0, 0.0
            for batch in batches:
                micro = micro_batches(batch, layout)
                start = time.perf_counter()
                core.train_step(micro, loss_fn)
                seconds += time.perf_counter() - start
                tokens += sum(len(s) for s in batch)
            rates[layout].append(tokens / seconds)
    return rates


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    core, info = build_core(args, tmp)
    batches = make_batches(args, core.model.config.vocab_size)
    rates = time_layouts(args, core, batches)
    shutdown_distributed()
    new, old = list(rates)
    per_round = [p / q for p, q in zip(rates[new], rates[old])]
    print(f"rounds: { ({k: [round(r) for r in v] for k, v in rates.items()}) }", file=sys.stderr)
    print(
        json.dumps(
            {
                f"{new}_tokens_per_s": round(statistics.median(rates[new]), 1),
                f"{old}_tokens_per_s": round(statistics.median(rates[old]), 1),
                "speedup": round(statistics.median(per_round), 3),
                "rounds": args.rounds,
                "device": str(info.device),
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
