"""Asynchronous Flow-GRPO on the image policy: the image chain's RL stage, on the same
buffer, leases, staleness gate and weight buckets as text RL.

The processes are RL's: the buffer (prompts: the image task's training scenes,
``asyncrl.buffer.image_rollout``), image generators (``asyncrl.generator.images``: SDE
sampling with continuous batching over denoising steps, each step a token with its
log-probability and version, frames beside it; a finished picture judged there) and one
trainer rank, this module. Each step of the trainer:

1. takes the step's batch from the buffer: whole groups, at most ``buffer.max_staleness``
   versions old;
2. draws ``rl.train_steps`` of each picture's denoising steps (Flow-GRPO trains on a
   fraction of them);
3. recomputes their log-probabilities under its weights (``step_distributions``; these are
   also the proximal policy's: one update per batch);
4. takes the decoupled clipped loss per step with group-relative advantages
   (``flow_grpo_loss``), optionally a KL to the starting policy, and one optimizer step
   (skipped if its loss or gradient is not finite; ``trainer.max_nonfinite_steps`` such
   steps in a row stop the run);
5. publishes version v + 1 as buckets and announces it to the buffer;
6. logs, and every ``eval.every_steps`` judges held-out scenes (ODE pictures, PNG grid).

    python launch/local.py experiments/image_grpo.py
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import ClassVar

import torch

from asyncrl.algorithms.flow_grpo import flow_grpo_loss, step_distributions, step_kl, train_steps
from asyncrl.algorithms.losses import PPOLossConfig
from asyncrl.buffer.client import BufferClient
from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.image_rollout import ImageRolloutConfig
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.config import ConfigError, save_json
from asyncrl.engine.image import ImageSamplingConfig
from asyncrl.engine.leases import SamplingConfig
from asyncrl.image.flow import time_grid
from asyncrl.image.model import ImagePolicy
from asyncrl.interfaces import FullParameters
from asyncrl.loop.pictures import PictureBatch
from asyncrl.metrics import MetricsConfig, MetricsLogger
from asyncrl.models import ModelConfig
from asyncrl.stages.common import ProcessSpec, out_of_time, stage_main, trainer_ranks
from asyncrl.stages.image_sft import ImageEvalConfig, held_out_scenes, judge_and_show
from asyncrl.stages.rl import Ledger
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import adamw
from asyncrl.trainer.dist import DistInfo
from asyncrl.trainer.finite import FiniteSteps
from asyncrl.transport import RunSite, TransportConfig
from asyncrl.weights.sender import BucketPublisher


@dataclass
class FlowGRPOConfig:
    max_steps: int = 100
    """Trainer steps (weights versions) of the stage."""
    train_steps: int = 4
    """Denoising steps of each picture trained on, drawn afresh per picture from its SDE
    steps (``image.sde_steps``, or all ``image.steps``): fewer than sampled, as Flow-GRPO
    trains."""
    loss: PPOLossConfig = field(
        default_factory=lambda: PPOLossConfig(clip_low=1e-3, clip_high=1e-3)
    )
    """The decoupled clipped loss on per-dimension step log-probabilities
    (``asyncrl.algorithms.flow_grpo``); ``kl_coef`` > 0 adds a KL to the starting policy."""
    scale_by_std: bool = True
    """Divide advantages by their group's reward std (GRPO's); False: centre only."""


@dataclass
class ImageGRPOExperiment:
    name: str = "image_grpo"
    """Experiment name; names the default run directory."""
    run_dir: str = ""
    """Run directory; empty means ``runs/NAME-TIME``."""
    seed: int = 0
    """Seed of the prompt order, every picture's noise and the trained steps (the held-out
    scenes are ``eval.seed``'s)."""
    time_limit_s: float = 0.0
    """Stop after this many seconds of training (0: no limit); the run still exports."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="runs/models/image-sft"))
    """The image policy directory to start from (``ImagePolicy.save``; image SFT's export)."""
    export_dir: str = ""
    """Where the final policy goes; empty means ``RUN_DIR/policy``."""
    num_generators: int = 1
    """Image generator processes."""
    max_batch: int = 16
    """Pictures a generator steps at once."""
    image: ImageSamplingConfig = field(default_factory=ImageSamplingConfig)
    """The SDE sampler (steps, shift, noise level)."""
    rl: FlowGRPOConfig = field(default_factory=FlowGRPOConfig)
    """The trainer's side: steps, trained denoising steps per picture, the loss."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """Groups per batch (``prompts_per_batch`` × ``samples_per_prompt`` pictures), η."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """One rank; its threads."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """Sockets, heartbeats, chunking and the weight buckets (as text RL's)."""
    eval: ImageEvalConfig = field(default_factory=ImageEvalConfig)
    """Held-out success: how often, on how many scenes, with which (ODE) sampler."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Logging: TensorBoard, progress bar, cadence."""

    entry: ClassVar[str] = "asyncrl.stages.image_grpo"
    """Module whose ``main`` runs the trainer rank."""

    def finalize(self) -> None:
        if self.trainer.num_ranks != 1:
            raise ConfigError(
                f"trainer.num_ranks={self.trainer.num_ranks}: image RL trains on one rank"
            )
        if not self.run_dir:
            self.run_dir = f"runs/{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        if not self.export_dir:
            self.export_dir = str(Path(self.run_dir) / "policy")
        if self.optim.total_steps <= 0:
            self.optim.total_steps = self.rl.max_steps
        self.image.check()
        stochastic = self.image.stochastic_steps
        if not 1 <= self.rl.train_steps <= stochastic:
            raise ConfigError(
                f"rl.train_steps={self.rl.train_steps} must be 1 to the SDE steps "
                f"({stochastic}: image.sde_steps, or image.steps when it is 0)"
            )
        self.rl.loss.check()

    def prerequisites(self) -> list[tuple[str, str]]:
        return [(self.model.path, "experiments/image_sft.py")]

    def preflight(self) -> None:
        if not (Path(self.model.path) / "image_model.json").exists():
            raise ConfigError(f"model.path={self.model.path!r} is no image policy directory")

    def processes(self, config_path: str) -> list[ProcessSpec]:
        rollout_path = str(Path(config_path).with_name("rollout.json"))
        save_json(self.rollout(), rollout_path)
        procs = [
            ProcessSpec(
                "buffer",
                "asyncrl.buffer.server",
                ["--config", rollout_path],
                group="buffer",
                max_restarts=5,
            )
        ]
        procs += [
            ProcessSpec(
                f"generator_{i}",
                "asyncrl.generator.images",
                ["--config", rollout_path, "--worker-id", f"g{i}"],
                restartable=True,
            )
            for i in range(self.num_generators)
        ]
        return procs + trainer_ranks(self, config_path)

    @property
    def run_id(self) -> str:
        return Path(self.run_dir).name

    def site(self) -> RunSite:
        return RunSite(self.run_dir, self.run_id, self.transport)

    def rollout(self) -> ImageRolloutConfig:
        """What the buffer and the image generators read. Rewards come with the pictures
        (judged by the generators), so the buffer scores nothing itself (``workers=0``)."""
        return ImageRolloutConfig(
            run_dir=self.run_dir,
            run_id=self.run_id,
            seed=self.seed,
            model=self.model,
            buffer=self.buffer,
            sampling=SamplingConfig(max_new_tokens=self.image.steps),
            reward=RewardConfig(workers=0),
            transport=self.transport,
            metrics=self.metrics,
            image=self.image,
            max_batch=self.max_batch,
        )


@dataclass
class Parts:
    """What the trainer rank works with (built by ``setup``)."""

    policy: ImagePolicy
    reference: ImagePolicy | None
    """A frozen copy of the starting policy, when the loss has a KL term."""
    opt: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    guard: FiniteSteps
    log: MetricsLogger
    held_out: list
    """The held-out scenes judged at every evaluation."""
    source: BufferClient
    publisher: BucketPublisher
    ledger: Ledger
    """What ``tools/chaos.py`` audits: the samples each step trained on."""


def setup(cfg: ImageGRPOExperiment, info: DistInfo) -> Parts:
    torch.manual_seed(cfg.seed)
    policy = ImagePolicy.load(cfg.model.path)
    reference = copy.deepcopy(policy).requires_grad_(False) if cfg.rl.loss.kl_coef else None
    opt, schedule = adamw(policy.parameters(), cfg.optim)
    return Parts(
        policy,
        reference,
        opt,
        schedule,
        FiniteSteps(cfg.trainer.max_nonfinite_steps),
        MetricsLogger(cfg.run_dir, "trainer", cfg.metrics, info.is_main, cfg.rl.max_steps),
        held_out_scenes(cfg.eval),
        BufferClient(cfg.run_dir, cfg.run_id, info.rank, cfg.transport),
        BucketPublisher(cfg.site()),
        Ledger(cfg.run_dir, info.rank),
    )


def run(cfg: ImageGRPOExperiment, info: DistInfo) -> dict:
    """The stage's one trainer rank, to ``rl.max_steps`` versions; returns the summary."""
    r = setup(cfg, info)
    initial = judged = judge_and_show(r.policy, r.held_out, cfg.eval, r.log, 0)
    r.log.log(0, judged)
    r.source.announce_version(0, resumed=True)
    grid = time_grid(cfg.image.steps, cfg.image.shift)
    picks = torch.Generator().manual_seed(cfg.seed)  # which steps of each picture train
    start, step, stop = time.time(), 0, False
    deadline = start + cfg.time_limit_s if cfg.time_limit_s > 0 else None
    while step < cfg.rl.max_steps and not stop:
        # 1. the step's batch: whole groups, at most max_staleness versions old
        waited = time.perf_counter()
        batch = r.source.request_batch(
            step, 1, on_wait=r.publisher.republish, wait_tick_s=5.0, deadline=deadline
        )
        if batch is None:  # the time limit passed waiting for it
            break
        waited = time.perf_counter() - waited
        # 2-4. the update on a draw of each picture's steps
        pictures = PictureBatch.of(batch.samples, cfg.image.steps)
        scalars = gradients(r.policy, r.reference, pictures, cfg, grid, picks)
        r.guard.step(r.opt, r.schedule, scalars["train/loss"], scalars["train/grad_norm"], step + 1)
        # 5. version step + 1 to the generators and the buffer
        sync_s = r.publisher.publish(step + 1, snapshot(r.policy))
        r.source.announce_version(step + 1)
        r.ledger.write(step, batch.samples)
        step += 1
        # 6. log and evaluate
        stop = out_of_time(start, cfg.time_limit_s, info)
        scalars |= batch_scalars(pictures, step, waited, sync_s) | {
            "train/lr": r.schedule.get_last_lr()[0]
        }
        if step % cfg.eval.every_steps == 0 or step == cfg.rl.max_steps or stop:
            judged = judge_and_show(r.policy, r.held_out, cfg.eval, r.log, step)
            scalars |= judged
        r.log.log(step, scalars)
        r.log.progress(
            1,
            {"reward": f"{scalars['rollout/reward']:.2f}", "acc": f"{judged['eval/accuracy']:.2f}"},
        )
    return finish(
        r, cfg, step, time.time() - start, {"initial_eval": initial, "final_eval": judged}
    )


def snapshot(policy: ImagePolicy) -> FullParameters:
    """The weights as copies: the publisher reads them on its own thread while the next
    update changes the parameters in place."""
    return FullParameters.of({k: v.detach().clone() for k, v in policy.state_dict().items()})


def batch_scalars(pictures: PictureBatch, step: int, waited: float, sync_s: float) -> dict:
    """The batch's reward and staleness, and the step's waits."""
    return {
        "rollout/reward": pictures.rewards.mean().item(),
        "rollout/staleness_max": float(step - 1 - pictures.versions.min()),
        "rollout/versions_per_picture": float(
            sum(len(set(row)) for row in pictures.versions.tolist()) / len(pictures.prompts)
        ),
        "train/wait_for_batch_s": waited,
        "train/weight_publish_s": sync_s,
    }


def finish(r: Parts, cfg: ImageGRPOExperiment, steps: int, seconds: float, evals: dict) -> dict:
    """Export the policy, write the summary, close the sockets; returns the summary."""
    r.policy.save(cfg.export_dir)
    summary = {"steps": steps, "train_time_s": round(seconds, 2), **evals}
    summary["export_dir"] = cfg.export_dir
    r.log.write_summary(summary)
    r.log.close()
    r.publisher.close()
    r.source.close()
    r.ledger.close()
    return summary


def gradients(
    policy: ImagePolicy,
    reference: ImagePolicy | None,
    pictures: PictureBatch,
    cfg: ImageGRPOExperiment,
    grid: list[float],
    picks: torch.Generator,
) -> dict[str, float]:
    """The gradients of one Flow-GRPO update on ``pictures``, clipped; returns its metrics
    (the loss and the gradient norm among them)."""
    n, a = len(pictures.prompts), cfg.image.noise_level
    steps = train_steps(cfg.image.stochastic_steps, cfg.rl.train_steps, picks, n)  # [N, S]
    behavior = pictures.behavior.gather(1, steps)
    chosen = (pictures.frames, pictures.prompts, steps, grid, a)
    logprobs, means, std = step_distributions(policy, *chosen)
    kl = None
    if reference is not None:
        with torch.no_grad():
            ref_means = step_distributions(reference, *chosen)[1]
        kl = step_kl(means, ref_means, std)
    advantages = pictures.advantages(cfg.rl.scale_by_std)
    # One update per batch: the proximal policy is this forward's, without its gradient.
    loss_sum, metrics = flow_grpo_loss(
        logprobs, logprobs.detach(), behavior, advantages, cfg.rl.loss, kl
    )
    count = steps.numel()
    policy.zero_grad(set_to_none=True)
    (loss_sum / count).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optim.max_grad_norm)
    out = {k: v.item() / count for k, v in metrics.items()}
    return out | {"train/loss": loss_sum.item() / count, "train/grad_norm": grad_norm.item()}


def main(argv: list[str] | None = None) -> None:
    stage_main(run, argv)


if __name__ == "__main__":
    main()
