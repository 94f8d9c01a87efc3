"""The colocated placement: one process alternates generation and training on all its
cores, the synchronous hybrid-engine baseline (veRL style) that the asynchronous
placement is compared against.

``ColocatedRollout`` stands in, inside the trainer process, for both the buffer process
(a ``BatchSource``, like ``BufferClient``) and the generators (a ``WeightPublisher``,
like ``BucketPublisher``; both Protocols in ``asyncrl.interfaces``), so the RL step in
``asyncrl.stages.rl`` runs unchanged. It owns an ``EmbeddedEngine`` and the buffer's own
state machine (``RolloutBuffer``) with the buffer's ``Scoring``: leases, groups, dynamic
sampling, staleness accounting and rewards are the same code as in the async placement;
only the sockets and the processes are gone. ``request_batch`` decodes until the step's
batch is complete; while the trainer trains, nothing decodes and the engine has given
back its KV cache and its weights (``EmbeddedEngine.release_memory``, the hybrid-engine
pattern); ``publish`` then puts the new weights into the engine and takes the cache back
before the next rollout, so every token is on-policy (staleness 0, ``max_staleness`` is
0 here by construction).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from asyncrl.buffer.config import RolloutConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import Scoring, buffer_counters
from asyncrl.engine.base import StepOutput
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.leases import PendingLease, lease_request, record_tokens
from asyncrl.interfaces import FullParameters, SharedEngine
from asyncrl.metrics import MetricsLogger
from asyncrl.tasks import build_task
from asyncrl.tasks.stream import TaskPrompts
from asyncrl.trainer.dist import DistInfo
from asyncrl.wire import Batch, Chunk

WORKER_ID = "colocated"
"""The engine's name in the buffer's lease bookkeeping."""


@dataclass
class _Timing:
    """Wall time of the two phases, per step and over the run."""

    generate_s: float = 0.0
    train_s: float = 0.0
    load_weights_s: float = 0.0
    tokens: int = 0

    def add(self, other: _Timing) -> None:
        self.generate_s += other.generate_s
        self.train_s += other.train_s
        self.load_weights_s += other.load_weights_s
        self.tokens += other.tokens

    def scalars(self) -> dict[str, float]:
        busy = self.generate_s + self.train_s + self.load_weights_s
        return {
            "colocated/generate_s": self.generate_s,
            "colocated/train_s": self.train_s,
            "colocated/load_weights_s": self.load_weights_s,
            "colocated/generate_fraction": self.generate_s / busy if busy > 0 else 0.0,
            "colocated/generated_tokens": float(self.tokens),
            "colocated/tokens_per_s": self.tokens / self.generate_s if self.generate_s else 0.0,
        }


class ColocatedRollout:
    """A ``BatchSource`` and a ``WeightPublisher`` (``asyncrl.interfaces``) in one object,
    with no process behind it."""

    def __init__(self, rollout: RolloutConfig, threads: int, info: DistInfo) -> None:
        """``threads``: the process's, shared by both phases (the stage's
        ``RLExperiment.colocated_threads``)."""
        if info.world_size != 1:
            raise ValueError("the colocated placement runs a single trainer rank")
        self.run_id, self.run_dir, self.rank = rollout.run_id, Path(rollout.run_dir), info.rank
        self.lineage = ""  # its one engine is in this process: nothing is sent
        # Both phases share the process's threads; the engine must not pin its own count.
        torch.set_num_threads(threads)
        engine_cfg = replace(rollout.engine.embedded, threads=0, device=info.device.type)
        self.engine: SharedEngine = EmbeddedEngine(rollout.model.path, engine_cfg)
        prompts = TaskPrompts(build_task(rollout.task), rollout.model.path, rollout.seed)
        self.scoring = Scoring(rollout)
        self.buffer = RolloutBuffer(
            rollout.buffer, rollout.run_id, prompts, rollout.sampling.spec(rollout.seed)
        )
        self.pending: dict[str, PendingLease] = {}
        self.metrics = MetricsLogger(
            rollout.run_dir, WORKER_ID, replace(rollout.metrics, progress_bar=False)
        )
        self.step_timing, self.total = _Timing(), _Timing()
        self.served_at: float | None = None  # when the last batch went to the trainer
        self.closed = False

    # ---- the BatchSource ---------------------------------------------------------------
    def request_batch(
        self,
        step: int,
        world_size: int,
        timeout_s: float = 600.0,
        on_wait: Callable[[], None] | None = None,
        wait_tick_s: float = 10.0,
        deadline: float | None = None,
    ) -> Batch | None:
        """Generate until this step's batch is complete and return this rank's share.

        ``on_wait`` is accepted for ``BufferClient``'s signature and never called: the only
        engine is this one, which always has the newest weights, so there is nothing to
        republish while waiting."""
        start = time.perf_counter()
        tokens_before = self.engine.status().tokens
        while (samples := self.buffer.batches.batch_for(step, self.rank, world_size)) is None:
            leased = self._lease()
            busy = self._busy()
            if busy:
                self._record(self.engine.step())
            self.scoring.pump(self.buffer)
            if not busy and not leased:
                if not self.scoring.pending():
                    raise RuntimeError(
                        f"nothing to generate and no batch for step {step}: the buffer is at "
                        f"version {self.buffer.state.version} (was version {step} announced?)"
                    )
                time.sleep(0.001)  # rewards are being scored in worker processes
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"no batch for step {step} after {timeout_s:.0f} s")
            if deadline is not None and time.time() > deadline:
                return None
        self.served_at = time.perf_counter()
        self.step_timing.generate_s += self.served_at - start
        self.step_timing.tokens += self.engine.status().tokens - tokens_before
        if self.engine.idle:  # else sequences of a later step hold its cache
            self.engine.release_memory()  # the trainer's step gets the memory
        return Batch(run_id=self.run_id, step=step, rank=self.rank, samples=samples)

    def announce_version(self, version: int, resumed: bool = False) -> None:
        if version > 0 and self.buffer.state.prompt_position == 0:
            # Resumed from a checkpoint: go on as if the earlier steps had been served.
            self.buffer.batches.start_at(version)
        self.buffer.batches.set_version(version)

    def announce_checkpoint(self, oldest_kept_step: int) -> None:
        """Nothing to keep: this process's buffer dies with the trainer it serves."""

    # ---- the WeightPublisher -----------------------------------------------------------
    def publish(self, version: int, params: FullParameters) -> float:
        """Flip the engine to ``version`` now (it is idle while the trainer trains); the
        engine adopts copies of ``params``. Returns the seconds it took."""
        start = time.perf_counter()
        if self.served_at is not None:  # the trainer's share of this step
            self.step_timing.train_s += start - self.served_at
            self.served_at = None
        self.engine.stage_weights(params.state_dict(), version, wait=True)
        self.engine.resume_memory()
        took = time.perf_counter() - start
        self.step_timing.load_weights_s += took
        if self.step_timing.generate_s:  # not the load of a resumed checkpoint
            self.metrics.log(
                version,
                {**self.step_timing.scalars(), **buffer_counters(self.buffer, self.scoring)},
            )
            self.total.add(self.step_timing)
        self.step_timing = _Timing()
        return took

    def republish(self) -> None:
        """Nothing to send again: the only engine is this one, and it has every version."""

    def close(self) -> None:
        """Write the run's totals and the buffer counters; the RL loop closes it in both
        roles, so the second call does nothing."""
        if self.closed:
            return
        self.closed = True
        counters = buffer_counters(self.buffer, self.scoring)
        (self.run_dir / "buffer_counters.json").write_text(
            json.dumps(counters, indent=2, sort_keys=True)
        )
        summary = {k.removeprefix("colocated/"): v for k, v in self.total.scalars().items()}
        (self.run_dir / "colocated_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.metrics.close()
        self.scoring.close()
        self.engine.close()

    # ---- the engine ------------------------------------------------------------------
    def _busy(self) -> bool:
        status = self.engine.status()
        return bool(status.running or status.waiting)

    def _lease(self) -> int:
        """Fill the engine's free slots with leases; how many it took."""
        status = self.engine.status()
        free = status.free_slots - status.waiting
        leases = self.buffer.leases.lease(WORKER_ID, free, time.time()) if free > 0 else []
        for lease in leases:
            # A lease carries a prefix only when re-issued, which never happens in one
            # process (nothing expires it); handled anyway, as a generator does.
            try:
                self.engine.submit(lease_request(lease))
            except ValueError:  # a prompt the engine cannot run fails its group, as in the buffer
                self._finish(PendingLease(lease), "error")
                continue
            self.pending[lease.lease_id] = PendingLease(lease)
        return len(leases)

    def _record(self, out: StepOutput) -> None:
        # Each lease goes to the buffer as one chunk when it finishes: nobody reads a
        # trajectory while it grows here, so streaming would buy nothing.
        for p, reason in record_tokens(self.pending, out):
            self._finish(p, reason)

    def _finish(self, p: PendingLease, reason: str) -> None:
        chunk = Chunk(
            run_id=self.run_id,
            worker_id=WORKER_ID,
            lease_id=p.lease.lease_id,
            seq=0,
            token_ids=p.token_ids,
            logprobs=p.logprobs,
            versions=p.versions,
            finished=True,
            finish_reason=reason,
        )
        self.buffer.leases.on_chunk(chunk, time.time())  # queued for scoring when finished
