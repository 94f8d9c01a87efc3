"""Replaying a finished asynchronous run (``tools/replay.py``): its trainer again, on
exactly the batches it trained on, and its samples again, from their versions' weights.

An asynchronous run's batches depend on timing, but everything timing decided is in its
records: the buffer's write-ahead log (``asyncrl.buffer.wal``) holds every input the
buffer accepted, in order, and the buffer is deterministic in its inputs. ``RecordedRun``
applies the whole log, from segment 0 (``buffer.keep_wal``), to a fresh buffer and keeps
what each batch request was answered with; it is the ``BatchSource`` of the replayed
trainer (``asyncrl.stages.rl.run``), which publishes to nobody. On the same machine and
thread count the trainer's arithmetic is the same, so its weights come out bit for bit.

``regenerate`` decodes recorded samples again with the weights of the version that
sampled them (the starting model, or a checkpoint of that step), each with its own seed
(``asyncrl.seeds``), and compares the tokens.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.wal import Batched, Journal, read_events
from asyncrl.config import load_json
from asyncrl.engine.base import Request
from asyncrl.engine.leases import sampling_params
from asyncrl.seeds import derive_seed
from asyncrl.stages.common import stage_main
from asyncrl.stages.rl import run
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

    def __init__(self, run_dir: str | Path, rank: int | None = None) -> None:
        self.run_dir, self.rank = Path(run_dir), rank
        cfg = load_json(self.run_dir / "config.json").rollout()
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


@dataclass
class Regenerated:
    checked: int = 0
    equal: int = 0
    mismatches: list[str] = field(default_factory=list)
    """The first few samples whose tokens differ (group, index, version)."""
    versions: dict[int, int] = field(default_factory=dict)
    """Samples decoded again, by version."""


def single_version(sample: Sample) -> tuple[int, int] | None:
    """(prompt length, version) of a single-turn sample whose tokens one version sampled."""
    generated = [i for i, v in enumerate(sample.versions) if v >= 0]
    if not generated or generated != list(range(generated[0], len(sample.versions))):
        return None
    versions = {sample.versions[i] for i in generated}
    return (generated[0], versions.pop()) if len(versions) == 1 else None


def regenerate(
    run_dir: Path, samples: list[Sample], weights: dict[int, Path | None], limit: int
) -> Regenerated:
    """Decode up to ``limit`` recorded single-version samples again (spread over the
    versions), each with its own seed and its version's weights: ``weights[version]``, a
    checkpoint directory, or None for the starting model (versions not in it were not
    kept); counts those whose tokens all match."""
    from asyncrl.engine.embedded import EmbeddedEngine  # the tool's side only
    from asyncrl.evaluation import decode_all

    cfg = load_json(run_dir / "config.json")
    why_not = not_regenerable(cfg)
    if why_not:
        print(f"[replay] samples not decoded again: {why_not}")
        return Regenerated()
    by_version: dict[int, list[tuple[int, Sample]]] = {}
    for s in samples:
        found = single_version(s)
        if found is not None:
            by_version.setdefault(found[1], []).append((found[0], s))
    out = Regenerated()
    engine = EmbeddedEngine(cfg.model.path, cfg.engine.embedded)
    spec = cfg.sampling.spec(cfg.seed)
    kept = [v for v in sorted(by_version) if v in weights]
    try:
        for n, version in enumerate(kept):
            if weights[version] is not None:  # None: the starting model, already loaded
                engine.stage_weights(checkpoint_weights(weights[version]), version, wait=True)
            share = (limit - out.checked) // (len(kept) - n)  # spread over the versions kept
            todo = by_version[version][:share]
            requests = []
            for k, (start, s) in enumerate(todo):
                seed = derive_seed(cfg.seed, s.group_id, s.sample_index)
                if cfg.engine.backend == "remote":  # the front's, keyed by the attempt
                    seed = derive_seed(seed, start)
                params = sampling_params(spec, spec.max_new_tokens, seed)
                requests.append(Request(str(k), s.token_ids[:start], params))
            produced, _ = decode_all(engine, requests)
            for (start, s), tokens in zip(todo, produced):
                out.checked += 1
                out.versions[version] = out.versions.get(version, 0) + 1
                if tokens == s.token_ids[start:]:
                    out.equal += 1
                elif len(out.mismatches) < 5:
                    out.mismatches.append(f"group {s.group_id} sample {s.sample_index} v{version}")
    finally:
        engine.close()
    return out


def not_regenerable(cfg) -> str:
    """Why the run's samples cannot be decoded again by the embedded engine, or ""."""
    if not cfg.sampling.seeded:
        return "the run sampled unseeded (sampling.seeded=false)"
    if cfg.task.environment:
        return "episodes: their turns' budgets and observations are the environment's"
    remote = cfg.engine.remote
    if cfg.engine.backend == "remote" and remote.server != "embedded":
        return f"the run sampled on {remote.server} servers, with their own sampler"
    return ""


def main(argv: list[str] | None = None) -> None:
    """One trainer rank of a replay: ``--config`` the replay's, ``--source`` the run."""
    parser = argparse.ArgumentParser(description="Replay a run's trainer on its batches.")
    parser.add_argument("--source", required=True, help="the recorded run's directory")
    args, rest = parser.parse_known_args(argv)
    stage_main(lambda cfg, info: run(cfg, info, RecordedRun(args.source, info.rank)), rest)


if __name__ == "__main__":
    main()
