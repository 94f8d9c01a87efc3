"""Online RL, the asynchronous core (DESIGN §4–§6): the trainer ranks' side.

Each rank asks the buffer for its share of step i's batch (whole groups, staleness
checked), turns group rewards into advantages, recomputes proximal logprobs with the
weights at the start of the step, takes a decoupled-PPO step on the FSDP2 core (one
optimizer update, or ``rl.update_epochs`` over the same batch), and rank 0 publishes the
new weights as version i+1 (raw ZeroMQ frames to every generator) and announces the
version to the buffer (``engine.backend="remote"``: as a versioned HF directory the
generators' servers load, or over NCCL; ``asyncrl.trainer.publish``). The buffer and
generator processes are started by the launcher from ``rollout()``; ``max_staleness=0``
is the synchronous baseline through this same code. ``placement="colocated"`` runs this
same step with generation inside the trainer process, between steps
(``asyncrl.stages.colocated``). With ``algorithm="ppo"`` a critic on the same ranks
(``asyncrl.stages.critic``) turns each trajectory's reward into GAE advantages and takes
its value step after the publish.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import ClassVar, Literal

from asyncrl.algorithms.losses import PPOLossConfig
from asyncrl.buffer.client import BufferClient
from asyncrl.buffer.core import BufferConfig
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.config import ConfigError, save_json
from asyncrl.engine.embedded import EngineConfig
from asyncrl.evaluation import EvalConfig
from asyncrl.metrics import MetricsConfig, MetricsLogger
from asyncrl.models import ModelConfig, load_model, load_tokenizer
from asyncrl.rollout import RolloutConfig, SamplingConfig
from asyncrl.stages.colocated import ColocatedRollout
from asyncrl.stages.common import (
    ProcessSpec,
    out_of_time,
    stage_clock,
    stage_main,
    trainer_ranks,
)
from asyncrl.stages.critic import Critic, CriticConfig
from asyncrl.stages.rl_batch import (
    group_sizes,
    penalize_kl_in_rewards,
    policy_loss,
    policy_updates,
    recompute_logprobs,
    to_sequences,
)
from asyncrl.stages.sft import Evaluator
from asyncrl.tasks import TaskConfig, build_task
from asyncrl.trainer.checkpoint import (
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import StepStats, TrainerCore
from asyncrl.trainer.dist import DistInfo, all_reduce_sum
from asyncrl.trainer.packing import make_micro_batches
from asyncrl.trainer.publish import weight_publisher
from asyncrl.transport import TransportConfig


@dataclass
class RLConfig:
    algorithm: Literal["grpo", "dr_grpo", "rloo", "ppo"] = "grpo"
    """Advantage estimator: GRPO, Dr.GRPO (no std scaling), RLOO, or PPO with a critic
    (GAE over token values, see ``critic``)."""
    max_steps: int = 100
    """Optimizer steps (= published versions) of the run."""
    overlong_cache: int = 0
    """DAPO overlong shaping over this many tokens before ``max_new_tokens`` (0: off)."""
    export_dir: str = ""
    """Write the final policy as an HF directory here; empty means ``RUN_DIR/hf``."""
    loss: PPOLossConfig = field(default_factory=PPOLossConfig)
    proximal_pass: bool = False
    """Compute the proximal logprobs in a separate no-grad forward before the step. Off,
    they are the step's own forward's logprobs, detached: with one update per batch both
    forwards see the same weights and give the same values (a test checks loss and
    gradients), and the separate pass only costs a forward over the batch. With
    ``update_epochs > 1`` the first update's are kept for the later ones."""
    update_epochs: int = 1
    """Optimizer updates per batch, each over the whole batch (PPO's epochs, GRPO's μ),
    all against the proximal policy of the step's start; the version still advances once
    per batch. The learning-rate schedule counts updates (``optim.total_steps`` defaults
    to ``max_steps × update_epochs``)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model, GAE and the value loss; used when ``algorithm`` is ``ppo``."""


@dataclass
class RLExperiment:
    name: str = "rl"
    """Experiment name; names the default run directory."""
    run_dir: str = ""
    """Run directory; empty means ``runs/NAME-TIME``."""
    seed: int = 0
    """Seed of everything random in the run."""
    time_limit_s: float = 0.0
    """End the run after this many seconds of training (0: no limit)."""
    num_generators: int = 1
    """Generator processes."""
    placement: Literal["async", "colocated"] = "async"
    """``async``: buffer, generator and trainer processes (DESIGN §2). ``colocated``: one
    trainer process alternates generation and training on the cores the async placement
    would use, on-policy (``buffer.max_staleness`` becomes 0): the synchronous
    hybrid-engine baseline, through the same RL step."""
    init_from_experiment: str = ""
    """Experiment file whose run writes ``model.path``; the launcher runs it first when
    that directory is missing (e.g. SFT before RL)."""
    reward_model_experiment: str = ""
    """Experiment file whose run writes ``reward.model_path`` (a reward-model stage); the
    launcher runs it first when that directory is missing and the reward uses the model."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to start from (generators load the same directory)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    entry: ClassVar[str] = "asyncrl.stages.rl"

    def finalize(self) -> None:
        """Derived values, computed here and nowhere else."""
        if not self.run_dir:
            self.run_dir = f"runs/{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        if self.rl.update_epochs < 1:
            raise ConfigError(f"rl.update_epochs must be at least 1, got {self.rl.update_epochs}")
        if self.optim.total_steps <= 0:
            self.optim.total_steps = self.rl.max_steps * self.rl.update_epochs
        if not self.rl.export_dir:
            self.rl.export_dir = str(Path(self.run_dir) / "hf")
        try:
            self.reward.check()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.rl.loss.kl_in_reward and self.rl.algorithm != "ppo":
            raise ConfigError(
                f"rl.loss.kl_in_reward puts the KL penalty in PPO's token rewards; "
                f"rl.algorithm={self.rl.algorithm} sees one reward per sample: set "
                f"rl.algorithm=ppo or rl.loss.kl_in_reward=false (KL in the loss)"
            )
        if self.trainer.share_prefix and (
            self.rl.algorithm == "ppo" or self.trainer.packing != "packed"
        ):
            raise ConfigError(
                f"trainer.share_prefix lays out GRPO/RLOO groups as trees over their prompt: "
                f"it needs trainer.packing=packed (got {self.trainer.packing}) and no critic "
                f"(rl.algorithm={self.rl.algorithm}; PPO's GAE reads flat rows)"
            )
        if self.placement == "colocated":
            if self.trainer.num_ranks != 1:
                raise ConfigError("placement=colocated runs one process: set trainer.num_ranks=1")
            if self.engine.backend != "embedded":
                raise ConfigError(
                    "placement=colocated runs the embedded engine in the trainer "
                    "process: set engine.backend=embedded or placement=async"
                )
            self.buffer.max_staleness = 0  # step i trains only on tokens of version i
        if self.engine.backend == "remote":
            self.check_remote()

    def check_remote(self) -> None:
        """The remote engine's settings, and what NCCL weight updates need."""
        remote = self.engine.remote
        try:
            remote.check()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if remote.weight_update != "nccl":
            return
        # The trainer also refuses at start when it finds no CUDA device (device=auto).
        if self.trainer.device == "cpu":
            raise ConfigError(
                "engine.remote.weight_update=nccl broadcasts from the trainer's GPU, "
                "and trainer.device=cpu: use engine.remote.weight_update=disk"
            )
        if remote.urls and self.num_generators > 1:
            raise ConfigError(
                "engine.remote.weight_update=nccl with engine.remote.urls: every "
                "generator would attach to the same servers; use num_generators=1"
            )

    def prerequisites(self) -> list[tuple[str, str]]:
        """(path, experiment file that makes it): the starting policy, and the reward model
        when the reward uses one. The launchers run the missing ones first."""
        needs = [(self.model.path, self.init_from_experiment)]
        if self.reward.source != "verifier":
            needs.append((self.reward.model_path, self.reward_model_experiment))
        return needs

    def processes(self, config_path: str) -> list[ProcessSpec]:
        """The buffer, the generators and the trainer ranks, each restarted when it dies
        (the trainer ranks together); only the trainer when colocated."""
        if self.placement == "colocated":
            return trainer_ranks(self, config_path)
        rollout_path = str(Path(config_path).with_name("rollout.json"))
        save_json(self.rollout(), rollout_path)
        threads = max(1, self.engine.threads)
        # The buffer and the trainer ranks come back from their saved state when they die.
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
                "asyncrl.generator.worker",
                ["--config", rollout_path, "--worker-id", f"g{i}"],
                restartable=True,
                threads=threads,
            )
            for i in range(self.num_generators)
        ]
        return procs + trainer_ranks(self, config_path, group="trainer")

    @property
    def run_id(self) -> str:
        return Path(self.run_dir).name

    def rollout(self) -> RolloutConfig:
        """The config the buffer and generator processes read."""
        return RolloutConfig(
            run_dir=self.run_dir,
            run_id=self.run_id,
            seed=self.seed,
            model=self.model,
            task=self.task,
            buffer=self.buffer,
            sampling=self.sampling,
            reward=self.reward,
            transport=self.transport,
            engine=self.engine,
            metrics=self.metrics,
        )


def run(cfg: RLExperiment, info: DistInfo) -> dict:
    tokenizer = load_tokenizer(cfg.model.path)
    core = TrainerCore(cfg.model, cfg.trainer, cfg.optim, info, tokenizer.pad_token_id)
    critic = (
        Critic(
            cfg.rl.critic, cfg.model, cfg.trainer, info, tokenizer.pad_token_id, cfg.rl.max_steps
        )
        if cfg.rl.algorithm == "ppo"
        else None
    )
    companions = {"critic": critic.core} if critic is not None else {}
    evaluate = Evaluator(cfg, build_task(cfg.task), info)
    if cfg.placement == "colocated":  # one in-process object stands in for buffer and generators
        publisher = client = ColocatedRollout(cfg, info)
    else:
        publisher = weight_publisher(cfg) if info.is_main else None
        client = BufferClient(cfg.run_dir, cfg.run_id, info.rank, cfg.transport)
    log = MetricsLogger(cfg.run_dir, "trainer", cfg.metrics, info.is_main, cfg.rl.max_steps)
    ledger = Ledger(cfg.run_dir, info.rank)
    # Logged times and time_limit_s count from the first trainer start, across restarts.
    start = log.start = stage_clock(cfg.run_dir, info)
    ckpt_root = Path(cfg.run_dir) / "checkpoints"
    accuracy = resume_or_evaluate(
        core, companions, ckpt_root, cfg, evaluate, publisher, client, log
    )
    initial, temperature = accuracy.get("eval/accuracy"), max(cfg.sampling.temperature, 1e-6)
    # A frozen, unsharded copy of the starting policy on every rank when the loss has a KL term.
    reference = load_model(cfg.model, info.device).eval() if cfg.rl.loss.kl_coef else None
    loss_fn, republish = policy_loss(cfg, temperature), getattr(publisher, "republish", None)
    stop = False
    while core.step < cfg.rl.max_steps and not stop:
        # 1. my share of this step's batch (whole groups, at most max_staleness old)
        wait = time.perf_counter()
        batch = client.request_batch(
            core.step,
            info.world_size,
            on_wait=republish,
            wait_tick_s=max(1.0, 5 * cfg.transport.heartbeat_s),
        )
        waited = time.perf_counter() - wait
        micro = make_micro_batches(
            to_sequences(batch.samples, cfg),
            cfg.trainer.micro_batch_tokens,
            cfg.trainer.packing,
            tokenizer.pad_token_id,
            cfg.trainer.row_tokens,
            group_sizes(batch.samples),
            cfg.trainer.share_prefix,
        )
        # 2. proximal logprobs: the weights at the start of this step, no grad (by default
        #    taken detached from the step's own forward, which has those weights)
        recompute_logprobs(core, micro, reference, temperature, cfg.rl.proximal_pass)
        # 3. PPO with a critic: values before any update, then GAE advantages (of the
        #    rewards less the KL penalty, when it goes in the reward)
        critic_scalars = {}
        if critic is not None:
            if cfg.rl.loss.kl_in_reward and reference is not None:
                penalize_kl_in_rewards(micro, cfg.rl.loss)
            critic_scalars = critic.advantages(critic.values(micro))
        # 4. the decoupled-PPO update(s) (a non-finite one changes nothing, yet the batch
        #    takes its version, so step, batch and version stay one to one)
        if critic is not None and core.step < cfg.rl.critic.warmup_steps:
            stats = critic_warmup_step(core, micro)  # the policy keeps its weights
        else:
            stats = policy_updates(core, micro, loss_fn, cfg.rl.update_epochs)
        # 5. publish version v+1 to the generators and announce it to the buffer
        state = core.full_state_dict()
        sync_s = publisher.publish(core.step, state) if publisher is not None else 0.0
        if info.is_main:
            client.announce_version(core.step)
        if critic is not None:  # after publishing, so generators need not wait for it
            critic_scalars |= critic.train(micro)
        ledger.write(core.step - 1, batch.samples)
        rewards = [s.reward for s in batch.samples]
        scalars = {
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
            **critic_scalars,
        }
        stop = out_of_time(start, cfg.time_limit_s, info)
        last = core.step >= cfg.rl.max_steps or stop
        if cfg.eval.every_steps and (core.step % cfg.eval.every_steps == 0 or last):
            accuracy = evaluate(core)
            scalars.update(accuracy)
        log.log(core.step, scalars)
        log.progress(
            1,
            {
                "reward": f"{scalars['rollout/reward']:.2f}",
                "acc": f"{accuracy.get('eval/accuracy', 0):.2f}",
            },
        )
        every = cfg.trainer.checkpoint_every
        if (every and core.step % every == 0) or last:
            save_checkpoint(core, ckpt_root, {}, cfg.trainer.keep_checkpoints, companions)
            if info.is_main:  # the buffer may forget the batches before the oldest one kept
                client.announce_checkpoint(oldest_checkpoint_step(ckpt_root))
    if cfg.rl.export_dir:
        export_hf(core, cfg.rl.export_dir)
    summary = {
        "steps": core.step,
        "train_time_s": round(time.time() - start, 2),
        "initial_eval_accuracy": initial,
        "final_eval_accuracy": accuracy.get("eval/accuracy"),
        "export_dir": cfg.rl.export_dir,
    }
    log.write_summary(summary)
    log.close()
    ledger.close()
    client.close()
    if publisher is not None:
        publisher.close()
    return summary


def critic_warmup_step(core: TrainerCore, micro: list) -> StepStats:
    """A step of the critic's warmup for the policy: no forward, no optimizer step, the
    version advances (so steps, batches and versions stay one to one)."""
    tokens = all_reduce_sum([float(sum(mb.num_tokens for mb in micro))], core.info.device)[0]
    core.step += 1
    lr = core.scheduler.get_last_lr()[0]
    return StepStats(
        loss=0.0, grad_norm=0.0, lr=lr, tokens=int(tokens), seconds=0.0, skipped=False, metrics={}
    )


def resume_or_evaluate(core, companions, ckpt_root, cfg, evaluate, publisher, client, log) -> dict:
    """Resume from the newest checkpoint (and send its weights to the generators, which
    start from ``model.path``, version 0), or evaluate the starting policy; announce the
    version to the buffer. Returns the starting evaluation ({} when resumed)."""
    resume_from = latest_checkpoint(ckpt_root) if cfg.trainer.resume else None
    accuracy = {} if resume_from else evaluate(core)
    if resume_from is not None:
        load_checkpoint(core, resume_from, companions)
    if accuracy:
        log.log(core.step, accuracy)
    if core.step > 0:
        state = core.full_state_dict()  # collective: every rank gathers
        if publisher is not None:
            publisher.publish(core.step, state)
    if core.info.is_main:
        # Resumed, also at 0: the buffer serves again the batches of steps this trainer
        # has yet to take, which an earlier trainer process of the run may have taken.
        client.announce_version(core.step, resumed=True)
    return accuracy


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
