"""The RL stage's configuration, ``RLExperiment``: everything one run needs (model, task,
trainer, buffer, sampling, rewards, transport, engine, and the loop's own ``RLConfig`` from
``asyncrl.loop.config``), with the processes the launchers start for it and the narrower
configs its parts read (``rollout()``, ``site()``). The stage is ``asyncrl.stages.rl``,
which also re-exports both classes."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import ClassVar, Literal

from asyncrl.buffer.config import BufferConfig, RolloutConfig
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.config import ConfigError, save_json
from asyncrl.elastic import ElasticConfig
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.fit import fit_context
from asyncrl.engine.leases import SamplingConfig
from asyncrl.episodes.env import check_environment
from asyncrl.evaluation import EvalConfig
from asyncrl.loop.config import RLConfig
from asyncrl.metrics import MetricsConfig
from asyncrl.models import ModelConfig
from asyncrl.stages.common import ProcessSpec, threads_for, trainer_ranks
from asyncrl.tasks import TaskConfig
from asyncrl.tasks.rewards import check_rewards
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.transport import RunSite, TransportConfig

log = logging.getLogger(__name__)


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
    stop_at_accuracy: float = 0.0
    """End the run once a held-out evaluation reaches this accuracy (0: never): studies of
    the time to a target need not spend the rest of the budget."""
    num_generators: int = 1
    """Generator processes."""
    placement: Literal["async", "colocated", "elastic"] = "async"
    """``async``: buffer, generator and trainer processes (docs/architecture.md, Processes
    and their sockets). ``colocated``: one trainer process alternates generation and
    training on the cores the async placement would use, on-policy (``buffer.max_staleness``
    becomes 0): the synchronous hybrid-engine baseline, through the same RL step.
    ``elastic``: ``async``, starting with ``num_generators``, and the launcher adds or
    drains generators while the run goes on as ``elastic`` decides."""
    generate_while_waiting: bool = False
    """``async`` or ``elastic``: while a trainer rank waits for its batch, an embedded
    engine of its own generates on its cores (generator ``lent<rank>``, gated by the wait,
    so it never computes beside the trainer; ``asyncrl.generator.lent``). Where the trainer
    waits for generation, its cores decode instead of idling."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """How ``placement=elastic`` moves generators (``asyncrl.elastic``)."""
    init_from_experiment: str = ""
    """Experiment file whose run writes ``model.path``; the launcher runs it first when
    that directory is missing (e.g. SFT before RL)."""
    reward_model_experiment: str = ""
    """Experiment file whose run writes ``reward.model_path`` (a reward-model stage); the
    launcher runs it first when that directory is missing and the reward uses the model."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to start from (generators load the same directory)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The prompts (and their verifiers) the generators sample from."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer ranks, device, micro-batching and checkpoints."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The policy's AdamW and learning-rate schedule."""
    rl: RLConfig = field(default_factory=RLConfig)
    """The algorithm, its loss and its updates per batch."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """Batch shape, staleness bound and group filters of the buffer process."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How the generators sample completions."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How completions are scored (verifier, reward model, user function)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """ZeroMQ between the processes: sockets, encryption, message limits, chunk flushing,
    heartbeats."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The generators' inference engine (embedded or remote servers)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out greedy accuracy: how often and on how many examples."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Logging: TensorBoard, progress bar, cadence."""

    entry: ClassVar[str] = "asyncrl.stages.rl"
    """Module whose ``main`` runs one trainer rank of this stage."""

    def site(self) -> RunSite:
        """Where this run's processes meet (``run_dir``, ``run_id``, ``transport``)."""
        return RunSite(self.run_dir, self.run_id, self.transport)

    def finalize(self) -> None:
        """Derived values, computed here and nowhere else: a value left unset (0 or empty)
        is filled in; one set that cannot work is refused (``ConfigError``); one that a
        placement overrides is changed with a warning that names it."""
        if not self.run_dir:
            self.run_dir = f"runs/{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        if self.rl.update_epochs < 1:
            raise ConfigError(f"rl.update_epochs must be at least 1, got {self.rl.update_epochs}")
        if self.optim.total_steps <= 0:
            self.optim.total_steps = self.rl.max_steps * self.rl.update_epochs
        if not self.rl.export_dir:
            self.rl.export_dir = str(Path(self.run_dir) / "hf")
        if not (self.eval.stop or self.eval.stop_token_ids):
            # Evaluate as the policy samples: the same stops, the same text scored.
            self.eval.stop = list(self.sampling.stop)
            self.eval.stop_token_ids = list(self.sampling.stop_token_ids)
            self.eval.keep_stop_text = self.sampling.keep_stop_text
        try:
            self.rl.loss.check()
            self.rl.guard.check()
            self.reward.check()
            self.transport.weights.check()
            # Imports the user's reward modules now, so a bad one fails before any process.
            check_rewards(self.task)
            check_environment(self.task)
            if self.placement == "elastic":
                self.elastic.check(self.num_generators, self.reward.model_servers)
                if self.engine.plan().attached:
                    raise ValueError(
                        "placement=elastic starts generators that launch their own servers; "
                        "servers attached by engine.remote.urls cannot be added to: leave "
                        "the urls empty or use placement=async"
                    )
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
            self.check_colocated()
        self.check_lending()
        self.check_probe()
        if self.task.environment:
            self.check_episodes()
        if not self.engine.plan().embedded:
            self.check_remote()

    def check_colocated(self) -> None:
        """What one process alternating generation and training cannot run; its staleness
        bound is 0 (said when the setting was otherwise)."""
        if self.trainer.num_ranks != 1:
            raise ConfigError("placement=colocated runs one process: set trainer.num_ranks=1")
        if not self.engine.plan().embedded:
            raise ConfigError(
                "placement=colocated runs the embedded engine in the trainer "
                "process: set engine.backend=embedded or placement=async"
            )
        if self.task.environment:  # checked here: placement is not the task's
            raise ConfigError(
                "placement=colocated generates single completions: a task.environment "
                "needs placement=async"
            )
        if self.reward.model_servers:
            raise ConfigError(
                "placement=colocated runs one process: reward.model_servers="
                f"{self.reward.model_servers} needs placement=async or elastic (or 0 to "
                "score in the trainer's process)"
            )
        if self.buffer.max_staleness != 0:  # step i trains only on tokens of version i
            log.warning(
                "placement=colocated generates each step's batch with that step's weights: "
                "buffer.max_staleness=%s becomes 0",
                self.buffer.max_staleness,
            )
            self.buffer.max_staleness = 0

    def check_lending(self) -> None:
        """A trainer lends its waits to an engine in its own process: an embedded one;
        always (``generate_while_waiting``) or as the elastic controller moves
        (``elastic.lend_waits``), not both."""
        lend_moves = self.elastic.lend_waits
        if lend_moves and (self.placement != "elastic" or self.generate_while_waiting):
            raise ConfigError(
                "elastic.lend_waits makes lending a move of placement=elastic, instead of "
                f"generate_while_waiting (got placement={self.placement}, "
                f"generate_while_waiting={self.generate_while_waiting})"
            )
        if (self.generate_while_waiting or lend_moves) and (
            self.placement == "colocated" or not self.engine.plan().embedded
        ):
            key = "generate_while_waiting" if self.generate_while_waiting else "elastic.lend_waits"
            raise ConfigError(
                f"{key} lends the trainer's cores to an embedded engine "
                "while it waits for a batch: it needs placement=async or elastic and "
                f"engine.backend=embedded (got placement={self.placement}, "
                f"engine.backend={self.engine.backend})"
            )

    def check_probe(self) -> None:
        """The check after a flip needs engines that can score it: embedded generators."""
        if self.transport.weights.probe_text and (
            self.placement == "colocated" or not self.engine.plan().embedded
        ):
            raise ConfigError(
                "transport.weights.probe_text: the probe is scored by generator processes "
                "with embedded engines (placement=async engine.backend=embedded)"
            )

    def check_episodes(self) -> None:
        """What a multi-turn task cannot run with: its reward is its environment's."""
        if self.reward.source != "verifier":
            raise ConfigError(
                f"reward.source={self.reward.source} with task.environment: an episode's reward "
                f"is its environment's (score with a model inside the environment instead)"
            )
        if self.rl.overlong_cache:
            raise ConfigError(
                "rl.overlong_cache shapes rewards by length near a sample's budget; an "
                "episode's length counts its observations: set it to 0 with task.environment"
            )

    def check_remote(self) -> None:
        """The remote engine's settings, and what NCCL weight updates need."""
        remote = self.engine.remote
        try:
            remote.check()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if remote.weight_update == "disk":
            return
        if remote.urls and self.num_generators > 1:
            raise ConfigError(
                f"engine.remote.weight_update={remote.weight_update} with engine.remote.urls: "
                "every generator would attach to the same servers; use num_generators=1"
            )
        if remote.weight_update != "nccl":
            return
        # The trainer also refuses at start when it finds no CUDA device (device=auto).
        if self.trainer.device == "cpu":
            raise ConfigError(
                "engine.remote.weight_update=nccl broadcasts from the trainer's GPU, "
                "and trainer.device=cpu: use engine.remote.weight_update=disk"
            )
        if remote.server == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "engine.remote.weight_update=nccl with engine.remote.server=vllm: the trainer "
                "joins vLLM's NCCL group with vLLM's own code, and vllm does not import here"
            )

    def prerequisites(self) -> list[tuple[str, str]]:
        """(path, experiment file that makes it): the starting policy, and the reward model
        when the reward uses one. The launchers run the missing ones first."""
        needs = [(self.model.path, self.init_from_experiment)]
        if self.reward.source != "verifier":
            needs.append((self.reward.model_path, self.reward_model_experiment))
        return needs

    def preflight(self) -> None:
        """What needs the starting policy, checked before any process starts: the engine's
        context sized to the task, every prompt fitting it (``asyncrl.engine.fit``)."""
        fit_context(self.task, self.model.path, self.engine, self.sampling.max_new_tokens)

    def processes(self, config_path: str) -> list[ProcessSpec]:
        """The buffer, the generators, the reward servers and the trainer ranks, each
        restarted when it dies (the trainer ranks together); only the trainer when
        colocated."""
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
        procs += [
            ProcessSpec(
                f"reward_{i}",
                "asyncrl.buffer.reward_server",
                ["--config", rollout_path, "--worker-id", f"r{i}"],
                restartable=True,
                threads=max(1, self.reward.model_threads),
            )
            for i in range(self.reward.model_servers)
        ]
        return procs + trainer_ranks(self, config_path, group="trainer")

    @property
    def run_id(self) -> str:
        """The run directory's name: every message of the run carries it."""
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

    def colocated_threads(self) -> int:
        """Threads of the colocated process: the cores the async placement spreads over its
        trainer ranks and generators, so both placements are compared on the same cores (at
        most the machine's). ``num_generators=0`` leaves the trainer's own threads: on a
        shared or busy machine, more intra-op threads than free cores slow a small model's
        kernels down several times over (measured: 2 threads on 2 busy cores, ~10x)."""
        cores = os.cpu_count() or 1
        trainer = threads_for(self.trainer.threads_per_rank, self.trainer.num_ranks)
        generators = (self.engine.threads or cores) * self.num_generators
        return max(1, min(cores, trainer * self.trainer.num_ranks + generators))

    def completion_cap(self) -> int:
        """The most tokens a sample can generate: a turn's budget, or an episode's (whose
        count includes its observations, so its model tokens stay below it)."""
        return (
            self.task.max_episode_tokens if self.task.environment else self.sampling.max_new_tokens
        )
