"""Property tests of the buffer's logic, driven by a simulated clock, simulated generators
(which lag behind the trainer's version, die, leave drained and join again, and send
chunks late, twice, or out of order) and a simulated trainer of two ranks.

Invariants checked after every action: the counters add up (every sample slot created
is consumed, stale, filtered, failed or in flight); no consumed trajectory is staler
than η; with η = 0 every consumed token's version equals the step that consumes it.

Every input goes through the write-ahead ``Journal``; the buffer "crashes" and comes
back from its last saved state plus the log since, which must give the same state,
and the trainer restarts from its last checkpoint and must get the same batches again
for the steps it redoes, without any sample counted as consumed twice.
"""

from __future__ import annotations

import random

from hypothesis import event, given, settings
from hypothesis import strategies as st

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring
from asyncrl.buffer.wal import Journal, frame, replay
from asyncrl.wire import Chunk, SamplingSpec

GENERATORS = ["g0", "g1", "g2"]


def prompts(position: int) -> tuple[int, list[int]]:
    # Prompts come round again (an epoch of 11), as skip_uniform needs.
    return position % 11, [3 + position % 7, 4, 5]


def score(prompt_id: int, completion: list[int], reason: str | None) -> float:
    if completion and completion[0] == 13:
        raise RuntimeError("a reward function that fails")
    return float(sum(completion) % 2)


class Simulation:
    """Generators, a network and a trainer around one buffer, stepped by weighted random
    actions from a seed, with the invariants checked after every action."""

    def __init__(
        self, eta: int | None, dynamic: bool, seed: int, skip: float = 0.0, elastic: bool = False
    ) -> None:
        self.eta, self.elastic = eta, elastic
        cfg = BufferConfig(
            prompts_per_batch=2,
            samples_per_prompt=2,
            max_staleness=eta,
            progress_timeout_s=50.0,
            heartbeat_timeout_s=5.0,
            dynamic_sampling=dynamic,
            skip_uniform=skip,
        )
        self.buffer = RolloutBuffer(cfg, "run", prompts, SamplingSpec())
        self.scoring = InlineScoring(score)  # rewards arrive as soon as a sample finishes
        self.log: list[bytes] = []  # the write-ahead log since the last save
        self.journal = Journal(self.buffer, self)
        self.saved = self.buffer.save()
        self.checkpoint = 0  # the trainer's newest checkpoint (a step)
        self.served: dict[int, list[tuple[int, int]]] = {}  # step -> (group, index) trained
        self.rng = random.Random(seed)
        self.now = 0.0
        self.step = 0  # the trainer's version == the next step it consumes
        self.gen_version = dict.fromkeys(GENERATORS, 0)
        self.alive = dict.fromkeys(GENERATORS, True)
        self.held: dict[str, dict[str, int]] = {g: {} for g in GENERATORS}  # lease -> next seq
        self.network: list[Chunk] = []
        self.consumed: list[tuple[int, list[int]]] = []
        self.role_changes = 0  # generators drained out or joining again

    def run(self, actions: int) -> None:
        table = [
            (self.lease, 20),
            (self.generate, 25),
            (self.deliver, 25),
            (self.sync_weights, 8),
            (self.advance, 10),
            (self.train_step, 10),
            (self.kill, 1),
            (self.restart, 1),
            (self.restart_buffer, 1),
            (self.crash_buffer, 1),
            (self.save, 2),
            (self.trainer_checkpoint, 2),
            (self.restart_trainer, 1),
        ]
        if self.elastic:  # generators leave drained and join again, often
            table += [(self.drain, 4), (self.restart, 3)]
        moves, weights = zip(*table)
        for move in self.rng.choices(moves, weights, k=actions):
            move()
            self.check()

    def lease(self) -> None:
        g = self.rng.choice(GENERATORS)
        if self.alive[g]:
            for lease in self.journal.lease(g, self.rng.randint(1, 4), self.now):
                self.held[g][lease.lease_id] = 0

    def generate(self) -> None:
        """One chunk of 1-3 tokens for every lease a generator holds; some finish."""
        g = self.rng.choice(GENERATORS)
        if not self.alive[g]:
            return
        for lease_id in sorted(self.held[g]):
            seq, n = self.held[g][lease_id], self.rng.randint(1, 3)
            finish = self.rng.random() < 0.3
            reason = ("error" if self.rng.random() < 0.02 else "eos") if finish else None
            self.network.append(
                Chunk(
                    run_id="run",
                    worker_id=g,
                    lease_id=lease_id,
                    seq=seq,
                    token_ids=[self.rng.randrange(3, 20) for _ in range(n)],
                    logprobs=[-1.0] * n,
                    versions=[self.gen_version[g]] * n,
                    finished=finish,
                    finish_reason=reason,
                )
            )
            self.held[g][lease_id] = seq + 1
            if finish:
                del self.held[g][lease_id]

    def deliver(self) -> None:
        """Deliver some chunks in random order, a few of them twice."""
        self.rng.shuffle(self.network)
        count = self.rng.randint(1, 8)
        for chunk in self.network[:count]:
            self.journal.chunk(chunk, self.now)
            if self.rng.random() < 0.1:
                self.journal.chunk(chunk, self.now)
            self.scoring.pump(self.buffer, self.journal.reward)
        del self.network[:count]

    def sync_weights(self) -> None:
        self.gen_version[self.rng.choice(GENERATORS)] = self.step

    def kill(self) -> None:
        g = self.rng.choice(GENERATORS)
        self.alive[g], self.held[g] = False, {}

    def drain(self) -> None:
        """A generator leaves, drained: its chunks reach the buffer before its ``Leaving``
        (one socket), and the buffer takes back every lease it held. ``restart`` is its
        slot joining again later."""
        g = self.rng.choice(GENERATORS)
        if not self.alive[g]:
            return
        mine = [c for c in self.network if c.worker_id == g]
        self.network = [c for c in self.network if c.worker_id != g]
        for chunk in mine:
            self.journal.chunk(chunk, self.now)
            self.scoring.pump(self.buffer, self.journal.reward)
        self.journal.leave(g)
        assert not any(s.worker_id == g for s in self._slots_out())
        self.alive[g], self.held[g] = False, {}
        self.role_changes += 1

    def _slots_out(self):
        groups = self.buffer.state.groups
        return [groups[g].slots[i] for g, i in self.buffer.leases.active.values()]

    def restart(self) -> None:
        g = self.rng.choice(GENERATORS)
        self.role_changes += not self.alive[g]
        self.alive[g] = True

    def restart_buffer(self) -> None:
        """The buffer process dies and comes back from its saved state."""
        data = self.buffer.save()
        self.buffer = RolloutBuffer(self.buffer.cfg, "run", prompts, SamplingSpec())
        self.buffer.restore(data, self.now)
        assert self.buffer.save() == data
        self.journal.buffer = self.buffer

    def append(self, event) -> None:  # the Journal's log
        self.log.append(frame(event))

    def save(self) -> None:
        self.saved, self.log = self.buffer.save(), []

    def crash_buffer(self) -> None:
        """The buffer process is killed: the saved state plus the log replayed gives back
        exactly the state it had."""
        before = self.buffer.save()
        self.buffer = RolloutBuffer(self.buffer.cfg, "run", prompts, SamplingSpec())
        self.buffer.restore(self.saved, self.now)
        replay(self.buffer, b"".join(self.log))
        self.buffer.leases.alive_since(self.now)
        assert self.buffer.save() == before
        self.journal.buffer = self.buffer

    def trainer_checkpoint(self) -> None:
        self.checkpoint = self.step
        self.journal.checkpointed(self.step)

    def restart_trainer(self) -> None:
        """The trainer goes back to its checkpoint; the steps it redoes get the same data."""
        self.step = self.checkpoint
        self.journal.version(self.step, resumed=True)

    def advance(self) -> None:
        self.now += self.rng.choice([0.5, 1.0, 2.0, 30.0])
        for g in GENERATORS:
            if self.alive[g]:
                self.buffer.leases.on_heartbeat(g, self.now)
        self.journal.expire(self.now)
        for g in GENERATORS:  # a generator whose lease was taken back stops working on it
            self.held[g] = {k: v for k, v in self.held[g].items() if k in self.buffer.leases.active}

    def train_step(self) -> None:
        consumed_before = self.buffer.state.counts["samples_consumed"]
        shares = [self.journal.batch(self.step, rank, 2) for rank in range(2)]
        if shares[0] is None:
            return
        keys = [(s.group_id, s.sample_index) for s in shares[0] + shares[1]]
        if self.step in self.served:  # a step redone after a trainer restart
            assert keys == self.served[self.step]
            assert self.buffer.state.counts["samples_consumed"] == consumed_before
        else:
            self.served[self.step] = keys
            for sample in shares[0] + shares[1]:
                self.consumed.append(
                    (self.step, [v for v, m in zip(sample.versions, sample.loss_mask) if m])
                )
        self.step += 1
        self.journal.version(self.step)

    def check(self) -> None:
        self.buffer.check_accounting()
        consumed = [k for keys in self.served.values() for k in keys]
        assert len(consumed) == len(set(consumed)) == self.buffer.state.counts["samples_consumed"]
        for step, versions in self.consumed:
            assert versions, "a consumed sample has no generated tokens"
            if self.eta is not None:
                assert step - min(versions) <= self.eta, (step, versions)
            if self.eta == 0:
                assert set(versions) == {step}, (step, versions)


@settings(max_examples=60, deadline=None)
@given(
    eta=st.sampled_from([0, 1, 3, None]),
    dynamic=st.booleans(),
    seed=st.integers(0, 2**32),
    skip=st.sampled_from([0.0, 0.7]),
)
def test_buffer_invariants_under_random_schedules(eta, dynamic, seed, skip):
    sim = Simulation(eta, dynamic, seed, skip)
    sim.run(600)
    event(f"steps consumed: {'10+' if sim.step >= 10 else sim.step}")
    c = sim.buffer.state.counts
    event(
        f"stale groups dropped: {bool(c['groups_stale'])}, reissued leases: {bool(c['leases_reissued'])}"
    )
    assert sum(sim.buffer.state.staleness.values()) == c["samples_consumed"]
    event(f"batches served again after a trainer restart: {bool(c['batches_served_again'])}")
    event(f"prompts skipped as uniform: {bool(c['prompts_skipped'])}")


@settings(max_examples=30, deadline=None)
@given(eta=st.sampled_from([0, 2, None]), seed=st.integers(0, 2**32))
def test_the_books_hold_while_generators_leave_drained_and_join_again(eta, seed):
    """The same invariants, with generators drained out and joining again many times a
    run (the elastic placement's moves): nothing lost, nothing consumed twice."""
    sim = Simulation(eta, dynamic=True, seed=seed, elastic=True)
    sim.run(1000)
    assert sim.role_changes >= 10
    c = sim.buffer.state.counts
    event(f"drained leases: {'10+' if c['leases_revoked_drained'] >= 10 else '<10'}")
    event(f"steps consumed: {'10+' if sim.step >= 10 else '<10'}")


def _two_prompts(position: int) -> tuple[int, list[int]]:
    return position % 2, [7]


def _by_prompt(prompt_id: int, completion: list[int], reason: str | None) -> float:
    return 1.0 if prompt_id == 0 else float(completion[0] % 2)


def _lease_six_rounds(**cfg_fields) -> tuple[RolloutBuffer, list[int]]:
    """Prompt 0's samples always score 1, prompt 1's score 1 and 0 (tokens 1 and 2): six
    rounds of leasing two samples and finishing them; returns the leased prompt ids."""
    cfg = BufferConfig(prompts_per_batch=1, samples_per_prompt=2, max_staleness=None, **cfg_fields)
    buffer = RolloutBuffer(cfg, "run", _two_prompts, SamplingSpec())
    scoring = InlineScoring(_by_prompt)
    leased = []
    for round_ in range(6):
        for lease in buffer.leases.lease("g", 2, float(round_)):
            leased.append(lease.prompt_id)
            buffer.leases.on_chunk(
                Chunk(
                    run_id="run",
                    worker_id="g",
                    lease_id=lease.lease_id,
                    seq=0,
                    token_ids=[lease.sample_index + 1],
                    logprobs=[0.0],
                    versions=[0],
                    finished=True,
                    finish_reason="stop",
                ),
                float(round_),
            )
            scoring.pump(buffer)
    buffer.check_accounting()
    return buffer, leased


def test_skip_uniform_skips_prompts_whose_groups_had_no_spread():
    """With p = 1 a uniform prompt is skipped from its second turn on, before any lease;
    with p = 0 none is; with a floor above its reward its groups do not count."""
    for p, expect_skipped in ((1.0, True), (0.0, False)):
        buffer, leased_prompts = _lease_six_rounds(dynamic_sampling=True, skip_uniform=p)
        assert leased_prompts[:4] == [0, 0, 1, 1]  # both prompts' first turns are leased
        if expect_skipped:
            assert set(leased_prompts[4:]) == {1}, leased_prompts
            assert buffer.state.counts["prompts_skipped"] >= 2
            assert buffer.state.uniform_streak == {0: 1}
        else:
            assert 0 in leased_prompts[4:] and not buffer.state.counts["prompts_skipped"]
    buffer, _ = _lease_six_rounds(skip_uniform=1.0, skip_uniform_min_reward=1.5)
    assert not buffer.state.counts["prompts_skipped"] and not buffer.state.uniform_streak


def test_eta_zero_is_one_batch_of_prompts_per_version():
    cfg = BufferConfig(prompts_per_batch=3, samples_per_prompt=2, max_staleness=0)
    buffer = RolloutBuffer(cfg, "run", prompts, SamplingSpec())
    assert len(buffer.leases.lease("g", 100, 0.0)) == 6  # 3 prompts x 2 samples, no more
    buffer.batches.set_version(1)
    assert len(buffer.leases.lease("g", 100, 0.0)) == 6
    cfg.max_staleness = None
    unbounded = RolloutBuffer(cfg, "run", prompts, SamplingSpec())
    assert len(unbounded.leases.lease("g", 100, 0.0)) == 100
