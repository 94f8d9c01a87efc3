"""Episodes end to end through the buffer: a buffer process, a generator (in this process,
its engine recorded) running a multi-turn environment, and a consumer that takes batches
as the trainer does and publishes new weights after each. Every trained episode's tokens,
loss mask, behavior logprobs and versions must equal, token for token, what the engine
sampled and what the environment answered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from asyncrl.buffer.client import BufferClient
from asyncrl.buffer.config import BufferConfig, RolloutConfig
from asyncrl.config import save_json
from asyncrl.engine.base import StepOutput
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.leases import SamplingConfig
from asyncrl.generator.worker import GeneratorWorker
from asyncrl.interfaces import FullParameters
from asyncrl.loop.batch import to_sequences
from asyncrl.metrics import MetricsConfig
from asyncrl.models import ModelConfig, load_model, load_tokenizer
from asyncrl.stages.rl_config import RLConfig
from asyncrl.tasks import TaskConfig
from asyncrl.transport import TransportConfig
from asyncrl.weights.sender import BucketPublisher
from tests.episode_envs import Counter, LengthAgent

STEPS, PROMPTS, SAMPLES = 5, 2, 3


class RecordingEngine:
    """The embedded engine, with every request's context and every sampled token kept.
    Once ``freeze_at_next_turn`` is set, the first later turn of an episode freezes it:
    no request decodes again, so its episodes stay mid-way, at least one of them after
    a whole turn, until its generator is stopped."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.contexts: dict[str, list[list[int]]] = defaultdict(list)
        self.sampled: dict[str, list[tuple[int, float, int]]] = defaultdict(list)
        self.freeze_at_next_turn = threading.Event()
        self.frozen = threading.Event()

    def submit(self, request):
        self.contexts[request.request_id].append(list(request.prompt_ids))
        if self.freeze_at_next_turn.is_set() and len(self.contexts[request.request_id]) > 1:
            self.frozen.set()
        return self.engine.submit(request)

    def step(self):
        if self.frozen.is_set():
            time.sleep(0.005)
            return StepOutput([], [], self.engine.version)
        out = self.engine.step()
        for t in out.tokens:
            self.sampled[t.request_id].append((t.token_id, t.logprob, t.version))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _config(tmp_path: Path, model_dir: str, **task) -> RolloutConfig:
    return RolloutConfig(
        run_dir=str(tmp_path),
        run_id="ep",
        model=ModelConfig(path=model_dir),
        task=TaskConfig(
            **{
                "train_size": 200,
                "eval_size": 10,
                "environment": "tests.episode_envs:Slow",
                "max_turns": 3,
                "max_episode_tokens": 40,
                **task,
            }
        ),
        buffer=BufferConfig(prompts_per_batch=PROMPTS, samples_per_prompt=SAMPLES, max_staleness=1),
        sampling=SamplingConfig(max_new_tokens=6, temperature=1.0),
        transport=TransportConfig(chunk_tokens=2, chunk_ms=5.0, heartbeat_s=0.2),
        engine=EngineConfig(embedded=EmbeddedEngineConfig(max_slots=4, max_seq_len=96)),
        metrics=MetricsConfig(tensorboard=False, interval_s=0.5),
    )


def _run(tmp_path: Path, cfg: RolloutConfig, engine: RecordingEngine, successor=None, steps=STEPS):
    """Run the buffer and a generator for STEPS batches (with a ``successor`` engine, the
    generator dies after the first batch and a second one takes over); returns the
    batches' samples and each lease's (group id, sample index)."""
    config_path = tmp_path / "rollout.json"
    save_json(cfg, config_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "asyncrl.buffer.server", "--config", str(config_path)]
    buffer = subprocess.Popen(cmd, stdout=open(tmp_path / "buffer.log", "wb"), env=env)
    client = BufferClient(str(tmp_path), "ep", rank=0, transport=cfg.transport)
    leases: dict[str, tuple[int, int]] = {}
    workers = [_start_worker(cfg, "g0", engine, leases)]
    weights = BucketPublisher(cfg.site())
    state = load_model(cfg.model).state_dict()
    samples = []
    try:
        for step in range(steps):
            samples += client.request_batch(step, world_size=1, timeout_s=120).samples
            if step == 0 and successor is not None:
                # It dies holding episodes mid-way, one at least after a whole turn (sent
                # to the buffer before the next turn is submitted; the keep-alive chunks
                # that follow show it went out).
                engine.freeze_at_next_turn.set()
                assert engine.frozen.wait(timeout=60), "no episode reached a second turn"
                time.sleep(2 * cfg.transport.heartbeat_s)
                _stop(workers.pop())
                workers.append(_start_worker(cfg, "g1", successor, leases))
            # New weights each step (slightly moved, so their logprobs differ).
            state = {k: v + 1e-3 * torch.randn_like(v) for k, v in state.items()}
            weights.publish(step + 1, FullParameters.of(state))
            client.announce_version(step + 1)
    finally:
        for worker in workers:
            _stop(worker)
        client.close()
        weights.close()
        buffer.send_signal(signal.SIGTERM)
        buffer.wait(timeout=30)
    return samples, leases


def _start_worker(cfg, worker_id, engine, leases):
    worker = GeneratorWorker(cfg, worker_id, engine)
    submit = worker._submit

    def record_lease(lease, now):
        leases[lease.lease_id] = (lease.group_id, lease.sample_index)
        submit(lease, now)

    worker._submit = record_lease
    worker.thread = threading.Thread(target=worker.run)
    worker.thread.start()
    return worker


def _stop(worker) -> None:
    worker.stop()
    worker.thread.join(timeout=30)


def test_trained_episodes_are_what_the_engine_sampled_and_the_environment_said(
    tmp_path, tiny_model_dir
):
    cfg = _config(tmp_path, tiny_model_dir)
    engine = RecordingEngine(EmbeddedEngine(tiny_model_dir, cfg.engine.embedded))
    samples, leases = _run(tmp_path, cfg, engine)
    engine.close()
    tokenizer = load_tokenizer(tiny_model_dir)
    by_sample = {where: lease for lease, where in leases.items()}
    assert len(samples) == STEPS * PROMPTS * SAMPLES
    versions_seen = set()
    for s in samples:
        lease = by_sample[(s.group_id, s.sample_index)]
        prompt = engine.contexts[lease][0]
        assert s.token_ids[: len(prompt)] == prompt and not any(s.loss_mask[: len(prompt)])
        # The model's tokens are the engine's, with their logprobs and versions, exactly.
        model = [
            (t, lp, v) for t, lp, v, m in zip(s.token_ids, s.logprobs, s.versions, s.loss_mask) if m
        ]
        assert model == engine.sampled[lease]
        # Each turn's request was the sequence so far, and each observation (logprob 0,
        # version -1) is the environment's answer to the turn before it, tokenized alone.
        runs = _runs(s.loss_mask, len(prompt))
        turn_starts = [lo for lo, _, m in runs if m]
        assert engine.contexts[lease] == [s.token_ids[:lo] for lo in turn_starts]
        for (lo, hi, m), nxt in zip(runs, runs[1:] + [None]):
            if not m:
                assert s.logprobs[lo:hi] == [0.0] * (hi - lo) and s.versions[lo:hi] == [-1] * (
                    hi - lo
                )
                continue
            if nxt is not None:
                text = tokenizer.decode(s.token_ids[lo:hi], skip_special_tokens=True)
                expected = tokenizer(Counter.log[text], add_special_tokens=False)["input_ids"]
                assert s.token_ids[nxt[0] : nxt[1]] == expected
        assert sum(m for _, _, m in runs) == 3 or s.finish_reason == "length"
        versions_seen.add(len({v for v, m in zip(s.versions, s.loss_mask) if m}))
        # As the RL step receives it: the same tokens, loss mask and behavior logprobs,
        # and no advantage on an observation.
        (seq,) = to_sequences([s], RLConfig(), cfg.sampling.max_new_tokens)
        assert (seq.input_ids, seq.loss_mask) == (s.token_ids, s.loss_mask)
        assert seq.fields["behavior"] == s.logprobs
        assert all(a == 0 for a, m in zip(seq.fields["advantages"], s.loss_mask) if not m)
    assert max(versions_seen) >= 2, "no episode saw the weights change under it"


def test_an_episode_continues_elsewhere_with_its_earlier_turns_unchanged(tmp_path, tiny_model_dir):
    """The first generator dies mid-run (it stops without a word); the buffer re-issues
    its episodes to a second one, which rebuilds each environment from the example and
    the recorded turns and continues: every such episode starts with the dead
    generator's whole turns, as it sampled them, and goes on with the new one's."""
    cfg = _config(tmp_path, tiny_model_dir)
    cfg.buffer.heartbeat_timeout_s = 1.0
    first = RecordingEngine(EmbeddedEngine(tiny_model_dir, cfg.engine.embedded))
    second = RecordingEngine(EmbeddedEngine(tiny_model_dir, cfg.engine.embedded))
    samples, leases = _run(tmp_path, cfg, first, second)
    first.close()
    second.close()
    continued = 0
    for s in samples:
        held = [lease for lease, where in leases.items() if where == (s.group_id, s.sample_index)]
        model = [t for t, m in zip(s.token_ids, s.loss_mask) if m]
        done = 0  # model tokens accounted for by the leases before
        for j, lease in enumerate(held):  # in the order they were issued
            engine = first if lease in first.contexts else second
            sampled = [t for t, _, _ in engine.sampled[lease]]
            if j + 1 == len(held):
                kept = len(model) - done
            else:  # the next holder was asked with everything this one sent
                nxt = held[j + 1]
                prefix = (first if nxt in first.contexts else second).contexts[nxt][0]
                assert s.token_ids[: len(prefix)] == prefix
                kept = sum(s.loss_mask[: len(prefix)]) - done
                continued += kept > 0
            assert model[done : done + kept] == sampled[:kept]
            done += kept
        assert done == len(model)
    assert continued >= 1, "no episode was continued after a complete turn"


def test_an_agent_written_with_the_openai_client_is_trained_as_an_episode(tmp_path, chat_model_dir):
    """An agent that calls the chat completions API (``tests.episode_envs.LengthAgent``)
    runs in the generator against the capture endpoint: each of its calls is a model
    turn, each message it adds an observation, its return the reward, and the trainer
    gets the episode as the engine sampled it."""
    environment = "tests.episode_envs:LengthAgent"
    task = dict(environment=environment, prompt_format="chat", max_episode_tokens=120)
    cfg = _config(tmp_path, chat_model_dir, **task)
    cfg.engine.embedded.max_seq_len = 200
    engine = RecordingEngine(EmbeddedEngine(chat_model_dir, cfg.engine.embedded))
    samples, leases = _run(tmp_path, cfg, engine, steps=2)
    engine.close()
    tokenizer = load_tokenizer(chat_model_dir)
    replies = {m[-1]["content"]: m for m in LengthAgent.transcripts}
    for s in samples:
        lease = next(k for k, v in leases.items() if v == (s.group_id, s.sample_index))
        model = [t for t, m in zip(s.token_ids, s.loss_mask) if m]
        assert model == [t for t, _, _ in engine.sampled[lease]]
        first, observed, second = _runs(s.loss_mask, len(engine.contexts[lease][0]))
        text = [
            tokenizer.decode(s.token_ids[lo:hi], skip_special_tokens=True)
            for lo, hi, _ in (first, observed, second)
        ]
        transcript = replies[text[2]]  # the agent saw the engine's turns
        assert transcript[1]["content"] == text[0]
        assert transcript[2]["content"] in text[1] and not observed[2]
        assert s.reward == float(len(transcript[3]["content"]) > len(transcript[1]["content"]))


def _runs(mask: list[int], start: int) -> list[tuple[int, int, int]]:
    runs = []
    for i in range(start, len(mask)):
        if runs and runs[-1][2] == mask[i] and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1, mask[i])
        else:
            runs.append((i, i + 1, mask[i]))
    return runs
