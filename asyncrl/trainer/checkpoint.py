"""Checkpoints of the trainer: sharded model and optimizer via ``torch.distributed.checkpoint``,
plus per-rank RNG, the scheduler, the step and the stage's data position.

Layout under ``RUN_DIR/checkpoints/``: ``step_00000010/`` (DCP shards, ``extra_rank{r}.pt``,
``meta.json``) and a ``latest`` file naming the newest complete one (for people and tools;
``latest_checkpoint`` scans the directories). Companion cores trained beside the main one
(PPO's critic) go in a subdirectory of the same step, e.g. ``step_00000010/critic/``, with
their own shards, scheduler and step. A checkpoint is written under a ``.tmp`` name and
renamed only when every rank has finished, so a crash mid-write never leaves something
that looks complete. Its ``meta.json`` holds a manifest (size and sha256 of every other
file, subdirectories included), checked before loading, so a damaged newest checkpoint
falls back to the one before it. ``export_hf`` writes a plain Hugging Face directory that
``load_model`` (and the RL stages) read.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from asyncrl.models import hf_config, load_tokenizer, model_class
from asyncrl.trainer.core import TrainerCore, barrier
from asyncrl.trainer.dist import broadcast_json

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint directory whose files do not match its manifest (missing, wrong size,
    wrong hash) or whose meta.json cannot be read."""


def _rng_state() -> dict[str, Any]:
    """Every RNG stream as tensors and plain Python values, so that the file it goes into
    loads with ``weights_only=True`` (no pickle of arbitrary objects)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),  # (version, 625 ints, float | None)
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    if isinstance(keys, torch.Tensor):  # a tensor since manifests; the ndarray before
        keys = keys.numpy().astype(np.uint32)
    np.random.set_state((kind, keys, *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _manifest(path: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``path`` but meta.json, by relative path."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and p != path / "meta.json")
    return {
        p.relative_to(path).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in files
    }


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: cannot read meta.json ({err})") from err


# Directories verified in this process, with the (size, mtime) of their files then:
# load_checkpoint right after latest_checkpoint does not hash everything a second time.
_verified: dict[Path, list[tuple[str, int, int]]] = {}


def verify_checkpoint(path: str | Path) -> bool:
    """Check every file in the manifest of ``path``; raises ``CheckpointError`` naming the
    first missing, resized or changed file. Returns False for a checkpoint written before
    manifests existed (nothing to check), True when it verified."""
    path = Path(path)
    manifest = _read_meta(path).get("manifest")
    if manifest is None:
        return False
    # Sizes first: a missing or truncated file fails before any hashing.
    stats = []
    for rel, want in manifest.items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {rel} is missing")
        st = file.stat()
        if st.st_size != want["size"]:
            raise CheckpointError(
                f"checkpoint {path}: {rel} has {st.st_size} bytes, the manifest says {want['size']}"
            )
        stats.append((rel, st.st_size, st.st_mtime_ns))
    if _verified.get(path.resolve()) == stats:
        return True
    for rel, want in manifest.items():
        if _sha256(path / rel) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: {rel} does not match its sha256 in the manifest (corrupt)"
            )
    _verified[path.resolve()] = stats
    return True


def _on_rank0(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` computed on rank 0 and broadcast, so every rank gets the same answer
    (or the same ``CheckpointError``) while only one rank reads and hashes the files.
    ``fn`` returns JSON types (it crosses to the other ranks as JSON)."""
    many = dist.is_initialized() and dist.get_world_size() > 1
    if many and dist.get_rank() != 0:
        ok, value = broadcast_json(None)
        if not ok:
            raise CheckpointError(value)
        return value
    try:
        value = fn(*args)
    except Exception as err:
        if many:  # the other ranks are waiting on the broadcast: give them the error
            broadcast_json([False, f"rank 0: {err}"])
        raise
    if many:
        broadcast_json([True, value])
    return value


def _newest_verified(root: Path) -> str | None:
    complete = sorted(
        (p for p in root.glob("step_*") if p.suffix != ".tmp" and (p / "meta.json").is_file()),
        reverse=True,
    )
    for candidate in complete:
        try:
            verify_checkpoint(candidate)
            return str(candidate)
        except CheckpointError as err:
            print(f"[checkpoint] skipping a damaged checkpoint: {err}", flush=True)
    return None


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest complete checkpoint that matches its manifest, or None. Damaged ones are
    skipped with a warning naming the bad file. With several ranks, rank 0 verifies and
    broadcasts its choice: every rank must call this, and all get the same directory."""
    found = _on_rank0(_newest_verified, Path(ckpt_root))
    return Path(found) if found is not None else None


def _save_core(core: TrainerCore, path: Path, extra: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(core.model, core.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    extra = {"scheduler": core.scheduler.state_dict(), **extra}
    torch.save(extra, path / f"extra_rank{core.info.rank}.pt")


def _load_core(core: TrainerCore, path: Path, legacy: bool) -> dict[str, Any]:
    configured = list(core.scheduler.base_lrs)  # the config's rates, before the checkpoint's
    model_sd, optim_sd = get_state_dict(core.model, core.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        core.model, core.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    extra_file = path / f"extra_rank{core.info.rank}.pt"
    if not extra_file.is_file():
        extra_file = path / "extra_rank0.pt"
    # Tensors and plain values only. Checkpoints from before manifests pickled numpy's RNG
    # state: our own file on local disk, the one place that still unpickles.
    extra = torch.load(extra_file, weights_only=not legacy)
    core.scheduler.load_state_dict(extra["scheduler"])
    # The schedule's position is the checkpoint's, its rates the config's: a run resumed
    # (or replayed, tools/replay.py) with another optim.lr trains at that rate.
    core.set_base_lrs(configured)
    return extra


def save_checkpoint(
    core: TrainerCore,
    ckpt_root: str | Path,
    stage_state: dict[str, Any],
    keep: int,
    companions: dict[str, TrainerCore] | None = None,
) -> Path:
    """Write a checkpoint of ``core``, its ``companions`` (each in a subdirectory of that
    name) and ``stage_state`` (JSON-able); every rank calls this."""
    companions = companions or {}
    root = Path(ckpt_root)
    name = f"step_{core.step:08d}"
    final, tmp = root / name, root / f"{name}.tmp"
    if core.info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    _save_core(core, tmp, {"rng": _rng_state()})
    for sub, other in companions.items():
        _save_core(other, tmp / sub, {})
    barrier()  # every rank's shards and extra files are written: rank 0 can hash them all
    if core.info.is_main:
        meta = {
            "step": core.step,
            "world_size": core.info.world_size,
            "stage": stage_state,
            "companion_steps": {sub: other.step for sub, other in companions.items()},
            "manifest": _manifest(tmp),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer_tmp = root / "latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, root / "latest")
        older = sorted(p for p in root.glob("step_*") if p.is_dir() and p.suffix != ".tmp")
        for old in older[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(
    core: TrainerCore, path: str | Path, companions: dict[str, TrainerCore] | None = None
) -> dict[str, Any]:
    """Restore ``core`` and its ``companions`` from ``path``; returns the stage state saved
    with it. Every file is checked against the manifest first (on rank 0, the verdict
    broadcast); a mismatch raises ``CheckpointError`` naming the file."""
    path = Path(path)
    verified = _on_rank0(verify_checkpoint, path)
    if not verified and core.info.is_main:
        print(
            f"[checkpoint] {path} has no manifest (written before manifests): loading it "
            "unverified",
            flush=True,
        )
    meta = _read_meta(path)
    if meta["world_size"] != core.info.world_size:
        # DCP reshards model and optimizer; only per-rank RNG streams cannot carry over.
        print(f"[checkpoint] resharding from {meta['world_size']} to {core.info.world_size} ranks")
    saved_steps = meta.get("companion_steps", {})
    missing = sorted(set(companions or {}) - set(saved_steps))
    if missing:
        raise FileNotFoundError(f"checkpoint {path} has no {', '.join(missing)} to resume from")
    extra = _load_core(core, path, legacy=not verified)
    if meta["world_size"] == core.info.world_size:
        _set_rng_state(extra["rng"])
    core.step = meta["step"]
    for sub, other in (companions or {}).items():
        _load_core(other, path / sub, legacy=not verified)
        other.step = saved_steps[sub]
    return meta["stage"]


def export_hf(core: TrainerCore, out_dir: str | Path) -> Path | None:
    """Gather the full weights and write a Hugging Face directory (rank 0 writes)."""
    out_dir = Path(out_dir)
    full = core.full_state_dict()
    if core.info.is_main:
        src = Path(core.model_cfg.path)
        with torch.device("meta"):
            plain = model_class(core.model_cfg).from_config(hf_config(core.model_cfg))
        plain.load_state_dict(full, assign=True)
        if plain.can_generate():  # a value model has no generation config
            plain.generation_config = core.model.generation_config
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        plain.save_pretrained(tmp)
        load_tokenizer(src).save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out_dir)
    barrier()
    return out_dir if core.info.is_main else None
