"""Reward scoring as a role of its own on the simulated cluster: a judge that costs compute
scores every finished sample before its group can be trained, on slots of its own that the
elastic controller moves as it moves generating slots (``asyncrl.sim.elastic``).

The judge is a generative reward model of the policy's size on the policy's engine shape
(assumptions): it reads a sample's prompt and response and writes ``verdict_tokens``
tokens. Its engines (every judge slot's, stepping in lockstep as the generator pool's do)
take waiting samples into free slots at each step, prefilling them, and write one verdict
token for every running sample; a sample whose verdict is written is finished into the
buffer, where its group is judged by the dynamic-sampling filter as before. A step costs
what a generator engine's step costs at the run's current lengths (``SimParams``), so the
judge's costs follow the lengths too: prefill grows with the responses, the verdict not.

Between the generators and the buffer, ``ScoringServer`` is the buffer server with this
one change: finished samples go to the judge's queue, and what the judge has scored is
finished into the buffer. The controller is shown the queue (in batches) and the judge's
busy share, as the launcher shows it its reward servers'.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from asyncrl.sim.buffer import SimSample
from asyncrl.sim.processes import BufferServer, Simulation


@dataclass
class Judge:
    """A reward model that costs compute (assumptions)."""

    verdict_tokens: int = 256
    """Tokens the judge writes for each sample (a short reasoned verdict)."""
    slots: int = 1
    """Slots it holds at the start of a run."""


class JudgePool:
    """The judge's engines as one, ``engines`` replicas in lockstep with ``slots_each``
    sequences each: a step costs one replica's share of the running work."""

    def __init__(self, sim: Simulation, verdict_tokens: int, scored: Callable) -> None:
        self.sim, self.verdict_tokens, self.scored = sim, max(1, verdict_tokens), scored
        self.engines = self.slots_each = 0
        self.queue: deque[SimSample] = deque()
        self.finish_at: dict[int, list[SimSample]] = defaultdict(list)
        self.running = self.step_no = 0
        self.stepping = False
        # Busy as a batching engine is: the share of its sequence slots in use, over
        # time (a few long verdicts keep it stepping without using what it holds).
        self.used_s = 0.0  # slot-seconds holding a sample
        self.held_s, self.since = 0.0, 0.0  # slot-seconds held, and since when
        self.samples = 0
        # What the launcher's loop samples each check: (time, queued, used, held)
        self.seen: deque[tuple[float, int, float, float]] = deque()

    def resize(self, engines: int, slots_each: int) -> None:
        """Engines from now on. Fewer: the running verdicts go on in the rest, as a
        drained generator's sequences do; more: they take waiting samples at once."""
        self.held_s, self.since = self.held(), self.sim.loop.now
        self.engines, self.slots_each = engines, slots_each
        self._wake()

    def held(self) -> float:
        """Slot-seconds the judge has held so far."""
        return self.held_s + self.engines * self.slots_each * (self.sim.loop.now - self.since)

    def busy_share(self) -> float:
        """Share of the slot-seconds held so far that held a sample."""
        held = self.held()
        # a shrunk pool runs over its slots until its verdicts end: at most all of them
        return min(1.0, self.used_s / held) if held > 0 else 0.0

    def observe(self, window_s: float) -> tuple[float, float]:
        """Samples waiting (a mean over the checks of the latest ``window_s``, this one
        included) and the share of the slots held in that window that held a sample."""
        now = self.sim.loop.now
        self.seen.append((now, len(self.queue), self.used_s, self.held()))
        while self.seen[0][0] < now - window_s:
            self.seen.popleft()
        queued = sum(q for _, q, _, _ in self.seen) / len(self.seen)
        (_, _, used0, held0), (_, _, used1, held1) = self.seen[0], self.seen[-1]
        return queued, min(1.0, (used1 - used0) / (held1 - held0)) if held1 > held0 else 0.0

    def submit(self, samples: list[SimSample]) -> None:
        self.queue.extend(samples)
        self._wake()

    def _wake(self) -> None:
        if not self.stepping and self.engines and (self.running or self.queue):
            self._step()

    def _step(self) -> None:
        p = self.sim.params
        admitted, free = 0, self.engines * self.slots_each - self.running
        prefill = 0
        while self.queue and admitted < free:
            sample = self.queue.popleft()
            self.finish_at[self.step_no + self.verdict_tokens - 1].append(sample)
            prefill += sample.group.prompt_len + sample.length
            admitted += 1
        self.running += admitted
        shared = p.decode_per_seq_s * self.running + p.prefill_per_token_s * prefill
        seconds = p.decode_fixed_s + shared / self.engines
        self.stepping = True
        self.sim.loop.after(seconds, self._end_step, seconds)

    def _end_step(self, seconds: float) -> None:
        self.stepping = False
        self.used_s += seconds * self.running
        done = self.finish_at.pop(self.step_no, [])
        self.running -= len(done)
        self.step_no += 1
        self.samples += len(done)
        if done:
            self.scored(done)
        self._wake()


class ScoringServer(BufferServer):
    """The buffer server, with the judge between the generators' chunks and the buffer."""

    def __init__(self, sim: Simulation, verdict_tokens: int) -> None:
        super().__init__(sim)
        self.judge = JudgePool(sim, verdict_tokens, super().chunks)

    def chunks(self, samples: list[SimSample]) -> None:
        self.judge.submit(samples)
