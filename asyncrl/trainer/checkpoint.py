"""Checkpoints of the trainer: sharded model and optimizer via ``torch.distributed.checkpoint``,
plus per-rank RNG, the scheduler, the step and the stage's data position.

Layout under ``RUN_DIR/checkpoints/``: ``step_00000010/`` (DCP shards, ``extra_rank{r}.pt``,
``meta.json``) and a ``latest`` file naming the newest complete one. Companion cores
trained beside the main one (PPO's critic) go in a subdirectory of the same step, e.g.
``step_00000010/critic/``, with their own shards, scheduler and step. A checkpoint is
written under a ``.tmp`` name and renamed only when every rank has finished, so a crash
mid-write never leaves something that looks complete. ``export_hf`` writes a plain
Hugging Face directory that ``load_model`` (and the RL stages) read.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from asyncrl.models import hf_config, load_tokenizer, model_class
from asyncrl.trainer.core import TrainerCore, barrier


def _rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    root = Path(ckpt_root)
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "meta.json").is_file():
            return candidate
    # The pointer is only a shortcut: fall back to the newest directory with a meta.json.
    done = sorted(
        p for p in root.glob("step_*") if (p / "meta.json").is_file() and p.suffix != ".tmp"
    )
    return done[-1] if done else None


def _save_core(core: TrainerCore, path: Path, extra: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(core.model, core.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    extra = {"scheduler": core.scheduler.state_dict(), **extra}
    torch.save(extra, path / f"extra_rank{core.info.rank}.pt")


def _load_core(core: TrainerCore, path: Path) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(core.model, core.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        core.model, core.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    extra_file = path / f"extra_rank{core.info.rank}.pt"
    if not extra_file.is_file():
        extra_file = path / "extra_rank0.pt"
    # Our own file on local disk, written by _save_core above (RNG states need pickle).
    extra = torch.load(extra_file, weights_only=False)
    core.scheduler.load_state_dict(extra["scheduler"])
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
    barrier()
    if core.info.is_main:
        meta = {"step": core.step, "world_size": core.info.world_size, "stage": stage_state,
                "companion_steps": {sub: other.step for sub, other in companions.items()}}  # fmt: skip
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
    with it."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta["world_size"] != core.info.world_size:
        # DCP reshards model and optimizer; only per-rank RNG streams cannot carry over.
        print(f"[checkpoint] resharding from {meta['world_size']} to {core.info.world_size} ranks")
    saved_steps = meta.get("companion_steps", {})
    missing = sorted(set(companions or {}) - set(saved_steps))
    if missing:
        raise FileNotFoundError(f"checkpoint {path} has no {', '.join(missing)} to resume from")
    extra = _load_core(core, path)
    if meta["world_size"] == core.info.world_size:
        _set_rng_state(extra["rng"])
    core.step = meta["step"]
    for sub, other in (companions or {}).items():
        _load_core(other, path / sub)
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
