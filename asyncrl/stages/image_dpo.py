"""Diffusion-DPO on the image policy (``asyncrl.algorithms.flow_dpo``): from the SFT policy,
on pairs of its own pictures ranked by the judge (``asyncrl.stages.image_pairs``), with
the SFT policy frozen as the reference. Held-out success is judged as in image SFT. One
rank.

    python launch/local.py experiments/image_dpo.py
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import ClassVar

import torch

from asyncrl.algorithms.flow_dpo import diffusion_dpo_loss
from asyncrl.algorithms.preference import DPOLossConfig
from asyncrl.config import ConfigError
from asyncrl.image.model import ImagePolicy, to_pixels
from asyncrl.image.pairs import PicturePairs
from asyncrl.metrics import MetricsConfig, MetricsLogger
from asyncrl.stages.common import ProcessSpec, out_of_time, stage_main, trainer_ranks
from asyncrl.stages.image_pairs import ImagePairsConfig, training_pairs
from asyncrl.stages.image_sft import ImageEvalConfig, held_out_scenes, judge_and_show
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import adamw
from asyncrl.trainer.dist import DistInfo
from asyncrl.trainer.finite import FiniteSteps


@dataclass
class ImageDPOExperiment:
    name: str = "image_dpo"
    """Experiment name; names the default run directory."""
    run_dir: str = ""
    """Run directory; empty means ``runs/NAME-TIME``."""
    seed: int = 0
    """Seed of the batches and the noise of each pair (the held-out scenes are
    ``eval.seed``'s)."""
    time_limit_s: float = 0.0
    """Stop after this many seconds of training (0: no limit); the run still exports."""
    pairs: ImagePairsConfig = field(default_factory=ImagePairsConfig)
    """The pairs; ``pairs.policy`` is also where the policy and its reference start."""
    loss: DPOLossConfig = field(default_factory=lambda: DPOLossConfig(beta=2000.0))
    """β on the scale of per-dimension velocity errors (``asyncrl.algorithms.flow_dpo``)."""
    batch_size: int = 32
    """Pairs per optimizer step."""
    max_steps: int = 300
    """Optimizer steps of the stage."""
    export_dir: str = ""
    """Where the final policy goes; empty means ``RUN_DIR/policy``."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """One rank; its threads."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_steps=0))
    """AdamW and the learning-rate schedule."""
    eval: ImageEvalConfig = field(default_factory=ImageEvalConfig)
    """Held-out success: how often, on how many scenes, with which (ODE) sampler."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Logging: TensorBoard, progress bar, cadence."""

    entry: ClassVar[str] = "asyncrl.stages.image_dpo"
    """Module whose ``main`` runs the stage's rank."""

    def processes(self, config_path: str) -> list[ProcessSpec]:
        return trainer_ranks(self, config_path)

    def prerequisites(self) -> list[tuple[str, str]]:
        return [(self.pairs.policy, "experiments/image_sft.py")]

    def finalize(self) -> None:
        if self.trainer.num_ranks != 1:
            raise ConfigError(
                f"trainer.num_ranks={self.trainer.num_ranks}: image DPO trains on one rank"
            )
        if not self.run_dir:
            self.run_dir = f"runs/{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        if not self.export_dir:
            self.export_dir = str(Path(self.run_dir) / "policy")
        if self.optim.total_steps <= 0:
            self.optim.total_steps = self.max_steps


def dpo_gradients(policy, reference, pairs: PicturePairs, pick: list[int], cfg, noise) -> dict:
    """The gradients of one optimizer step on the pairs ``pick``, clipped; returns its
    metrics (the loss and the gradient norm among them)."""
    prompts = [pairs.prompts[i] for i in pick]
    chosen, rejected = to_pixels(pairs.chosen[pick]), to_pixels(pairs.rejected[pick])
    loss_sum, metrics = diffusion_dpo_loss(
        policy, reference, chosen, rejected, prompts, cfg.loss, noise
    )
    policy.zero_grad(set_to_none=True)
    (loss_sum / len(pick)).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optim.max_grad_norm)
    out = {k: v.item() / len(pick) for k, v in metrics.items()}
    return out | {"train/loss": loss_sum.item() / len(pick), "train/grad_norm": grad_norm.item()}


def run(cfg: ImageDPOExperiment, info: DistInfo) -> dict:
    torch.manual_seed(cfg.seed)
    pairs = training_pairs(cfg.pairs, cfg.seed)
    policy = ImagePolicy.load(cfg.pairs.policy)
    reference = copy.deepcopy(policy).requires_grad_(False)
    opt, schedule = adamw(policy.parameters(), cfg.optim)
    guard = FiniteSteps(cfg.trainer.max_nonfinite_steps)
    log = MetricsLogger(cfg.run_dir, "trainer", cfg.metrics, info.is_main, cfg.max_steps)
    held_out = held_out_scenes(cfg.eval)
    initial = judged = judge_and_show(policy, held_out, cfg.eval, log, 0)
    log.log(0, judged)
    order, noise = (
        torch.Generator().manual_seed(cfg.seed),
        torch.Generator().manual_seed(cfg.seed + 1),
    )
    start, step, stop = time.time(), 0, False
    while step < cfg.max_steps and not stop:
        pick = torch.randint(len(pairs), (cfg.batch_size,), generator=order).tolist()
        scalars = dpo_gradients(policy, reference, pairs, pick, cfg, noise)
        step += 1
        guard.step(opt, schedule, scalars["train/loss"], scalars["train/grad_norm"], step)
        stop = out_of_time(start, cfg.time_limit_s, info)
        if step % cfg.eval.every_steps == 0 or step == cfg.max_steps or stop:
            judged = judge_and_show(policy, held_out, cfg.eval, log, step)
            scalars |= judged
        log.log(step, scalars)
        log.progress(
            1, {"loss": f"{scalars['train/loss']:.3f}", "acc": f"{judged['eval/accuracy']:.2f}"}
        )
    policy.save(cfg.export_dir)
    summary = {
        "steps": step,
        "train_time_s": round(time.time() - start, 2),
        "pairs": len(pairs),
        "initial_eval": initial,
        "final_eval": judged,
        "export_dir": cfg.export_dir,
    }
    log.write_summary(summary)
    log.close()
    return summary


def main(argv: list[str] | None = None) -> None:
    stage_main(run, argv)


if __name__ == "__main__":
    main()
