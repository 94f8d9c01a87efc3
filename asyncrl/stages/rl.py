"""Online RL, the asynchronous core (docs/design.md): the trainer ranks' side.

``run`` is the loop, one step per batch: each rank asks its ``BatchSource`` for its share
of step i's batch (whole groups, staleness checked), packs it into micro-batches, takes
the proximal logprobs (the weights at the start of the step; by default from the first
update's own forward) and the frozen reference's, lets the ``Advantages`` strategy do its
part (nothing for GRPO/RLOO, whose advantages come with the batch; values and GAE for
PPO's critic, ``asyncrl.loop.advantages``), takes the decoupled-PPO update(s) on the
FSDP2 core, and rank 0's ``WeightPublisher`` sends the new weights as version i+1 (ZeroMQ
frames, a versioned HF directory or NCCL; ``asyncrl.trainer.publish``) before the buffer
hears of the version. The loop alone advances the version, once per batch. The
``Guard`` (``asyncrl.loop.guard``) judges each update's statistics against their
history before the optimizer applies it, and warns, refuses it or rolls the weights back;
a replay (``asyncrl.stages.replay``) runs this loop on a recorded run's batches.

The buffer and generator processes are started by the launcher (``RLExperiment`` in
``asyncrl.stages.rl_config``, re-exported here); ``max_staleness=0`` is the synchronous
baseline through this same code. ``placement="colocated"`` runs this same loop with
generation inside the trainer process (``asyncrl.loop.colocated``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.buffer.client import BufferClient
from asyncrl.generator.lent import LendingSource
from asyncrl.interfaces import BatchSource, WeightPublisher
from asyncrl.liveness import LendSwitch
from asyncrl.loop.advantages import Advantages, make_advantages
from asyncrl.loop.batch import (
    add_reference_logprobs,
    frozen_policy_stats,
    length_scalars,
    mismatch_scalars,
    policy_loss,
    policy_updates,
    proximal_logprobs,
    rl_micro_batches,
)
from asyncrl.loop.colocated import ColocatedRollout
from asyncrl.loop.guard import Guard
from asyncrl.loop.reward_norm import RewardNormalizer
from asyncrl.metrics import MetricsLogger
from asyncrl.models import load_tokenizer
from asyncrl.stages.common import out_of_time, stage_clock, stage_main
from asyncrl.stages.rl_config import RLConfig, RLExperiment
from asyncrl.stages.sft import Evaluator
from asyncrl.tasks import build_task
from asyncrl.trainer.checkpoint import (
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from asyncrl.trainer.core import StepStats, TrainerCore, frozen_model
from asyncrl.trainer.dist import DistInfo, all_reduce_max
from asyncrl.trainer.probe import TrainerProbe
from asyncrl.trainer.publish import NoWeightPublisher, weight_publisher
from asyncrl.wire import Batch, Sample

__all__ = ["RLConfig", "RLExperiment", "main", "run"]


def run(cfg: RLExperiment, info: DistInfo, source: BatchSource | None = None) -> dict:
    """One trainer rank of the RL stage, to ``rl.max_steps`` versions; returns the summary.
    ``source``: batches recorded by an earlier run, in place of the buffer and the
    generators (``tools/replay.py``)."""
    r = setup(cfg, info, source)
    core, accuracy = r.core, resume_or_evaluate(r, cfg)
    initial = accuracy.get("eval/accuracy")
    # A frozen copy of the starting policy, sharded over the ranks, when the loss has a KL term.
    reference = frozen_model(cfg.model, info) if cfg.rl.loss.kl_coef else None
    temperature = max(cfg.sampling.temperature, 1e-6)
    cap = cfg.completion_cap()  # the most tokens a completion can have
    loss_fn, stop = policy_loss(cfg.rl, temperature), False
    while core.step < cfg.rl.max_steps and not stop:
        # 1. my share of this step's batch (whole groups, at most max_staleness old)
        batch, waited = take_batch(r, cfg, info)
        if batch is None:  # the time limit passed while waiting for it
            break
        samples = r.rewards.normalize(batch.samples)
        micro = rl_micro_batches(samples, cfg.rl, cap, cfg.trainer, core.pad_id)
        # 2. logprobs with the step's starting weights, no grad: the proximal policy's
        #    (None: the first update's own forward gives them) and the reference's
        proximal = proximal_logprobs(core, micro, temperature) if cfg.rl.proximal_pass else None
        if reference is not None:
            add_reference_logprobs(reference, micro, info.device, temperature)
        # 3. advantages: group-relative ones came with the batch; PPO's critic adds GAE's
        estimates = r.advantages.before_update(micro)
        # 4. the decoupled-PPO update(s); a non-finite one is skipped and changes nothing,
        #    as is one the guard refuses (rl.guard.action=skip)
        r.guard.start_step(batch.samples)
        if r.advantages.updates_policy(core.step):
            stats = policy_updates(core, micro, loss_fn, cfg.rl.update_epochs, proximal)
            stats.metrics |= mismatch_scalars(micro, stats.outputs, core.step, info.device)
        else:  # the critic's warmup: the policy keeps its weights
            stats = frozen_policy_stats(core, micro)
        guarded = r.guard.end_step()  # a warning, or the last good weights back (rollback)
        # 5. publish version v+1 to the generators and announce it to the buffer
        sync_s = r.publisher.publish(core.step + 1, core.full_parameters(core.step + 1))
        probed = r.probe.after_publish(core.model, core.step + 1) if r.probe else {}
        if info.is_main:
            r.source.announce_version(core.step + 1)
        estimates |= r.advantages.after_publish(micro)  # generators need not wait for it
        r.ledger.write(core.step, batch.samples)
        # 6. the version: once per batch, so step, batch and version stay one to one
        core.step += 1
        # 7. log, evaluate, checkpoint
        scalars = step_scalars(stats, waited, sync_s, batch.samples) | estimates | guarded | probed
        scalars |= length_scalars(batch.samples, cfg.rl, cap, info.device)  # every rank joins
        stop = out_of_time(r.start, cfg.time_limit_s, info) or reached(cfg, accuracy, info)
        last = core.step >= cfg.rl.max_steps or stop
        accuracy = log_step(r, cfg, scalars, accuracy, last)
        checkpoint_if_due(r, cfg, last)
    return finish(r, cfg, initial, accuracy)


@dataclass
class RLParts:
    """What one trainer rank of the RL loop works with (built by ``setup``)."""

    core: TrainerCore
    """The policy, sharded, with its optimizer; ``core.step`` is the version."""
    advantages: Advantages
    """Group-relative, or PPO's critic (with its own core)."""
    evaluate: Evaluator
    """Greedy held-out accuracy (on rank 0; every rank joins the gather)."""
    source: BatchSource
    """The buffer (a client of its process, or the colocated rollout)."""
    publisher: WeightPublisher
    """Rank 0's way to the generators; a no-op on the other ranks."""
    log: MetricsLogger
    ledger: Ledger
    start: float
    """When the stage's training began (Unix time), across trainer restarts."""
    ckpt_root: Path
    guard: Guard
    """Judges each step's statistics; warns, skips the update or rolls back (``rl.guard``)."""
    rewards: RewardNormalizer
    """``rl.reward_norm``: the batch's rewards, normalized by their running moments (or not)."""
    probe: TrainerProbe | None = None
    """``transport.weights.probe_text``: the check that the engines run what was published."""


def setup(cfg: RLExperiment, info: DistInfo, recorded: BatchSource | None = None) -> RLParts:
    """Build the policy core, the advantage strategy (a critic core for PPO), the
    evaluator, the batch source and weight publisher, the logger and the ledger."""
    pad_id = load_tokenizer(cfg.model.path).pad_token_id
    core = TrainerCore(cfg.model, cfg.trainer, cfg.optim, info, pad_id)
    advantages = make_advantages(cfg.rl, cfg.model, cfg.trainer, info, pad_id)
    evaluate = Evaluator(cfg, build_task(cfg.task), info)
    source: BatchSource
    publisher: WeightPublisher
    if recorded is not None:  # a replay: the batches are known, nobody gets weights
        source, publisher = recorded, NoWeightPublisher()
    elif cfg.placement == "colocated":  # one in-process object: buffer and generators
        publisher = source = ColocatedRollout(cfg.rollout(), cfg.colocated_threads(), info)
    else:
        publisher = (
            weight_publisher(cfg.site(), cfg.model.path, cfg.engine, cfg.num_generators)
            if info.is_main
            else NoWeightPublisher()
        )
        source = BufferClient(cfg.run_dir, cfg.run_id, info.rank, cfg.transport)
        if cfg.generate_while_waiting:  # the rank's cores decode while it waits
            source = LendingSource(source, cfg.rollout(), info.rank)
        elif cfg.elastic.lend_waits:  # ... while the elastic launcher's switch says so
            switch = LendSwitch(cfg.run_dir)
            source = LendingSource(source, cfg.rollout(), info.rank, switch)
    log = MetricsLogger(cfg.run_dir, "trainer", cfg.metrics, info.is_main, cfg.rl.max_steps)
    ledger = Ledger(cfg.run_dir, info.rank)
    # Logged times and time_limit_s count from the first trainer start, across restarts.
    start = log.start = stage_clock(cfg.run_dir, info)
    ckpt_root = Path(cfg.run_dir) / "checkpoints"
    guard = Guard(cfg.rl.guard, cfg.run_dir, cfg.buffer.max_staleness, core, advantages.companions)
    rewards = RewardNormalizer(cfg.rl.reward_norm, cfg.rl.reward_norm_decay, info.device)
    probe = None
    if cfg.transport.weights.probe_text and recorded is None:
        probe = TrainerProbe(cfg.site(), cfg.model.path, info, publisher.lineage)
    return RLParts(
        core,
        advantages,
        evaluate,
        source,
        publisher,
        log,
        ledger,
        start,
        ckpt_root,
        guard,
        rewards,
        probe,
    )


def resume_or_evaluate(r: RLParts, cfg: RLExperiment) -> dict:
    """Resume from the newest checkpoint (and send its weights to the generators, which
    start from ``model.path``, version 0), or evaluate the starting policy; announce the
    version to the buffer. Returns the starting evaluation ({} when resumed)."""
    core = r.core
    resume_from = latest_checkpoint(r.ckpt_root) if cfg.trainer.resume else None
    accuracy = {} if resume_from else r.evaluate(core)
    if resume_from is not None:
        stage = load_checkpoint(core, resume_from, r.advantages.companions)
        r.guard.load_state_dict(stage.get("guard", {}))
        r.rewards.load_state_dict(stage.get("reward_norm", {}))
    if accuracy:
        r.log.log(core.step, accuracy)
    if core.step > 0:
        r.publisher.publish(core.step, core.full_parameters())  # every rank gathers
    if core.info.is_main:
        # Resumed, also at 0: the buffer serves again the batches of steps this trainer
        # has yet to take, which an earlier trainer process of the run may have taken.
        r.source.announce_version(core.step, resumed=True)
    return accuracy


def take_batch(r: RLParts, cfg: RLExperiment, info: DistInfo) -> tuple[Batch | None, float]:
    """This rank's share of the step's batch, and the seconds spent waiting for it; None
    when ``time_limit_s`` passed first on any rank (all ranks stop together), so a run
    whose batches stop coming still ends at its limit. Rank 0 republishes its weights
    meanwhile: a generator that (re)joined after the last publish would otherwise decode
    with weights too stale for the buffer to accept."""
    wait = time.perf_counter()
    deadline = r.start + cfg.time_limit_s if cfg.time_limit_s > 0 else None
    batch = r.source.request_batch(
        r.core.step,
        info.world_size,
        on_wait=r.publisher.republish,
        wait_tick_s=max(1.0, 5 * cfg.transport.heartbeat_s),
        deadline=deadline,
    )
    if deadline is not None and all_reduce_max(int(batch is None), info.device):
        return None, time.perf_counter() - wait
    return batch, time.perf_counter() - wait


def step_scalars(
    stats: StepStats, waited: float, sync_s: float, samples: list[Sample]
) -> dict[str, float]:
    """The step's metrics: the update's, the waits, the batch's mean reward."""
    rewards = [s.reward for s in samples]
    return {
        "train/loss": stats.loss,
        "train/grad_norm": stats.grad_norm,
        "train/lr": stats.lr,
        "train/tokens": stats.tokens,
        "train/tokens_per_s": stats.tokens / stats.seconds if stats.seconds else 0.0,
        "train/step_s": stats.seconds,
        "train/wait_for_batch_s": waited,
        "train/weight_publish_s": sync_s,
        "rollout/reward": sum(rewards) / max(len(rewards), 1),
        **stats.metrics,
    }


def reached(cfg: RLExperiment, accuracy: dict, info: DistInfo) -> bool:
    """Whether the latest evaluation reached ``stop_at_accuracy``, agreed by all ranks (only
    rank 0 evaluates). The step after it still runs and evaluates once more as the last."""
    target = cfg.stop_at_accuracy
    hit = target > 0 and accuracy.get("eval/accuracy", 0.0) >= target
    return bool(all_reduce_max(int(hit), info.device))


def log_step(r: RLParts, cfg: RLExperiment, scalars: dict, accuracy: dict, last: bool) -> dict:
    """Evaluate when due, log the step's scalars and the progress bar; returns the latest
    evaluation."""
    step = r.core.step
    if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or last):
        accuracy = r.evaluate(r.core)
        scalars.update(accuracy)
    r.log.log(step, scalars)
    shown = {"reward": f"{scalars['rollout/reward']:.2f}"}
    r.log.progress(1, shown | {"acc": f"{accuracy.get('eval/accuracy', 0):.2f}"})
    return accuracy


def checkpoint_if_due(r: RLParts, cfg: RLExperiment, last: bool) -> None:
    """Save every ``trainer.checkpoint_every`` steps and at the end, with the companion
    cores; tell the buffer which batches it may forget."""
    every = cfg.trainer.checkpoint_every
    if (every and r.core.step % every == 0) or last:
        companions = r.advantages.companions
        stage = {"guard": r.guard.state_dict(), "reward_norm": r.rewards.state_dict()}
        save_checkpoint(r.core, r.ckpt_root, stage, cfg.trainer.keep_checkpoints, companions)
        if r.core.info.is_main:  # the buffer may forget the batches before the oldest one kept
            r.source.announce_checkpoint(oldest_checkpoint_step(r.ckpt_root))


def finish(r: RLParts, cfg: RLExperiment, initial: float | None, accuracy: dict) -> dict:
    """Export the policy, write the summary, close everything; returns the summary."""
    if cfg.rl.export_dir:
        export_hf(r.core, cfg.rl.export_dir)
    summary = {
        "steps": r.core.step,
        "train_time_s": round(time.time() - r.start, 2),
        "initial_eval_accuracy": initial,
        "final_eval_accuracy": accuracy.get("eval/accuracy"),
        "export_dir": cfg.rl.export_dir,
    }
    r.log.write_summary(summary)
    r.log.close()
    r.ledger.close()
    r.source.close()
    r.publisher.close()  # the colocated rollout is both: its second close does nothing
    if r.probe is not None:
        r.probe.close()
    return summary


def oldest_checkpoint_step(ckpt_root: Path) -> int:
    """The step of the oldest checkpoint kept (a corrupt newer one makes a restart fall
    back to it)."""
    steps = [
        int(p.name.removeprefix("step_"))
        for p in ckpt_root.glob("step_*")
        if p.is_dir() and p.suffix != ".tmp"
    ]
    return min(steps, default=0)


class Ledger:
    """``RUN_DIR/ledger/rank{r}.jsonl``: per step, the (group id, sample index) of every
    sample this rank trained on. A restarted trainer writes the steps it redoes again
    (the last line of a step wins); ``tools/chaos.py`` checks from it that no sample was
    lost or trained on twice."""

    def __init__(self, run_dir: str, rank: int) -> None:
        path = Path(run_dir) / "ledger" / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")

    def write(self, step: int, samples) -> None:
        keys = [[s.group_id, s.sample_index] for s in samples]
        self.file.write(json.dumps({"step": step, "time": time.time(), "samples": keys}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def main(argv: list[str] | None = None) -> None:
    stage_main(run, argv)


if __name__ == "__main__":
    main()
