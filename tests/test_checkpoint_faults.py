"""Faults the trainer must survive: a NaN/inf step is skipped without a trace (and too many
in a row stop the run with advice), and a damaged checkpoint is refused by name while
resuming falls back to the one before it."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.models import ModelConfig
from asyncrl.trainer.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.finite import NonFiniteError
from asyncrl.trainer.packing import MicroBatch, make_micro_batches

from .conftest import full_tensor, wait_for_ranks
from .fsdp_worker import loss_fn, synthetic_sequences

ROOT = Path(__file__).resolve().parents[1]


def _core(model_dir: str, info, **trainer) -> TrainerCore:
    optim = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", max_grad_norm=1.0)
    return TrainerCore(ModelConfig(path=model_dir), TrainerConfig(**trainer), optim, info, 0)


def _batch(core: TrainerCore, seed: int) -> list[MicroBatch]:
    seqs = synthetic_sequences(8, core.model.config.vocab_size, seed=seed)
    return make_micro_batches(seqs, budget=160, row_tokens=80)


def _params(core: TrainerCore) -> dict[str, torch.Tensor]:
    return {name: full_tensor(p) for name, p in core.model.named_parameters()}


def _optim_state(core: TrainerCore) -> dict[str, torch.Tensor]:
    state = core.optimizer.state_dict()["state"]
    return {f"{i}.{k}": full_tensor(v) for i, s in state.items() for k, v in s.items()}


def _assert_identical(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def _nan_loss(logits, mb):
    # NaN in the loss only: its gradient stays finite, so only the loss check can catch it.
    loss, metrics = loss_fn(logits, mb)
    return loss + float("nan"), metrics


class _InfGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by inf (finite loss, inf grads)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def _inf_grad_loss(logits, mb):
    return loss_fn(_InfGrad.apply(logits), mb)


# --- non-finite steps --------------------------------------------------------------------


def test_nan_loss_step_is_skipped_without_a_trace(dist_info, tiny_model_dir):
    core = _core(tiny_model_dir, dist_info)
    core.train_step(_batch(core, 0), loss_fn)  # so the optimizer has state to protect
    params, optim = _params(core), _optim_state(core)
    sched = core.scheduler.state_dict()
    assert optim  # exp_avg, exp_avg_sq, step per parameter

    stats = core.train_step(_batch(core, 1), _nan_loss)
    assert stats.skipped and math.isnan(stats.loss) and math.isfinite(stats.grad_norm)
    # train_step advances no step counter (the stage's loop does), skipped or not.
    assert (core.step, core.nonfinite_in_a_row) == (0, 1)
    assert all(p.grad is None for p in core.model.parameters())
    _assert_identical(params, _params(core))
    _assert_identical(optim, _optim_state(core))
    assert core.scheduler.state_dict() == sched

    stats = core.train_step(_batch(core, 1), loss_fn)
    assert not stats.skipped and math.isfinite(stats.loss)
    assert (core.step, core.nonfinite_in_a_row) == (0, 0)
    # The next step is exactly the one a run that never saw the NaN takes.
    clean = _core(tiny_model_dir, dist_info)
    clean.train_step(_batch(clean, 0), loss_fn)
    clean.train_step(_batch(clean, 1), loss_fn)
    _assert_identical(_params(clean), _params(core))
    _assert_identical(_optim_state(clean), _optim_state(core))
    assert any(not torch.equal(params[k], v) for k, v in _params(core).items())


def test_inf_gradient_step_is_skipped(dist_info, tiny_model_dir):
    core = _core(tiny_model_dir, dist_info)
    core.train_step(_batch(core, 0), loss_fn)
    params, optim = _params(core), _optim_state(core)

    stats = core.train_step(_batch(core, 1), _inf_grad_loss)
    assert math.isfinite(stats.loss) and not math.isfinite(stats.grad_norm)
    assert stats.skipped and (core.step, core.nonfinite_in_a_row) == (0, 1)
    _assert_identical(params, _params(core))
    _assert_identical(optim, _optim_state(core))
    assert not core.train_step(_batch(core, 1), loss_fn).skipped
    assert core.nonfinite_in_a_row == 0


def test_too_many_nonfinite_steps_in_a_row_stop_with_advice(dist_info, tiny_model_dir):
    core = _core(tiny_model_dir, dist_info, max_nonfinite_steps=3)
    params = _params(core)
    for loss in (_nan_loss, _inf_grad_loss):  # two in a row are tolerated...
        assert core.train_step(_batch(core, 0), loss).skipped
    assert not core.train_step(_batch(core, 0), loss_fn).skipped  # ...and the count restarts
    params = _params(core)
    core.train_step(_batch(core, 1), _nan_loss)
    core.train_step(_batch(core, 1), _nan_loss)
    with pytest.raises(NonFiniteError, match=r"^3 consecutive steps") as err:
        core.train_step(_batch(core, 1), _inf_grad_loss)
    message = str(err.value)
    assert "optim.lr" in message and "rewards" in message
    assert "trainer.max_nonfinite_steps" in message
    _assert_identical(params, _params(core))


# --- checkpoints -------------------------------------------------------------------------


@pytest.fixture
def two_checkpoints(dist_info, tiny_model_dir, tmp_path):
    """Checkpoints after steps 1 and 2 (keep=2), and the weights at step 1."""
    root = tmp_path / "checkpoints"
    core = _core(tiny_model_dir, dist_info)
    core.train_step(_batch(core, 0), loss_fn)
    core.step += 1  # as a stage's loop does
    save_checkpoint(core, root, {"position": 8}, keep=2)
    at_step_1 = _params(core)
    core.train_step(_batch(core, 1), loss_fn)
    core.step += 1
    save_checkpoint(core, root, {"position": 16}, keep=2)
    return root, at_step_1


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_manifest_covers_every_file_with_companions(dist_info, tiny_model_dir, tmp_path):
    core, critic = _core(tiny_model_dir, dist_info), _core(tiny_model_dir, dist_info)
    path = save_checkpoint(core, tmp_path, {}, keep=1, companions={"critic": critic})
    manifest = json.loads((path / "meta.json").read_text())["manifest"]
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert set(manifest) == on_disk - {"meta.json"}
    assert {"extra_rank0.pt", ".metadata", "critic/extra_rank0.pt"} <= set(manifest)
    assert all(len(entry["sha256"]) == 64 and entry["size"] > 0 for entry in manifest.values())
    _flip_byte(path / "critic" / "extra_rank0.pt")  # a companion's file is checked too
    with pytest.raises(CheckpointError, match="critic/extra_rank0.pt"):
        load_checkpoint(_core(tiny_model_dir, dist_info), path, {"critic": critic})


def test_corrupt_newest_falls_back_to_the_previous(
    two_checkpoints, dist_info, tiny_model_dir, capsys
):
    root, at_step_1 = two_checkpoints
    newest = root / "step_00000002"
    assert latest_checkpoint(root) == newest
    shard = sorted(newest.glob("*.distcp"))[0]
    size = shard.stat().st_size
    _flip_byte(shard)
    assert shard.stat().st_size == size  # only the hash can tell

    assert latest_checkpoint(root) == root / "step_00000001"
    warning = capsys.readouterr().out
    assert "skipping" in warning and shard.name in warning and "sha256" in warning
    fresh = _core(tiny_model_dir, dist_info)
    assert load_checkpoint(fresh, latest_checkpoint(root)) == {"position": 8}
    assert fresh.step == 1
    _assert_identical(at_step_1, _params(fresh))

    pattern = rf"{re.escape(str(newest))}: {re.escape(shard.name)} does not match its sha256"
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(_core(tiny_model_dir, dist_info), newest)


def test_missing_or_truncated_file_is_named(two_checkpoints, dist_info, tiny_model_dir):
    root, _ = two_checkpoints
    newest = root / "step_00000002"
    (newest / "extra_rank0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"step_00000002: extra_rank0.pt is missing"):
        load_checkpoint(_core(tiny_model_dir, dist_info), newest)
    assert latest_checkpoint(root) == root / "step_00000001"

    older = root / "step_00000001"
    shard = sorted(older.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"{re.escape(shard.name)} has \d+ bytes"):
        load_checkpoint(_core(tiny_model_dir, dist_info), older)
    assert latest_checkpoint(root) is None  # nothing left that verifies


def test_unreadable_meta_is_skipped(two_checkpoints, capsys):
    root, _ = two_checkpoints
    (root / "step_00000002" / "meta.json").write_text('{"step": 2, "manif')
    assert latest_checkpoint(root) == root / "step_00000001"
    assert "meta.json" in capsys.readouterr().out


def test_leftover_tmp_directory_is_never_picked(two_checkpoints):
    root, _ = two_checkpoints
    # A complete-looking, verifying copy under a .tmp name: a write that never got renamed.
    shutil.copytree(root / "step_00000002", root / "step_00000009.tmp")
    assert latest_checkpoint(root) == root / "step_00000002"


def test_keep_prunes_to_the_newest_k(dist_info, tiny_model_dir, tmp_path):
    core = _core(tiny_model_dir, dist_info)
    for step in range(1, 6):
        core.step = step
        save_checkpoint(core, tmp_path, {}, keep=3)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_00000003", "step_00000004", "step_00000005"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000005"


def test_rng_and_scheduler_restore_exactly_without_pickle(dist_info, tiny_model_dir, tmp_path):
    core = _core(tiny_model_dir, dist_info)
    core.train_step(_batch(core, 0), loss_fn)
    torch.manual_seed(1), random.seed(2), np.random.seed(3), np.random.normal()  # cached gauss
    path = save_checkpoint(core, tmp_path, {}, keep=1)
    draws = (torch.rand(4), [random.random() for _ in range(4)], np.random.normal(size=4))
    extra = torch.load(path / "extra_rank0.pt", weights_only=True)  # no pickle needed
    assert extra["scheduler"] == core.scheduler.state_dict()

    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    fresh = _core(tiny_model_dir, dist_info)
    load_checkpoint(fresh, path)
    assert torch.equal(torch.rand(4), draws[0])
    assert [random.random() for _ in range(4)] == draws[1]
    assert np.array_equal(np.random.normal(size=4), draws[2])
    assert fresh.scheduler.state_dict() == core.scheduler.state_dict()


def test_a_resumed_core_trains_at_its_configured_rate(dist_info, tiny_model_dir, tmp_path):
    """The schedule's position comes from the checkpoint, the rate from the config: a run
    resumed (or replayed from a checkpoint) with another ``optim.lr`` trains at it."""
    core = _core(tiny_model_dir, dist_info)
    core.train_step(_batch(core, 0), loss_fn)
    path = save_checkpoint(core, tmp_path, {}, keep=1)
    optim = OptimConfig(lr=3e-3, warmup_steps=4, schedule="constant", max_grad_norm=1.0)
    fresh = TrainerCore(ModelConfig(path=tiny_model_dir), TrainerConfig(), optim, dist_info, 0)
    load_checkpoint(fresh, path)
    assert fresh.scheduler.last_epoch == core.scheduler.last_epoch == 1
    assert fresh.scheduler.base_lrs == [3e-3]
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 2 / 4)  # warmup 2/4
    same = _core(tiny_model_dir, dist_info)
    load_checkpoint(same, path)
    assert same.optimizer.param_groups[0]["lr"] == core.optimizer.param_groups[0]["lr"]


def test_checkpoint_from_before_manifests_loads_unverified(
    two_checkpoints, dist_info, tiny_model_dir, capsys
):
    root, _ = two_checkpoints
    newest = root / "step_00000002"
    meta = json.loads((newest / "meta.json").read_text())
    del meta["manifest"]
    (newest / "meta.json").write_text(json.dumps(meta))
    # The old extra file pickled numpy's RNG state as an ndarray.
    extra = torch.load(newest / "extra_rank0.pt", weights_only=True)
    extra["rng"]["numpy"] = np.random.get_state()
    torch.save(extra, newest / "extra_rank0.pt")

    assert latest_checkpoint(root) == newest
    fresh = _core(tiny_model_dir, dist_info)
    assert load_checkpoint(fresh, newest) == {"position": 16} and fresh.step == 2
    assert "unverified" in capsys.readouterr().out


def _two_rank_worker(model_dir: str, ckpt_root: str, rendezvous: str, out: str) -> None:
    """One rank of the test below: both ranks must pick the same checkpoint and both must
    raise on the damaged one (rank 0 hashes; rank 1 hears the verdict). The work is done
    in its own call, as a stage's is, so the rank's model is garbage at shutdown."""
    from asyncrl.trainer.dist import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    info = init_distributed("cpu", rendezvous)
    Path(f"{out}.{info.rank}").write_text(json.dumps(_agree(model_dir, ckpt_root, info)))
    shutdown_distributed()


def _agree(model_dir: str, ckpt_root: str, info) -> list:
    from asyncrl.trainer.core import barrier

    core = _core(model_dir, info)
    for step in (1, 2):
        core.step = step
        save_checkpoint(core, ckpt_root, {"position": step}, keep=2)
    newest = Path(ckpt_root) / "step_00000002"
    if info.is_main:
        _flip_byte(newest / "extra_rank1.pt")
    barrier()
    picked = latest_checkpoint(ckpt_root)
    stage = load_checkpoint(core, picked)
    try:
        load_checkpoint(core, newest)
        error = ""
    except CheckpointError as err:
        error = str(err)
    return [picked.name, stage, error]


def test_two_ranks_agree_on_the_checkpoint(tiny_model_dir, tmp_path):
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1")
        env.pop("MASTER_ADDR", None)
        code = (
            "import sys; from tests.test_checkpoint_faults import _two_rank_worker as w; "
            "w(*sys.argv[1:])"
        )
        args = [tiny_model_dir, tmp_path / "ckpt", tmp_path / "rdv", tmp_path / "out"]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, *map(str, args)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    wait_for_ranks(procs)
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    for picked, stage, error in results:
        assert (picked, stage) == ("step_00000001", {"position": 1})
        assert "extra_rank1.pt does not match its sha256" in error
