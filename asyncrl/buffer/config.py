"""The buffer's settings (``experiment.buffer.*``): batch shape, the staleness bound,
lease and heartbeat timeouts, filters, and how the buffer process saves its state; and
``RolloutConfig``, what the buffer process and the generators are started with (saved
as JSON in the run directory, read by every one of them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from asyncrl.buffer.rewards import RewardConfig
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.leases import SamplingConfig
from asyncrl.metrics import MetricsConfig
from asyncrl.models import ModelConfig
from asyncrl.tasks import TaskConfig, build_task
from asyncrl.tasks.stream import TaskPrompts
from asyncrl.transport import RunSite, TransportConfig


@dataclass
class BufferConfig:
    RENAMED: ClassVar[dict[str, str]] = {"lease_timeout_s": "progress_timeout_s"}
    """Keys that are gone, each with the one that took its place (an override of an old key
    is refused with the new one named, not silently ignored)."""

    prompts_per_batch: int = 16
    """B: prompts (groups) per trainer step."""
    samples_per_prompt: int = 4
    """n: samples per prompt (the GRPO group size)."""
    max_staleness: int | None = 2
    """η: how many versions older than the consuming step a token may be; None: unbounded."""
    stale_policy: Literal["wait", "drop"] = "wait"
    """What the trainer does about a group still generating that would be too stale for
    the next step: ``wait`` holds the step until it finishes (long samples, which finish
    last, are trained on, not dropped); ``drop`` goes on without it, and it is dropped for
    staleness when it finishes and its prompt leased again."""
    heartbeat_timeout_s: float = 10.0
    """A generator silent this long is presumed dead and its leases are re-issued."""
    progress_timeout_s: float = 300.0
    """A lease whose holder is alive but has sent no new chunk for it this long (counted
    from its issue, then from its latest chunk) is taken back, its holder told to abort
    it, and re-issued. A lease is never taken back for its total length: a healthy
    generation sends a chunk every ``transport.chunk_ms``, however many minutes it runs.
    The wait before a lease's first token (its prefill, a queue in the holder's engine, a
    weight update) counts against this, so it must exceed the longest such wait; 300 s
    is minutes above that on CPU and wastes at most five minutes of a stuck sample."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no learning signal) and lease more prompts."""
    max_filtered_batches: int = 16
    """Dynamic sampling's bound on one step's wait (DAPO's ``max_num_gen_batches``): once
    it has dropped this many batches' worth of groups (× ``prompts_per_batch``) since the
    last batch, while fewer than a batch are ready, the uniform groups are kept until the
    next batch: the step trains on them (zero advantage under GRPO) instead of waiting
    without bound. Counted in ``buffer/groups_kept_uniform``. 16 sits above what
    ``make demo`` drops late in its run (at most 14.5 batches' worth per step), so a
    healthy run never reaches it. 0: no bound."""
    skip_uniform: float = 0.0
    """p of pre-rollout filtering (GRESO): a prompt whose last z groups each had equal
    rewards is skipped in the prompt stream with probability 1 − (1 − p)^z, before any
    token is generated for it; a group with a spread of rewards resets z. Dynamic sampling
    drops such groups after paying for their tokens. 0 is off (docs/results.md has its
    measured effect on tiny_grpo)."""
    skip_uniform_min_reward: float | None = None
    """Only a uniform group whose reward is at least this counts toward the streak: 1.0
    with a 0/1 verifier skips solved prompts only, and keeps leasing the unsolved ones
    for when the policy gets to them. None: every uniform group counts."""
    checkpoint_s: float = 30.0
    """The buffer process saves its state this often (and at exit); between saves it
    appends what it accepts to a write-ahead log, so a restart loses nothing. 0 disables
    both."""
    keep_wal: bool = True
    """Keep every segment of the write-ahead log, from the run's first input on:
    ``tools/replay.py`` rebuilds from them the exact batches the trainer took. About 20
    bytes per generated token (its id, behavior logprob and version, framed). False: a
    segment is deleted once a saved state covers it (a restart needs no more)."""
    wal_fsync: bool = False
    """fsync the write-ahead log at every flush: survives the machine dying, not only the
    process, at the cost of a disk sync per loop turn that accepted something."""
    gap_timeout_s: float = 5.0
    """A lease whose chunks stay out of order this long (one was lost, e.g. in a buffer
    crash) is re-issued from the tokens assembled before the gap."""
    replay_steps: int = 200
    """Batches served to the trainer are kept (at most this many steps) until a trainer
    checkpoint covers them, so a trainer restarted from that checkpoint gets the same
    batches again instead of fresh ones."""


@dataclass
class RolloutConfig:
    run_dir: str = "runs/rollout"
    """Run directory: endpoints, logs, metrics."""
    run_id: str = "rollout"
    """Every message carries it; messages of another run are refused."""
    seed: int = 0
    """Seed of the prompt order and of every sample's draws (each sample's seed is derived
    from it, its group and its index; ``asyncrl.seeds``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy's HF directory (generators load it; the buffer reads its tokenizer)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring in worker processes (``workers=0``: inline in the buffer)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The generators' engine: ``backend`` and each backend's settings."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """The generators' TensorBoard switch and logging interval (the experiment's own)."""

    def prompt_source(self) -> Callable[[int], tuple[int, list[int]]]:
        """The buffer's prompts (``asyncrl.buffer.groups.PromptSource``): the task's
        stream, rendered with the policy's tokenizer."""
        return TaskPrompts(build_task(self.task), self.model.path, self.seed)

    def site(self) -> RunSite:
        """Where this run's processes meet (``run_dir``, ``run_id``, ``transport``)."""
        return RunSite(self.run_dir, self.run_id, self.transport)
