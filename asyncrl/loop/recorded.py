"""A finished run's batches, rebuilt from its records: the source of a replay.

An asynchronous run's batches depend on timing, but everything timing decided is in its
records: the buffer's write-ahead log (``asyncrl.buffer.wal``) holds every input the
buffer accepted, in order, and the buffer is deterministic in its inputs. ``RecordedRun``
applies the whole log, from segment 0 (``buffer.keep_wal``), to a fresh buffer and keeps
what each batch request was answered with; it is the ``BatchSource`` of the replayed
trainer (``asyncrl.stages.replay``), which publishes to nobody. ``checkpoint_weights`` and
``weight_difference`` compare the replay's weights with the run's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from asyncrl.buffer.config import RolloutConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.wal import Batched, Journal, read_events
from asyncrl.tasks import build_task
from asyncrl.tasks.stream import TaskPrompts
from asyncrl.wire import Batch, Sample


class ReplayError(RuntimeError):
    """A run that cannot be replayed, with what is missing."""


def wal_segments(run_dir: Path) -> list[Path]:
    """The run's log segments in order; raises ``ReplayError`` unless they start at 0 and
    none is missing."""
    wal_dir = run_dir / "buffer_wal"
    segments = sorted(p for p in wal_dir.glob("*.wal") if p.stem.isdigit())
    numbers = [int(p.stem) for p in segments]
    if not numbers:
        raise ReplayError(
            f"{wal_dir} holds no log: the run's buffer kept none (buffer.checkpoint_s=0, or "
            "placement=colocated, which has no buffer process)"
        )
    if numbers != list(range(len(numbers))):
        first = numbers[0] if numbers else None
        raise ReplayError(
            f"{wal_dir} holds segments {numbers[:3]}{'…' if len(numbers) > 3 else ''}, not "
            f"every one from 00000000 (first: {first}): the run kept only what a restart "
            "needs (buffer.keep_wal=false), so its batches cannot be rebuilt"
        )
    return segments


class RecordedRun:
    """The batches a run's trainer rank ``rank`` was served (all ranks': None), rebuilt
    from the buffer's log; a ``BatchSource`` that answers each request with them. A step
    served twice (a trainer restarted from a checkpoint is served its batches again)
    keeps its last answer."""

    def __init__(self, run_dir: str | Path, cfg: RolloutConfig, rank: int | None = None) -> None:
        """``cfg``: the run's own (its ``config.json``), whose buffer the log rebuilds."""
        self.run_dir, self.rank = Path(run_dir), rank
        prompts = TaskPrompts(build_task(cfg.task), cfg.model.path, cfg.seed)
        buffer = RolloutBuffer(cfg.buffer, cfg.run_id, prompts, cfg.sampling.spec(cfg.seed))
        journal = Journal(buffer)
        self.batches: dict[tuple[int, int], list[Sample]] = {}
        self.world_sizes: dict[int, int] = {}  # step -> the trainer's rank count
        for event in self._events():
            if not isinstance(event, Batched):
                journal.apply(event)
                continue
            samples = journal.batch(event.step, event.rank, event.world_size)
            if samples is not None and rank in (None, event.rank):
                self.batches[(event.step, event.rank)] = samples
                self.world_sizes[event.step] = event.world_size
        self.run_id = cfg.run_id

    def _events(self) -> Iterator:
        for segment in wal_segments(self.run_dir):
            yield from read_events(segment.read_bytes())

    @property
    def steps(self) -> int:
        """How many steps the run trained (the last one served, plus one)."""
        return 1 + max((step for step, _ in self.batches), default=-1)

    def samples(self) -> Iterator[tuple[int, Sample]]:
        """Every trained sample with its step, in step order."""
        for (step, _), samples in sorted(self.batches.items(), key=lambda kv: kv[0]):
            for s in samples:
                yield step, s

    # ---- BatchSource -------------------------------------------------------------
    def request_batch(
        self, step: int, world_size: int, timeout_s: float = 0.0, **_
    ) -> Batch | None:
        samples = self.batches.get((step, self.rank))
        if samples is None:
            raise ReplayError(f"the log served step {step} to rank {self.rank} no batch")
        if self.world_sizes[step] != world_size:
            raise ReplayError(
                f"step {step} was trained by {self.world_sizes[step]} ranks, the replay has "
                f"{world_size}: replay with trainer.num_ranks={self.world_sizes[step]}"
            )
        return Batch(run_id=self.run_id, step=step, rank=self.rank, samples=samples)

    def announce_version(self, version: int, resumed: bool = False) -> None:
        pass

    def announce_checkpoint(self, oldest_kept_step: int) -> None:
        pass

    def close(self) -> None:
        pass


def checkpoint_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's full tensors in a trainer checkpoint directory (``step_N``), by the
    model's own parameter names; read without a process group."""
    reader = dcp.FileSystemReader(str(path))
    entries = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


def weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a − b| over every tensor; ``inf`` when names or shapes differ."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a), default=0.0)
