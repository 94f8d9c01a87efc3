"""Flow-matching pretraining of the image policy: the image chain's SFT stage.

Each step draws a batch of training scenes (``asyncrl.image.scenes``, categories in turn),
renders them procedurally, and fits the policy's velocity to the flow between noise and
those pictures (``flow_matching_loss``). Held-out scenes are judged every
``eval.every_steps`` on ODE pictures (``asyncrl.image.sample``): per-category success goes
to ``metrics.jsonl`` and TensorBoard, a grid of pictures to ``RUN_DIR/images`` and
TensorBoard's image tab. The final policy is exported as a directory
(``ImagePolicy.save``) that the image RL stages start from. One rank for now.

    python launch/local.py experiments/image_sft.py
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from asyncrl.config import ConfigError
from asyncrl.image.model import ImageModelConfig, ImagePolicy, flow_matching_loss, to_pixels
from asyncrl.image.render import draw
from asyncrl.image.sample import evaluate
from asyncrl.image.scenes import Scene, sample_scenes
from asyncrl.metrics import MetricsConfig, MetricsLogger
from asyncrl.stages.common import ProcessSpec, out_of_time, stage_main, trainer_ranks
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import adamw
from asyncrl.trainer.dist import DistInfo
from asyncrl.trainer.finite import FiniteSteps


@dataclass
class ImageSFTConfig:
    batch_size: int = 32
    """Pictures per optimizer step."""
    max_steps: int = 600
    """Optimizer steps of the stage."""
    export_dir: str = ""
    """Where the final policy goes; empty means ``RUN_DIR/policy``."""
    init_path: str = ""
    """A policy directory to start from; empty: a new one, initialised from the seed."""


@dataclass
class ImageEvalConfig:
    every_steps: int = 100
    """Judge held-out scenes every this many steps (and at the start and the end)."""
    num_scenes: int = 64
    """Held-out scenes judged, the categories in turn (the same ones every time)."""
    steps: int = 10
    """Denoising steps of the evaluation sampler (the ODE)."""
    shift: float = 3.0
    """SD3's time shift of the sampler's steps (more of them at high noise)."""
    shown: int = 16
    """Pictures in each evaluation's grid."""
    seed: int = 0
    """Which held-out scenes are judged. Not the run's seed: every stage and every seed of
    a study is judged on the same scenes (64 scenes make a figure that moves ±5 points
    from one set of scenes to another, more than most differences between runs)."""


@dataclass
class ImageSFTExperiment:
    name: str = "image_sft"
    """Experiment name; names the default run directory."""
    run_dir: str = ""
    """Run directory; empty means ``runs/NAME-TIME``."""
    seed: int = 0
    """Seed of the initialisation and the batches (the evaluation set is ``eval.seed``'s)."""
    time_limit_s: float = 0.0
    """Stop after this many seconds of training (0: no limit); the run still exports."""
    model: ImageModelConfig = field(default_factory=ImageModelConfig)
    """Sizes of a new policy (ignored when ``sft.init_path`` names one)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Ranks (one), threads and device."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    sft: ImageSFTConfig = field(default_factory=ImageSFTConfig)
    """Batch, steps, start and export."""
    eval: ImageEvalConfig = field(default_factory=ImageEvalConfig)
    """Held-out success: how often, on how many scenes, with which sampler."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Logging: TensorBoard, progress bar, cadence."""

    entry: ClassVar[str] = "asyncrl.stages.image_sft"
    """Module whose ``main`` runs one trainer rank of this stage."""

    def processes(self, config_path: str) -> list[ProcessSpec]:
        return trainer_ranks(self, config_path)

    def finalize(self) -> None:
        if self.trainer.num_ranks != 1:
            raise ConfigError(
                f"trainer.num_ranks={self.trainer.num_ranks}: the image stages train on one "
                "rank (the policy has 2.3 M parameters)"
            )
        if not self.run_dir:
            self.run_dir = f"runs/{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        if not self.sft.export_dir:
            self.sft.export_dir = str(Path(self.run_dir) / "policy")
        if self.optim.total_steps <= 0:
            self.optim.total_steps = self.sft.max_steps


def training_batch(step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """Step ``step``'s pictures [B, 3, 32, 32] in [-1, 1] and their prompts: training
    scenes, categories in turn, drawn afresh (a function of seed and step alone)."""
    scenes = sample_scenes(batch_size, held_out=False, seed=seed * 1_000_003 + step)
    rng = random.Random(seed * 7_919 + step)
    pictures = np.stack([draw(scene, rng) for scene in scenes])
    return to_pixels(pictures), [s.prompt for s in scenes]


def run(cfg: ImageSFTExperiment, info: DistInfo) -> dict:
    """The stage's one rank, to ``sft.max_steps`` steps; returns the summary."""
    torch.manual_seed(cfg.seed)
    policy = ImagePolicy.load(cfg.sft.init_path) if cfg.sft.init_path else ImagePolicy(cfg.model)
    o = cfg.optim
    opt, schedule = adamw(policy.parameters(), o)
    guard = FiniteSteps(cfg.trainer.max_nonfinite_steps)
    log = MetricsLogger(cfg.run_dir, "trainer", cfg.metrics, info.is_main, cfg.sft.max_steps)
    held_out = held_out_scenes(cfg.eval)
    judged = judge_and_show(policy, held_out, cfg.eval, log, 0)
    log.log(0, judged)
    initial, start, step, stop = judged, time.time(), 0, False
    while step < cfg.sft.max_steps and not stop:
        x0, prompts = training_batch(step, cfg.sft.batch_size, cfg.seed)
        noise = torch.Generator().manual_seed(cfg.seed * 104_729 + step)
        loss = flow_matching_loss(policy, x0, prompts, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), o.max_grad_norm)
        guard.step(opt, schedule, loss.item(), grad_norm.item(), step + 1)
        step += 1
        stop = out_of_time(start, cfg.time_limit_s, info)
        scalars = {"train/loss": loss.item(), "train/grad_norm": grad_norm.item()}
        scalars["train/lr"] = schedule.get_last_lr()[0]
        if step % cfg.eval.every_steps == 0 or step == cfg.sft.max_steps or stop:
            judged = judge_and_show(policy, held_out, cfg.eval, log, step)
            scalars |= judged
        if step % cfg.metrics.log_every == 0 or step == cfg.sft.max_steps or stop:
            log.log(step, scalars)
        log.progress(1, {"loss": f"{loss.item():.3f}", "acc": f"{judged['eval/accuracy']:.2f}"})
    policy.save(cfg.sft.export_dir)
    summary = {
        "steps": step,
        "train_time_s": round(time.time() - start, 2),
        "initial_eval": initial,
        "final_eval": judged,
        "export_dir": cfg.sft.export_dir,
    }
    log.write_summary(summary)
    log.close()
    return summary


def held_out_scenes(cfg: ImageEvalConfig) -> list[Scene]:
    """The held-out scenes every evaluation of every image stage judges: ``cfg.seed``'s."""
    return sample_scenes(cfg.num_scenes, held_out=True, seed=cfg.seed)


def judge_and_show(
    policy: ImagePolicy, scenes: list, cfg: ImageEvalConfig, log: MetricsLogger, step: int
) -> dict[str, float]:
    """Held-out success of ``policy``; its picture grid goes to the log at ``step``."""
    scalars, grid = evaluate(policy, scenes, cfg.steps, cfg.shift, cfg.shown)
    log.image(step, "eval/pictures", grid)
    return scalars


def main(argv: list[str] | None = None) -> None:
    stage_main(run, argv)


if __name__ == "__main__":
    main()
