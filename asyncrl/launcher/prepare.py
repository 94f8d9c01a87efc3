"""From an experiment file to stages ready to start, the same way for every launcher.

An experiment file builds ``config``; the overrides are applied, ``finalize()`` computes
the derived values, and the result is saved as ``RUN_DIR/config.json``, which is all a
process of the run reads. When the experiment starts from a checkpoint another stage
writes (``prerequisites()``: e.g. SFT before RL, or SFT and the reward model before PPO on
a learned reward) and that output is missing, that stage comes first in the chain. ``launch/local.py`` runs the chain in order;
``launch/slurm.py`` submits one job per stage, each depending on the one before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import apply_overrides, load_experiment, save_json
from asyncrl.security import curve_enabled, ensure_keys
from asyncrl.stages.common import ProcessSpec


def resolve(experiment: str, overrides: list[str]) -> Any:
    """The experiment's config with overrides applied and derived values computed;
    raises ``ConfigError`` naming a bad key or value."""
    cfg = load_experiment(experiment)
    apply_overrides(cfg, overrides)
    cfg.finalize()
    if hasattr(cfg, "trainer"):
        cfg.trainer.check()
    return cfg


def missing_prerequisites(cfg: Any) -> list[str]:
    """Experiment files to run first because an output ``cfg`` starts from (a policy, a
    reward model) does not exist yet. An experiment lists them in ``prerequisites()`` as
    (path, experiment file) pairs."""
    needs = cfg.prerequisites() if hasattr(cfg, "prerequisites") else []
    return [experiment for path, experiment in needs if experiment and not Path(path).exists()]


def stage_chain(experiment: str, overrides: list[str], _seen: set[Path] | None = None) -> list[Any]:
    """The resolved configs to run in order: the missing prerequisite stages, depth first
    and each once (without overrides, as their files define them), then the experiment."""
    seen = set() if _seen is None else _seen
    cfg = resolve(experiment, overrides)
    chain: list[Any] = []
    for first in missing_prerequisites(cfg):
        if Path(first).resolve() not in seen:
            seen.add(Path(first).resolve())
            chain += stage_chain(first, [], seen)
    return chain + [cfg]


@dataclass
class Prepared:
    """A stage whose run directory holds its resolved config, ready to start."""

    cfg: Any
    config_path: Path
    processes: list[ProcessSpec]

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)


def prepare(cfg: Any, adjust: Callable[[Any], None] | None = None) -> Prepared:
    """Save ``cfg`` (after ``adjust``, a launcher's last word, e.g. TCP across nodes) as
    ``RUN_DIR/config.json`` and list its processes (which may write more config files for
    them, e.g. RL's ``rollout.json``)."""
    if adjust is not None:
        adjust(cfg)
    if hasattr(cfg, "preflight"):
        cfg.preflight()  # checks that need the stage's inputs (e.g. prompt sizes): now, once
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    transport = getattr(cfg, "transport", None)
    if transport is not None and curve_enabled(transport):
        ensure_keys(run_dir)  # before any process binds or connects (asyncrl.security)
    config_path = run_dir / "config.json"
    save_json(cfg, config_path)
    return Prepared(cfg, config_path, cfg.processes(str(config_path)))


def clear_rendezvous(run_dir: Path) -> None:
    """Forget what an earlier launch on this run directory left for peers to find: the
    gloo rendezvous file and the endpoint files (a fresh process must not dial a dead
    socket)."""
    (run_dir / "rendezvous").unlink(missing_ok=True)
    for stale in (run_dir / "endpoints").glob("*.json"):
        stale.unlink()
