"""The image reward model: a picture scorer (``asyncrl.image.scorer``) trained with the
Bradley–Terry loss on pairs of the SFT policy's own pictures ranked by the judge
(``asyncrl.stages.image_pairs``), measured by how often it ranks held-out scenes' pairs
as the judge does. One rank.

    python launch/local.py experiments/image_rm.py
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar

import numpy as np
import torch

from asyncrl.algorithms.preference import bradley_terry_loss
from asyncrl.config import ConfigError
from asyncrl.image.model import to_pixels
from asyncrl.image.pairs import PicturePairs, mirrored
from asyncrl.image.scorer import READERS, PictureScorer, ScorerConfig
from asyncrl.metrics import MetricsConfig, MetricsLogger
from asyncrl.stages.common import ProcessSpec, out_of_time, stage_main, trainer_ranks
from asyncrl.stages.image_pairs import ImagePairsConfig, load_or_make, training_pairs
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import adamw, param_groups
from asyncrl.trainer.dist import DistInfo
from asyncrl.trainer.finite import FiniteSteps


@dataclass
class ImageRMExperiment:
    name: str = "image_rm"
    """Experiment name; names the default run directory."""
    run_dir: str = ""
    """Run directory; empty means ``runs/NAME-TIME``."""
    seed: int = 0
    """Seed of the initialisation and the batches."""
    time_limit_s: float = 0.0
    """Stop after this many seconds of training (0: no limit); the scorer is still saved."""
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    """Sizes of the scorer."""
    pairs: ImagePairsConfig = field(default_factory=ImagePairsConfig)
    """The pairs: where they are kept, and how they are made when missing."""
    batch_size: int = 64
    """Pairs per optimizer step."""
    mirror: bool = True
    """Train on each batch's pairs flipped at random, their prompts' relation words swapped
    to match (``asyncrl.image.pairs.mirrored``): the judge ranks them the same, and the
    scorer sees each pair up to four ways."""
    max_steps: int = 600
    """Optimizer steps of the stage."""
    eval_every: int = 100
    """Held-out ranking accuracy every this many steps (and at the start and the end)."""
    export_dir: str = "runs/models/image-rm"
    """Where the trained scorer goes (``PictureScorer.save``)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """One rank; its threads."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=0.01))
    """AdamW and the learning-rate schedule."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Logging: TensorBoard, progress bar, cadence."""

    entry: ClassVar[str] = "asyncrl.stages.image_rm"
    """Module whose ``main`` runs the stage's rank."""

    def processes(self, config_path: str) -> list[ProcessSpec]:
        return trainer_ranks(self, config_path)

    def prerequisites(self) -> list[tuple[str, str]]:
        needs = [(self.pairs.policy, "experiments/image_sft.py")]
        if self.scorer.backbone:
            needs.append((self.scorer.backbone, "experiments/image_sft.py"))
        return needs

    def finalize(self) -> None:
        if self.trainer.num_ranks != 1:
            raise ConfigError(
                f"trainer.num_ranks={self.trainer.num_ranks}: the image RM trains on one rank"
            )
        if not self.scorer.backbone and self.scorer.reader not in READERS:
            raise ConfigError(
                f"scorer.reader={self.scorer.reader!r}: expected one of {sorted(READERS)}, "
                "or a policy directory as scorer.backbone"
            )
        if not self.run_dir:
            self.run_dir = f"runs/{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        if self.optim.total_steps <= 0:
            self.optim.total_steps = self.max_steps


def ranking_accuracy(scorer: PictureScorer, pairs: PicturePairs, batch: int = 256) -> float:
    """The share of ``pairs`` whose chosen picture the scorer scores above the rejected."""
    was_training = scorer.training
    scorer.eval()
    right = 0
    with torch.no_grad():
        for i in range(0, len(pairs), batch):
            prompts = pairs.prompts[i : i + batch]
            chosen = scorer.score(to_pixels(pairs.chosen[i : i + batch]), prompts)
            rejected = scorer.score(to_pixels(pairs.rejected[i : i + batch]), prompts)
            right += int((chosen > rejected).sum())
    scorer.train(was_training)
    return right / max(len(pairs), 1)


def run(cfg: ImageRMExperiment, info: DistInfo) -> dict:
    torch.manual_seed(cfg.seed)
    train = training_pairs(cfg.pairs, cfg.seed)
    held_out = load_or_make(cfg.pairs, held_out=True)
    scorer = PictureScorer(cfg.scorer)
    o = cfg.optim
    # A backbone fine-tunes at lr; what starts new (the head, the narrowing) at head_lr.
    groups = param_groups(scorer, o, is_head=lambda name: not name.startswith("reader.policy."))
    opt, schedule = adamw(groups, o)
    guard = FiniteSteps(cfg.trainer.max_nonfinite_steps)
    log = MetricsLogger(cfg.run_dir, "trainer", cfg.metrics, info.is_main, cfg.max_steps)
    log.log(0, {"eval/ranking_accuracy": (initial := ranking_accuracy(scorer, held_out))})
    order = torch.Generator().manual_seed(cfg.seed)
    flips = np.random.default_rng(cfg.seed)
    start, accuracy = time.time(), initial
    for step in range(1, cfg.max_steps + 1):
        pick = torch.randint(len(train), (cfg.batch_size,), generator=order).tolist()
        pictures = train.chosen[pick], train.rejected[pick], [train.prompts[i] for i in pick]
        if cfg.mirror:
            pictures = mirrored(*pictures, flips)
        chosen = scorer.score(to_pixels(pictures[0]), pictures[2])
        rejected = scorer.score(to_pixels(pictures[1]), pictures[2])
        loss_sum, metrics = bradley_terry_loss(chosen, rejected)
        opt.zero_grad(set_to_none=True)
        (loss_sum / len(pick)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(scorer.parameters(), o.max_grad_norm).item()
        scalars = {"train/loss": loss_sum.item() / len(pick), "train/grad_norm": grad_norm}
        guard.step(opt, schedule, scalars["train/loss"], grad_norm, step)
        scalars |= {k: v.item() / len(pick) for k, v in metrics.items()}
        last = step == cfg.max_steps or out_of_time(start, cfg.time_limit_s, info)
        if step % cfg.eval_every == 0 or last:
            scalars["eval/ranking_accuracy"] = accuracy = ranking_accuracy(scorer, held_out)
        log.log(step, scalars)
        log.progress(1, {"loss": f"{scalars['train/loss']:.3f}", "acc": f"{accuracy:.2f}"})
        if last:
            break
    scorer.save(cfg.export_dir)
    summary = {
        "steps": step,
        "train_time_s": round(time.time() - start, 2),
        "train_pairs": len(train),
        "held_out_pairs": len(held_out),
        "initial_ranking_accuracy": initial,
        "final_ranking_accuracy": accuracy,
        "export_dir": cfg.export_dir,
    }
    log.write_summary(summary)
    log.close()
    return summary


def main(argv: list[str] | None = None) -> None:
    stage_main(run, argv)


if __name__ == "__main__":
    main()
