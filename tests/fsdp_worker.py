"""One trainer rank of the equivalence tests: the logits of a fixed probe batch and the
gathered weights as loaded, a few optimizer steps on fixed synthetic sequences, then rank
0 saves the losses and the gathered weights. Run as a script with RANK / WORLD_SIZE set
(tests/test_trainer.py starts it)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from asyncrl.algorithms.losses import sft_loss
from asyncrl.balance import split_balanced
from asyncrl.loop.batch import add_reference_logprobs
from asyncrl.models import ModelConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore, frozen_model
from asyncrl.trainer.dist import DistInfo, init_distributed, shutdown_distributed
from asyncrl.trainer.packing import TokenSequence, make_micro_batches

HERE = Path(__file__).resolve().parent
REFERENCE_TEMPERATURE = 0.7


def synthetic_sequences(n: int, vocab: int, seed: int = 0) -> list[TokenSequence]:
    rng = random.Random(seed)
    seqs = []
    for _ in range(n):
        length = rng.randint(4, 40)
        prompt = rng.randint(1, length - 1)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        seqs.append(TokenSequence(ids, [0] * prompt + [1] * (length - prompt)))
    return seqs


def probe_ids(vocab: int) -> torch.Tensor:
    """A fixed ``[2, 24]`` batch of token ids for comparing logits across loading paths."""
    return torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


def reference_pass(model_dir: str, info: DistInfo, vocab: int, out_path: str) -> None:
    """The sharded KL reference's logprobs of this rank's micro-batches, saved with them;
    rank 0 has more micro-batches than rank 1, so the ranks must even out their forwards."""
    seqs = synthetic_sequences(10 - 6 * info.rank, vocab, seed=11 + info.rank)
    micro = make_micro_batches(seqs, 64, row_tokens=64)
    reference = frozen_model(ModelConfig(path=model_dir), info)
    add_reference_logprobs(reference, micro, info.device, REFERENCE_TEMPERATURE)
    torch.save(micro, out_path)


def loss_fn(logits, mb):
    return sft_loss(logits, mb.input_ids, mb.loss_mask)


def main(
    model_dir: str, out_path: str, rendezvous: str, steps: int, budget: int, sync: bool
) -> None:
    torch.set_num_threads(1)
    info = init_distributed("cpu", rendezvous)
    optim = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", max_grad_norm=1.0)
    trainer = TrainerConfig(reduce_every_micro_batch=sync)
    core = TrainerCore(ModelConfig(path=model_dir), trainer, optim, info, pad_id=0)
    vocab = core.model.config.vocab_size
    loaded = core.full_state_dict()
    with torch.no_grad():  # every rank runs the probe: FSDP gathers each layer
        probe = core.model(probe_ids(vocab), use_cache=False).logits
    reference_pass(model_dir, info, vocab, f"{out_path}.reference{info.rank}")
    seqs = synthetic_sequences(16 * steps, vocab)
    losses = []
    for step in range(steps):
        batch = seqs[16 * step : 16 * (step + 1)]
        mine = split_balanced([len(s) for s in batch], info.world_size)[info.rank]
        micro = make_micro_batches([batch[i] for i in mine], budget, row_tokens=64)
        losses.append(core.train_step(micro, loss_fn).loss)
    state = core.full_state_dict()
    if info.is_main:
        result = {"losses": losses, "state": state, "loaded": loaded, "probe": probe}
        torch.save(result, out_path)
    shutdown_distributed()


def run_ranks(
    world: int, model_dir: str, tmp_path: Path, steps: int = 3, sync: bool = False
) -> dict:
    """Start ``world`` ranks of this script side by side; rank 0's saved result. ``sync``:
    ``TrainerConfig.reduce_every_micro_batch``."""
    from .conftest import wait_for_ranks

    out = tmp_path / f"result_{world}{'_sync' * sync}.pt"
    rdv = tmp_path / f"rdv_{world}{'_sync' * sync}"
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        env.pop("MASTER_ADDR", None)
        cmd = [sys.executable, str(HERE / "fsdp_worker.py"), model_dir, str(out), str(rdv)]
        procs.append(
            subprocess.Popen(
                [*cmd, str(steps), "128", str(int(sync))],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    wait_for_ranks(procs)
    return torch.load(out)


if __name__ == "__main__":
    main(*sys.argv[1:4], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1")
