"""Benchmark: trainer tokens/s on the tiny model, packed against padded micro-batches.

Both layouts train on the same variable-length sequences (lengths drawn log-uniformly
over a wide range, as RL completions are) with the same token budget per micro-batch,
through the real FSDP2 trainer core on one gloo rank. Layouts alternate step by step so
machine noise hits both alike; the figure is the median over rounds of real (non-pad)
tokens per second. Ends with one JSON line:

    {"packed_tokens_per_s": ..., "padded_tokens_per_s": ..., "speedup": ...}
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
from asyncrl.trainer.dist import init_distributed, shutdown_distributed
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


def main() -> None:
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
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
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
    vocab = core.model.config.vocab_size
    rng = random.Random(0)

    def loss_fn(logits, mb):
        return sft_loss(logits, mb.input_ids, mb.loss_mask)

    rates: dict[str, list[float]] = {"packed": [], "padded": []}
    batches = [
        variable_length_batch(rng, args.batch, vocab, args.min_len, args.max_len)
        for _ in range(args.steps)
    ]
    for layout in rates:  # warm-up, untimed
        core.train_step(
            make_micro_batches(batches[0], args.micro_batch_tokens, layout, 0, args.row_tokens),
            loss_fn,
        )
    for _ in range(args.rounds):
        for layout in rates:
            tokens, seconds = 0, 0.0
            for batch in batches:
                micro = make_micro_batches(
                    batch, args.micro_batch_tokens, layout, 0, args.row_tokens
                )
                start = time.perf_counter()
                core.train_step(micro, loss_fn)
                seconds += time.perf_counter() - start
                tokens += sum(len(s) for s in batch)
            rates[layout].append(tokens / seconds)
    shutdown_distributed()
    packed, padded = statistics.median(rates["packed"]), statistics.median(rates["padded"])
    per_round = [p / q for p, q in zip(rates["packed"], rates["padded"])]
    print(
        f"rounds: packed {[round(r) for r in rates['packed']]}, padded {[round(r) for r in rates['padded']]}",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "packed_tokens_per_s": round(packed, 1),
                "padded_tokens_per_s": round(padded, 1),
                "speedup": round(statistics.median(per_round), 3),
                "rounds": args.rounds,
                "device": str(info.device),
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
