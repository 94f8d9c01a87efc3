"""What the buffer process and the generator processes share: the rollout config (saved
as JSON in the run directory, read by every process) and the prompt stream."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.buffer.core import BufferConfig
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.engine.embedded import EngineConfig
from asyncrl.metrics import MetricsConfig
from asyncrl.models import ModelConfig, load_tokenizer
from asyncrl.tasks import Task, TaskConfig, stream_index
from asyncrl.transport import TransportConfig
from asyncrl.wire import SamplingSpec


@dataclass
class SamplingConfig:
    max_new_tokens: int = 16
    """Tokens generated per sample at most."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = 0
    """Top-k truncation (0: off)."""

    def spec(self) -> SamplingSpec:
        return SamplingSpec(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )


@dataclass
class RolloutConfig:
    run_dir: str = "runs/rollout"
    """Run directory: endpoints, logs, metrics."""
    run_id: str = "rollout"
    """Every message carries it; messages of another run are refused."""
    seed: int = 0
    """Seed of the prompt order."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy's HF directory (generators load it; the buffer reads its tokenizer)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring in worker processes (``workers=0``: inline in the buffer)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """The generators' TensorBoard switch and logging interval (the experiment's own)."""


class TaskPrompts:
    """Prompt ``position`` of the stream (the task's ``rl_split`` examples, reshuffled every epoch),
    tokenized; a pure function of (seed, position), so a restarted buffer resumes it."""

    def __init__(self, task: Task, tokenizer_path: str, seed: int) -> None:
        self.split = task.config.rl_split
        self.examples = task.examples(self.split)
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.seed = seed

    def __call__(self, position: int) -> tuple[int, list[int]]:
        index = stream_index(self.seed, position, len(self.examples))
        return index, self.tokenizer(self.examples[index].prompt, add_special_tokens=False)[
            "input_ids"
        ]
