"""The simulated processes on one event loop: generators, the buffer's server loop, the
trainer, and the colocated process.

Time only moves by popping the earliest event off a heap (no sleeping, no threads); ties
break by insertion order, so a run is a pure function of its config, params and seed.

- ``Generator`` mirrors ``GeneratorWorker.run``: each loop turn asks for leases when it has
  free slots and no request out, takes a grant that has arrived, and steps the engine when
  it has work; with none it idles until a grant arrives, or the weights a held lease
  needs (``min_version``). An engine step first flips to the newest staged weights
  (re-prefilling the running batch under ``recompute``), admits waiting requests whose
  weights are in, up to the free slots and the prefill budget, and gives every running
  sequence one token of the current version. Step time = (fixed + per sequence · b +
  per prompt token prefilled + flip cost) / thread speed-up · contention.
- ``BufferServer`` parks lease requests until the gate admits something, and the trainer's
  batch request until B fresh groups are ready, as ``asyncrl.buffer.server`` does.
- ``Trainer`` runs a step as phases: wait for the batch → prep (packing + proximal
  logprobs) → train → publish (weights staged at each generator ``weight_sync_s`` later;
  version announced to the buffer) → post (evaluation every ``eval_every`` steps).
- ``Simulation`` wires them for a placement: generators, a buffer server and a trainer
  (async), or one generator that leases straight from the buffer and the trainer's phases
  in one process, never both at once (colocated).

Why one file: the simulated processes share one event loop and one CPU model, and each
mirrors a real process's loop; they are read side by side to check that the simulation makes
the same decisions as the code it models.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict, deque
from collections.abc import Callable

from asyncrl.sim.buffer import SimBuffer, SimGroup, SimSample
from asyncrl.sim.model import (
    SimConfig,
    SimParams,
    colocated_threads,
    generator_threads,
    speedup,
)

SLICE_S = 0.05
"""Long phases advance in slices this long, so contention is re-read as others start/stop."""


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._order = itertools.count()

    def after(self, delay: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (self.now + delay, next(self._order), fn, args))

    def run(self, until: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Handle events up to ``until`` (the clock then reads ``until``), or until ``stop()``."""
        while self._heap and self._heap[0][0] <= until:
            if stop():
                return
            self.now, _, fn, args = heapq.heappop(self._heap)
            fn(*args)
        if not stop():
            self.now = until


class Cpu:
    """Proportional sharing: with T threads busy on C cores, each runs max(1, T/C) slower."""

    def __init__(self, cores: int) -> None:
        self.cores, self.busy = cores, 0

    def slowdown(self) -> float:
        return max(1.0, self.busy / self.cores)


def run_work(loop: EventLoop, cpu: Cpu, threads: int, work_s: float, done: Callable) -> None:
    """Busy ``threads`` threads for ``work_s`` uncontended seconds, then call ``done``."""
    cpu.busy += threads

    def slice_(left: float) -> None:
        chunk = min(left, SLICE_S)
        if left <= 0:
            cpu.busy -= threads
            done()
            return
        loop.after(chunk * cpu.slowdown(), slice_, left - chunk)

    slice_(work_s)


class Generator:
    def __init__(self, name: str, sim: Simulation, threads: int, direct: bool = False) -> None:
        self.name, self.sim, self.direct = name, sim, direct
        self.cfg, self.params = sim.cfg, sim.params
        self.threads = min(threads, sim.cfg.cores)
        self.speed = speedup(self.threads, self.params.gen_parallel_fraction)
        # ``replicas`` identical engines stepping in lockstep, as one engine with all their
        # slots whose step costs what one replica's share costs (large sweeps only).
        self.replicas = max(1, sim.cfg.engine_replicas)
        self.slots = sim.cfg.engine_slots * self.replicas
        self.version = 0
        self.staged: deque[tuple[float, int]] = deque()  # (ready at, version)
        self.waiting: deque[SimSample] = deque()
        self.inbox: list[SimSample] | None = None
        self.asked = self.idle = False
        self.after_step: Callable[[], None] = self.turn
        # running sequences, kept as sums so a step costs O(admitted + finished)
        self.running = self.step_no = 0
        self.finish_at: dict[int, list[SimSample]] = defaultdict(list)
        self.running_prompt_tokens = self.running_admit_steps = 0
        self.busy_s = self.batch_s = 0.0  # seconds stepping; Σ batch · seconds
        self.tokens = self.steps = self.flips = 0

    # ---- the worker's loop ---------------------------------------------------------
    def turn(self) -> None:
        free = self.slots - self.running - len(self.waiting)
        if self.direct:  # colocated: lease straight from the buffer, no round trip
            if free > 0:
                self.waiting.extend(self.sim.buffer.lease(free))
        else:
            if free > 0 and not self.asked:
                self.asked = True
                self.sim.loop.after(
                    self.params.message_s, self.sim.server.lease_request, self, free
                )
            if self.inbox is not None:
                self.waiting.extend(self.inbox)
                self.inbox, self.asked = None, False
        if self.running or (self.waiting and self.waiting[0].min_version <= self._next_version()):
            self._step()
        else:
            self.idle = True  # a grant wakes it, or weights its held leases wait for
            now = self.sim.loop.now
            coming = [at for at, _ in self.staged if at > now]
            if self.waiting and coming:
                self.sim.loop.after(min(coming) - now, self.wake)

    def deliver(self, leases: list[SimSample]) -> None:
        self.inbox = leases
        self.wake()

    def wake(self) -> None:
        if self.idle:
            self.idle = False
            self.turn()

    def offer_weights(self, ready_at: float, version: int) -> None:
        self.staged.append((ready_at, version))
        if self.idle and self.waiting:
            self.sim.loop.after(ready_at - self.sim.loop.now, self.wake)

    def _next_version(self) -> int:
        """The weights the next step runs under: the newest staged by now, flipped in."""
        now = self.sim.loop.now
        return max([self.version] + [v for at, v in self.staged if at <= now])

    # ---- the engine ----------------------------------------------------------------
    def _step(self) -> None:
        p, now = self.params, self.sim.loop.now
        fixed, shared = p.decode_fixed_s, 0.0  # per replica / split across replicas
        flipped = None
        while self.staged and self.staged[0][0] <= now:
            flipped = self.staged.popleft()[1]
        if flipped is not None and flipped > self.version:
            self.version, self.flips = flipped, self.flips + 1
            fixed += p.flip_fixed_s
            if self.cfg.flip_policy == "recompute":
                shared += p.recompute_per_token_s * self.cached_tokens()
        admitted = self._admit()
        prefill = 0
        for s in admitted:
            s.first_version = self.version
            self.finish_at[self.step_no + s.length - 1].append(s)
            prefill += s.group.prompt_len
        self.running += len(admitted)
        self.running_prompt_tokens += prefill
        self.running_admit_steps += self.step_no * len(admitted)
        batch = self.running
        shared += p.decode_per_seq_s * batch + p.prefill_per_token_s * prefill
        self.sim.cpu.busy += self.threads
        seconds = (fixed + shared / self.replicas) / self.speed * self.sim.cpu.slowdown()
        self.sim.loop.after(seconds, self._end_step, batch, seconds)

    def _admit(self) -> list[SimSample]:
        """Waiting requests into free slots, within the prefill budget (at least one)."""
        admitted, budget = [], self.cfg.max_prefill_tokens * self.replicas
        while self.waiting and self.running + len(admitted) < self.slots:
            if self.waiting[0].min_version > self.version:
                break  # held for newer weights, as ``GeneratorWorker`` holds its lease
            prompt = self.waiting[0].group.prompt_len
            if admitted and prompt > budget:
                break
            admitted.append(self.waiting.popleft())
            budget -= prompt
        return admitted

    def cached_tokens(self) -> int:
        """Tokens in the running sequences' KV cache: prompt + generated − 1 each."""
        generated = self.running * self.step_no - self.running_admit_steps
        return self.running_prompt_tokens + generated - self.running

    def _end_step(self, batch: int, seconds: float) -> None:
        self.sim.cpu.busy -= self.threads
        finished = self.finish_at.pop(self.step_no, [])
        for s in finished:
            self.running_prompt_tokens -= s.group.prompt_len
            self.running_admit_steps -= self.step_no - s.length + 1
        self.running -= len(finished)
        self.step_no += 1
        self.busy_s += seconds
        self.batch_s += batch * seconds
        self.tokens += batch
        self.steps += 1
        if self.direct:
            for s in finished:
                self.sim.buffer.finish(s)
        elif finished:  # one chunk each, all sent at the end of this step
            self.sim.loop.after(self.params.message_s, self.sim.server.chunks, finished)
        self.after_step()


class BufferServer:
    """``asyncrl.buffer.server``'s loop: park requests, answer them as soon as it can."""

    def __init__(self, sim: Simulation) -> None:
        self.sim, self.buffer = sim, sim.buffer
        self.parked: dict[Generator, int] = {}
        self.batch_step: int | None = None

    def lease_request(self, gen: Generator, capacity: int) -> None:
        self.parked[gen] = capacity
        self.answer()

    def chunks(self, samples: list[SimSample]) -> None:
        for sample in samples:
            self.buffer.finish(sample)
        self.answer()

    def batch_request(self, step: int) -> None:
        self.batch_step = step
        self.answer()

    def announce(self, version: int) -> None:
        self.buffer.set_version(version)
        self.answer()

    def answer(self) -> None:
        self._answer_leases()
        if self.batch_step is not None:
            stale = self.buffer.counts["groups_stale"]
            groups = self.buffer.take(self.batch_step)
            if groups is not None:
                self.batch_step = None
                self.sim.loop.after(self.sim.params.message_s, self.sim.trainer.on_batch, groups)
            if self.buffer.counts["groups_stale"] != stale:
                # dropped groups gave their count back: the server's next poll (≤ 20 ms,
                # here at once) leases their prompts again
                self._answer_leases()

    def _answer_leases(self) -> None:
        for gen, capacity in list(self.parked.items()):
            leases = self.buffer.lease(capacity)
            if leases:
                del self.parked[gen]
                self.sim.loop.after(self.sim.params.message_s, gen.deliver, leases)


class Trainer:
    """One step at a time; ``threads`` counts every rank's threads (they work in lockstep)."""

    def __init__(self, sim: Simulation, threads_per_rank: int, ranks: int) -> None:
        self.sim, self.cfg, self.params = sim, sim.cfg, sim.params
        self.ranks = ranks
        self.threads = min(threads_per_rank * ranks, sim.cfg.cores)
        per_rank = max(1, self.threads // ranks)
        self.speed = speedup(per_rank, self.params.train_parallel_fraction)
        self.step = 0
        self.waiting, self.wait_start, self.wait_s = False, 0.0, 0.0
        self.step_ends: list[tuple[float, int]] = []  # (time, trained tokens)
        self.phase_s: dict[str, float] = defaultdict(float)
        self.on_publish: Callable[[int], None] = self._publish_async

    def begin_wait(self) -> None:
        self.waiting, self.wait_start = True, self.sim.loop.now

    def request(self) -> None:
        self.begin_wait()
        self.sim.loop.after(self.params.message_s, self.sim.server.batch_request, self.step)

    def on_batch(self, groups: list[SimGroup]) -> None:
        self.waiting = False
        self.wait_s += self.sim.loop.now - self.wait_start
        tokens = sum(g.tokens() for g in groups)
        p, per_rank = self.params, tokens / self.ranks
        prep = p.prep_fixed_s + p.prep_per_token_s * per_rank
        train = p.train_fixed_s + p.train_per_token_s * per_rank
        self._phase(
            "prep",
            prep / self.speed,
            lambda: self._phase("train", train / self.speed, lambda: self._publish(tokens)),
        )

    def _phase(self, name: str, work_s: float, then: Callable[[], None]) -> None:
        start = self.sim.loop.now

        def done() -> None:
            self.phase_s[name] += self.sim.loop.now - start
            then()

        run_work(self.sim.loop, self.sim.cpu, self.threads, work_s, done)

    def _publish(self, tokens: int) -> None:
        def published() -> None:
            self.step += 1
            self.on_publish(self.step)
            p = self.params
            evaluate = self.cfg.eval_every and self.step % self.cfg.eval_every == 0
            post = p.post_s + (p.eval_s / self.speed if evaluate else 0.0)
            self._phase("post", post, lambda: self._step_done(tokens))

        # publish is mostly serialization and sends: not sped up by threads
        self._phase("publish", self.params.publish_s, published)

    def _publish_async(self, version: int) -> None:
        now, p = self.sim.loop.now, self.params
        for gen in self.sim.generators:
            gen.offer_weights(now + p.weight_sync_s, version)
        self.sim.loop.after(p.message_s, self.sim.server.announce, version)

    def _step_done(self, tokens: int) -> None:
        self.step_ends.append((self.sim.loop.now, tokens))
        if self.cfg.max_steps and self.step >= self.cfg.max_steps:
            self.sim.done = True
            return
        self.sim.next_step()


class Simulation:
    """The processes of one placement wired together on one loop."""

    def __init__(self, cfg: SimConfig, params: SimParams, buffer: SimBuffer) -> None:
        self.cfg, self.params, self.buffer = cfg, params, buffer
        self.loop, self.cpu = EventLoop(), Cpu(cfg.cores)
        self.done = False
        if cfg.placement == "colocated":
            threads = colocated_threads(cfg)
            self.trainer = Trainer(self, threads, 1)
            self.generators = [Generator("colocated", self, threads, direct=True)]
            self.generators[0].after_step = self._colocated_turn
            self.trainer.on_publish = self._publish_colocated
            self.server = None
        else:
            self.server = BufferServer(self)
            self.trainer = Trainer(self, cfg.trainer_threads, cfg.trainer_ranks)
            self.generators = [
                Generator(f"g{i}", self, generator_threads(cfg)) for i in range(cfg.num_generators)
            ]

    def start(self) -> None:
        if self.server is None:
            self.trainer.begin_wait()
            self._colocated_turn()
            return
        for gen in self.generators:
            gen.turn()
        self.trainer.request()

    def next_step(self) -> None:
        if self.server is None:
            self.trainer.begin_wait()
            self._colocated_turn()
        else:
            self.trainer.request()

    # ---- colocated: generate until the batch is complete, then train ---------------------
    def _colocated_turn(self) -> None:
        groups = self.buffer.take(self.trainer.step)
        if groups is not None:
            self.trainer.on_batch(groups)
            return
        gen = self.generators[0]
        gen.turn()
        if gen.idle:
            raise RuntimeError(f"colocated: nothing to generate for step {self.trainer.step}")

    def _publish_colocated(self, version: int) -> None:
        self.generators[0].version = version  # load_weights flips at once; nothing runs
        self.buffer.set_version(version)
