"""Tests for asyncrl.buffer.reward_model and the buffer's ``Scoring`` with a reward model:
the score's definition (a padded batch = each sequence alone = the plain forward's value at
the last token), the scorer's bookkeeping (every key once, batch sizes, failed forwards),
the sources' combination, and a real in-process buffer + generator run whose trained-on
samples carry the reward model's score."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncrl.buffer import reward_model
from asyncrl.buffer.client import BufferClient
from asyncrl.buffer.config import BufferConfig, RolloutConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.groups import ToScore
from asyncrl.buffer.reward_model import RewardModelScorer, score_sequences
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.buffer.scoring import Scoring, buffer_counters
from asyncrl.buffer.server import BufferServer
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.leases import SamplingConfig
from asyncrl.generator.worker import GeneratorWorker
from asyncrl.metrics import MetricsConfig
from asyncrl.models import ModelConfig, load_model, load_tokenizer
from asyncrl.tasks import TaskConfig, build_task
from asyncrl.tasks.stream import TaskPrompts

TASK_CFG = TaskConfig(train_size=200, eval_size=10)


@pytest.fixture(scope="module")
def rm(rm_dir):
    return load_model(ModelConfig(path=rm_dir, head="value")).eval()


def _sequences(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=g).tolist()
    return [torch.randint(3, 20, (k,), generator=g).tolist() for k in lengths]


def _poll_all(scorer, n: int, timeout_s: float = 30.0) -> list:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += scorer.poll()
        time.sleep(0.005)
    return out


def test_padded_batch_scores_equal_each_sequence_alone_and_the_plain_forward(rm):
    sequences = _sequences(6)
    batched = score_sequences(rm, sequences, pad_id=0)
    assert len({round(s, 4) for s in batched}) > 1  # a real head, not the zero one
    for ids, score in zip(sequences, batched):
        (alone,) = score_sequences(rm, [ids], pad_id=0)
        with torch.no_grad():
            plain = rm(input_ids=torch.tensor([ids])).logits[0, len(ids) - 1, 0].item()
        assert score == pytest.approx(alone, abs=1e-5)
        assert score == pytest.approx(plain, abs=1e-5)
    # The pad id does not matter: padding is never attended.
    assert score_sequences(rm, sequences, pad_id=7) == pytest.approx(batched, abs=1e-5)


def test_scorer_returns_every_key_once_in_batches_of_at_most_batch_size(rm_dir, rm, monkeypatch):
    sizes = []
    original = reward_model.score_sequences

    def recording(model, sequences, pad_id):
        sizes.append(len(sequences))
        return original(model, sequences, pad_id)

    monkeypatch.setattr(reward_model, "score_sequences", recording)
    scorer = RewardModelScorer(rm_dir, batch_size=4, threads=1)
    try:
        sequences = _sequences(23, seed=1)
        for i, ids in enumerate(sequences):
            scorer.submit(("k", i), ids)
        results = _poll_all(scorer, len(sequences))
        assert sorted(k for k, _ in results) == [("k", i) for i in range(23)]
        assert scorer.pending() == 0 and scorer.poll() == []
        expected = score_sequences(rm, sequences, 0)
        for (_, i), score in results:
            assert score == pytest.approx(expected[i], abs=1e-5)
        assert max(sizes) <= 4 and sum(sizes) == 23
        assert scorer.counters() == {"scored": 23, "batches": len(sizes), "errors": 0}
    finally:
        scorer.close()


def test_a_failed_forward_gives_zero_and_is_counted_without_losing_keys(rm_dir, monkeypatch):
    calls = []
    original = reward_model.score_sequences

    def every_other_fails(model, sequences, pad_id):
        calls.append(len(sequences))
        if len(calls) % 2:
            raise RuntimeError("forward broke")
        return original(model, sequences, pad_id)

    monkeypatch.setattr(reward_model, "score_sequences", every_other_fails)
    scorer = RewardModelScorer(rm_dir, batch_size=3, threads=1)
    try:
        for i, ids in enumerate(_sequences(10, seed=2)):
            scorer.submit(i, ids)
        results = dict(_poll_all(scorer, 10))
        assert sorted(results) == list(range(10))
        failed = sum(n for j, n in enumerate(calls) if j % 2 == 0)
        assert sum(r == 0.0 for r in results.values()) == failed > 0
        assert scorer.counters() == {"scored": 10 - failed, "batches": len(calls), "errors": failed}
    finally:
        scorer.close()


def test_the_scorers_thread_count_stays_in_its_thread(rm_dir):
    before = torch.get_num_threads()
    scorer = RewardModelScorer(rm_dir, batch_size=2, threads=1)
    try:
        scorer.submit(0, [3, 4, 5])
        assert len(_poll_all(scorer, 1)) == 1
        if "OpenMP" in torch.__config__.parallel_info():
            assert torch.get_num_threads() == before
    finally:
        scorer.close()


def test_reward_config_needs_a_model_path_for_model_sources(tiny_model_dir):
    for source in ("model", "mixed"):
        cfg = RolloutConfig(
            model=ModelConfig(path=tiny_model_dir),
            task=TASK_CFG,
            reward=RewardConfig(workers=0, source=source),
        )
        with pytest.raises(ValueError, match="reward.model_path"):
            Scoring(cfg)
    with pytest.raises(ValueError, match="reward.source"):
        RewardConfig(source="learned").check()


class _Buffer:
    """What ``Scoring.pump`` touches of a ``RolloutBuffer``: its ``assembler``'s
    ``take_unscored`` and ``on_reward``."""

    def __init__(self, unscored) -> None:
        self.unscored, self.rewards = list(unscored), {}
        self.assembler = self

    def take_unscored(self) -> list[ToScore]:
        taken, self.unscored = self.unscored, []
        return taken

    def on_reward(self, key, reward) -> None:
        assert key not in self.rewards
        self.rewards[key] = reward


@pytest.mark.parametrize("source", ["verifier", "model", "mixed"])
def test_scoring_combines_verifier_and_model_by_source(source, tiny_model_dir, rm_dir, rm):
    reward = RewardConfig(
        workers=0,
        source=source,
        model_path=rm_dir,
        verifier_weight=0.5,
        model_weight=2.0,
        model_batch_size=2,
    )
    scoring = Scoring(
        RolloutConfig(model=ModelConfig(path=tiny_model_dir), task=TASK_CFG, reward=reward)
    )
    tokenizer, task = load_tokenizer(tiny_model_dir), build_task(TASK_CFG)
    eos, unscored, expected = tokenizer.eos_token_id, [], {}
    for i in range(3):
        example = task.examples("train")[i]
        prompt = tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
        for j, text in enumerate([f" {example.answer}", " 1234567"]):  # right, then wrong
            completion = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            verifier = task.score(example, text)
            assert (verifier == 1.0) == (j == 0)
            (model,) = score_sequences(rm, [prompt + completion], 0)
            unscored.append(ToScore((i, j), i, completion, "eos"))
            expected[(i, j)] = {
                "verifier": verifier,
                "model": model,
                "mixed": 0.5 * verifier + 2.0 * model,
            }[source]
    buffer = _Buffer(unscored)
    try:
        deadline = time.monotonic() + 30
        while len(buffer.rewards) < len(expected) and time.monotonic() < deadline:
            scoring.pump(buffer)
            time.sleep(0.005)
        assert buffer.unscored == [] and scoring.pending() == 0
        assert buffer.rewards.keys() == expected.keys()
        for key, value in expected.items():
            assert buffer.rewards[key] == pytest.approx(value, abs=1e-5)
        counters = buffer_counters(RolloutBuffer(BufferConfig(), "r", None, None), scoring)
        assert ("buffer/reward_model_scored" in counters) == (source != "verifier")
        if source != "verifier":
            assert counters["buffer/reward_model_scored"] == 6.0
            assert counters["buffer/reward_model_errors"] == 0.0
    finally:
        scoring.close()


def test_real_buffer_run_trains_on_reward_model_scores(tiny_model_dir, rm_dir, rm, tmp_path):
    """The buffer process's server and a generator, in threads of this process, over real
    sockets; the trainer's side is a ``BufferClient``."""
    cfg = RolloutConfig(
        run_dir=str(tmp_path),
        run_id="rm",
        model=ModelConfig(path=tiny_model_dir),
        task=TASK_CFG,
        buffer=BufferConfig(prompts_per_batch=2, samples_per_prompt=3, checkpoint_s=0),
        sampling=SamplingConfig(max_new_tokens=6, temperature=1.0),
        reward=RewardConfig(workers=0, source="model", model_path=rm_dir, model_batch_size=4),
        engine=EngineConfig(embedded=EmbeddedEngineConfig(max_slots=4, max_seq_len=64, threads=1)),
        metrics=MetricsConfig(tensorboard=False, progress_bar=False),
    )
    prompts = TaskPrompts(build_task(cfg.task), cfg.model.path, cfg.seed)
    buffer = RolloutBuffer(cfg.buffer, cfg.run_id, prompts, cfg.sampling.spec())
    server = BufferServer(cfg, buffer, Scoring(cfg))
    threads = [threading.Thread(target=server.serve, daemon=True)]
    threads[0].start()
    engine = EmbeddedEngine(tiny_model_dir, cfg.engine.embedded)
    worker = GeneratorWorker(cfg, "g0", engine)
    threads.append(threading.Thread(target=worker.run, daemon=True))
    threads[1].start()
    client = BufferClient(str(tmp_path), "rm", rank=0, transport=cfg.transport)
    try:
        batch = client.request_batch(0, world_size=1, timeout_s=60)
    finally:
        client.close()
        worker.stop()
        server.stop()
        for t in threads:
            t.join(timeout=30)
        engine.close()
    assert len(batch.samples) == 6
    expected = score_sequences(rm, [s.token_ids for s in batch.samples], 0)
    for sample, score in zip(batch.samples, expected):
        assert sum(sample.loss_mask) > 0 and sample.reward != 0.0
        assert sample.reward == pytest.approx(score, abs=1e-5)
    counters = json.loads((Path(tmp_path) / "buffer_counters.json").read_text())
    assert counters["buffer/reward_model_scored"] >= 6
    assert counters["buffer/reward_model_errors"] == 0
    assert counters["buffer/reward_scored"] == 0  # the verifier was never asked
