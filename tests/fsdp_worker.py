"""One trainer rank of the equivalence tests: a few optimizer steps on fixed synthetic
sequences, then rank 0 saves the losses and the gathered weights. Run as a script with
RANK / WORLD_SIZE set (tests/test_trainer.py starts it)."""

from __future__ import annotations

import random
import sys

import torch

from asyncrl.algorithms.losses import sft_loss
from asyncrl.balance import split_balanced
from asyncrl.models import ModelConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import init_distributed, shutdown_distributed
from asyncrl.trainer.packing import TokenSequence, make_micro_batches


def synthetic_sequences(n: int, vocab: int, seed: int = 0) -> list[TokenSequence]:
    rng = random.Random(seed)
    seqs = []
    for _ in range(n):
        length = rng.randint(4, 40)
        prompt = rng.randint(1, length - 1)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        seqs.append(TokenSequence(ids, [0] * prompt + [1] * (length - prompt)))
    return seqs


def loss_fn(logits, mb):
    return sft_loss(logits, mb.input_ids, mb.loss_mask)


def main(model_dir: str, out_path: str, rendezvous: str, steps: int, budget: int) -> None:
    torch.set_num_threads(1)
    info = init_distributed("cpu", rendezvous)
    optim = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", max_grad_norm=1.0)
    core = TrainerCore(ModelConfig(path=model_dir), TrainerConfig(), optim, info, pad_id=0)
    vocab = core.model.config.vocab_size
    seqs = synthetic_sequences(16 * steps, vocab)
    losses = []
    for step in range(steps):
        batch = seqs[16 * step : 16 * (step + 1)]
        mine = split_balanced([len(s) for s in batch], info.world_size)[info.rank]
        micro = make_micro_batches([batch[i] for i in mine], budget, row_tokens=64)
        losses.append(core.train_step(micro, loss_fn).loss)
    state = core.full_state_dict()
    if info.is_main:
        torch.save({"losses": losses, "state": state}, out_path)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
