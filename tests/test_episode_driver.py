"""The generator's episode driver (``asyncrl.episodes.driver``) against a scripted engine:
a turn the engine aborted is sampled again and never sent, an episode taken back while
its environment works is closed exactly once, and episodes that send nothing for a while
renew their lease with empty chunks."""

from __future__ import annotations

import threading
import time

from asyncrl.buffer.config import RolloutConfig
from asyncrl.engine.leases import PendingLease, SamplingConfig
from asyncrl.episodes import Step
from asyncrl.episodes.driver import MAX_TURN_RETRIES, EpisodeDriver
from asyncrl.models import ModelConfig
from asyncrl.tasks import TaskConfig
from asyncrl.transport import TransportConfig
from asyncrl.wire import Lease, SamplingSpec
from tests.episode_envs import Counter


class Engine:
    """Records submitted requests; tokens are handed to the driver by the test."""

    def __init__(self) -> None:
        self.requests = []

    def submit(self, request) -> None:
        self.requests.append(request)

    def abort(self, request_id: str) -> None:
        pass


class Blocking(Counter):
    """``Counter`` whose step waits for ``release``; ``closed`` counts closes."""

    release = threading.Event()
    closed = 0

    def step(self, turn: str) -> Step:
        Blocking.release.wait(10)
        return super().step(turn)

    def close(self) -> None:
        Blocking.closed += 1


def _driver(model_dir: str, environment: str, keep_alive_s: float = 60.0):
    cfg = RolloutConfig(
        model=ModelConfig(path=model_dir),
        task=TaskConfig(train_size=20, eval_size=5, environment=environment, max_turns=3),
        sampling=SamplingConfig(max_new_tokens=4),
        transport=TransportConfig(heartbeat_s=keep_alive_s),
    )
    engine, pending, sent = Engine(), {}, []

    def send(p: PendingLease, finished: bool, reason) -> None:
        sent.append((p.seq, list(p.token_ids), list(p.loss_mask), finished, reason))
        p.seq, p.token_ids, p.logprobs, p.versions, p.loss_mask = p.seq + 1, [], [], [], []

    driver = EpisodeDriver(cfg, engine, pending, send)
    return driver, engine, pending, sent


def _lease(lease_id: str = "L0") -> Lease:
    return Lease(
        run_id="run",
        lease_id=lease_id,
        prompt_id=0,
        group_id=0,
        sample_index=0,
        prompt_ids=[3, 4, 5],
        sampling=SamplingSpec(max_new_tokens=4),
    )


def _until(condition, driver) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the driver never got there"
        driver.poll(time.time())
        time.sleep(0.005)


def _turn(pending, lease_id: str, tokens: list[int]) -> PendingLease:
    p = pending.pop(lease_id)
    p.token_ids, p.logprobs, p.versions = list(tokens), [-1.0] * len(tokens), [0] * len(tokens)
    return p


def test_a_turn_the_engine_aborted_is_sampled_again_and_never_sent(tiny_model_dir):
    driver, engine, pending, sent = _driver(tiny_model_dir, "tests.episode_envs:Counter")
    driver.start(_lease(), time.time())
    _until(lambda: "L0" in pending, driver)
    for attempt in range(MAX_TURN_RETRIES):
        driver.turn_finished(_turn(pending, "L0", [7, 8]), "abort")
        assert len(engine.requests) == attempt + 2 and "L0" in pending
        assert engine.requests[-1].prompt_ids == [3, 4, 5]  # the same context again
    assert sent == []  # nothing of the aborted samplings left the generator
    driver.turn_finished(_turn(pending, "L0", [7]), "abort")
    assert sent == [(0, [], [], True, "error")] and "L0" not in driver
    driver.close()


def test_an_episode_taken_back_while_its_environment_works_is_closed_once(tiny_model_dir):
    driver, engine, pending, sent = _driver(tiny_model_dir, "tests.test_episode_driver:Blocking")
    Blocking.release.clear()
    Blocking.closed = 0
    driver.start(_lease(), time.time())
    _until(lambda: "L0" in pending, driver)
    driver.turn_finished(_turn(pending, "L0", [7, 8]), "stop")
    assert driver.between_turns() == 1
    driver.abort("L0")  # the buffer took it back; its environment is still in step
    assert "L0" not in driver and driver.between_turns() == 0
    Blocking.release.set()
    deadline = time.monotonic() + 10
    while Blocking.closed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    driver.poll(time.time())
    time.sleep(0.1)
    assert Blocking.closed == 1 and sent == [] and len(engine.requests) == 1
    driver.close()


def test_episodes_that_send_nothing_renew_their_lease(tiny_model_dir):
    driver, engine, pending, sent = _driver(
        tiny_model_dir, "tests.episode_envs:Counter", keep_alive_s=0.05
    )
    driver.start(_lease(), time.time())
    _until(lambda: "L0" in pending, driver)
    time.sleep(0.06)
    driver.poll(time.time())  # decoding its first turn: nothing to send but a renewal
    assert sent and sent[-1] == (0, [], [], False, None)
    driver.turn_finished(_turn(pending, "L0", [7, 8]), "stop")
    _until(lambda: "L0" in pending, driver)  # answered, and the next turn submitted
    seq, tokens, mask, finished, _ = sent[-1]
    assert seq == 1 and tokens[:2] == [7, 8] and mask[:2] == [1, 1] and 0 in mask
    assert not finished
    driver.close()
