"""Faults with real processes and SIGKILL: a generator killed mid-sample has its tokens
continued by another (not regenerated), and a buffer killed mid-run comes back from its
saved state plus its write-ahead log with everything it had accepted. Trainer restarts
keep the launch's clock. (``tests/test_chaos.py`` kills all three kinds in one run.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch
import zmq

from asyncrl.buffer.config import BufferConfig, RolloutConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.buffer.scoring import InlineScoring
from asyncrl.buffer.server import BufferServer
from asyncrl.buffer.wal import Chunked, Rewarded, read_events
from asyncrl.config import save_json
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.embedded import EmbeddedEngineConfig
from asyncrl.engine.leases import SamplingConfig
from asyncrl.models import ModelConfig, load_model
from asyncrl.stages.common import stage_clock
from asyncrl.tasks import TaskConfig, build_task
from asyncrl.tasks.stream import TaskPrompts
from asyncrl.transport import TransportConfig, make_socket, read_endpoints
from asyncrl.wire import Chunk, LeaseRequest, WireDecoder, encode
from tests.runs import wait_for

PREFIX, PREFIX_VERSION, PREFIX_LOGPROB = [11, 12, 13, 14, 15], 7, -0.5

# A generator that streams the first tokens of its lease and then hangs (heartbeating)
# until it is killed: what the buffer sees of a generator killed mid-sample.
DYING_GENERATOR = textwrap.dedent("""
    import sys, time, zmq
    from asyncrl.transport import TransportConfig, make_socket, read_endpoints
    from asyncrl.wire import Chunk, Heartbeat, LeaseRequest, WireDecoder, encode
    run_dir, prefix, version, logprob = sys.argv[1], eval(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    t, ctx = TransportConfig(), zmq.Context()
    ends = read_endpoints(run_dir, "buffer")
    push, dealer = make_socket(ctx, zmq.PUSH, t), make_socket(ctx, zmq.DEALER, t, identity="g0")
    push.connect(ends["chunks"]); dealer.connect(ends["leases"])
    dealer.send(encode(LeaseRequest(run_id="f", worker_id="g0", capacity=1)))
    lease = WireDecoder("f").decode(dealer.recv()).leases[0]
    push.send(encode(Chunk(run_id="f", worker_id="g0", lease_id=lease.lease_id, seq=0, token_ids=prefix,
                           logprobs=[logprob] * len(prefix), versions=[version] * len(prefix))))
    while True:
        push.send(encode(Heartbeat(run_id="f", worker_id="g0", kind="generator", version=version)))
        time.sleep(0.1)
""")


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def test_a_killed_generators_partial_sample_is_continued_not_restarted(tmp_path, tiny_model_dir):
    """One sample, greedy: the first holder streams 5 tokens (version 7) and is SIGKILLed;
    a real generator process gets the lease with those tokens as its prefix and continues.
    The sample keeps its first tokens with their versions and logprobs, and the rest is
    the model's greedy continuation of prompt + prefix, with matching logprobs."""
    cfg = RolloutConfig(
        run_dir=str(tmp_path),
        run_id="f",
        model=ModelConfig(path=tiny_model_dir),
        task=TaskConfig(train_size=50, eval_size=10),
        buffer=BufferConfig(
            prompts_per_batch=1,
            samples_per_prompt=1,
            max_staleness=0,
            heartbeat_timeout_s=1.0,
        ),
        sampling=SamplingConfig(max_new_tokens=20, temperature=0.0),
        transport=TransportConfig(chunk_tokens=4, chunk_ms=20.0, heartbeat_s=0.2),
        engine=EngineConfig(embedded=EmbeddedEngineConfig(max_slots=2, max_seq_len=128, threads=1)),
    )
    config_path = tmp_path / "rollout.json"
    save_json(cfg, config_path)
    prompts = TaskPrompts(build_task(cfg.task), tiny_model_dir, cfg.seed)
    buffer = RolloutBuffer(cfg.buffer, "f", prompts, cfg.sampling.spec())
    server = BufferServer(cfg, buffer, InlineScoring(lambda *_: 1.0))
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    procs = []
    try:
        dying = subprocess.Popen(
            [
                sys.executable,
                "-c",
                DYING_GENERATOR,
                str(tmp_path),
                repr(PREFIX),
                str(PREFIX_VERSION),
                str(PREFIX_LOGPROB),
            ],
            env=_env(),
        )
        procs.append(dying)
        groups = buffer.state.groups
        slot = lambda: next(iter(groups.values())).slots[0] if groups else None  # noqa: E731
        wait_for(
            lambda: slot() is not None and len(slot().token_ids) == len(PREFIX), 60, "the prefix"
        )
        dying.send_signal(signal.SIGKILL)
        dying.wait()
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "asyncrl.generator.worker",
                "--config",
                str(config_path),
                "--worker-id",
                "g1",
            ],
            env=_env(),
        )
        procs.append(worker)
        # Scored inline when it finishes: the group is ready for a batch then.
        wait_for(lambda: len(buffer.state.ready) == 1, 120, "the sample to finish")
        sample = buffer.batches.batch_for(0, 0, 1)[0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        server.stop()
        serving.join(timeout=30)
    prompt_len = sample.loss_mask.index(1)
    completion = sample.token_ids[prompt_len:]
    assert buffer.state.counts["leases_reissued"] == 1
    assert completion[: len(PREFIX)] == PREFIX  # kept, not regenerated
    assert sample.versions[prompt_len : prompt_len + len(PREFIX)] == [PREFIX_VERSION] * len(PREFIX)
    assert sample.logprobs[prompt_len : prompt_len + len(PREFIX)] == [PREFIX_LOGPROB] * len(PREFIX)
    rest = completion[len(PREFIX) :]
    assert 0 < len(rest) <= cfg.sampling.max_new_tokens - len(PREFIX)
    assert set(sample.versions[prompt_len + len(PREFIX) :]) == {0}  # the new holder's weights
    # The continuation is the model's greedy one after prompt + prefix, step by step.
    model = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu")).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sample.token_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    for i, token in enumerate(rest):
        at = prompt_len + len(PREFIX) + i - 1  # the position that predicts this token
        assert token == int(logits[at].argmax()), f"token {i} of the continuation is not greedy"
        assert abs(sample.logprobs[at + 1] - float(logprobs[at, token])) < 1e-3


def _start_buffer(config_path: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl.buffer.server", "--config", str(config_path)],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env=_env(),
    )


def test_a_sigkilled_buffer_comes_back_with_everything_it_accepted(tmp_path, tiny_model_dir):
    """The state is saved only at start and exit here (checkpoint_s is long), so what the
    buffer accepted between its start and a SIGKILL survives through the log alone: the
    leases it issued still take chunks, streamed tokens count, a finished sample is
    scored, and the prompt stream goes on where it was."""
    cfg = RolloutConfig(
        run_dir=str(tmp_path),
        run_id="w",
        model=ModelConfig(path=tiny_model_dir),
        task=TaskConfig(train_size=100, eval_size=10),
        buffer=BufferConfig(
            prompts_per_batch=2, samples_per_prompt=2, heartbeat_timeout_s=60, checkpoint_s=3600
        ),
        reward=RewardConfig(workers=0),  # the verifier inline: scored within a loop turn
    )
    config_path = tmp_path / "rollout.json"
    save_json(cfg, config_path)
    t, log = cfg.transport, tmp_path / "buffer.log"
    ctx = zmq.Context()
    buffer = _start_buffer(config_path, log)
    try:
        ends = read_endpoints(tmp_path, "buffer", timeout_s=180)
        dealer = make_socket(ctx, zmq.DEALER, t, identity="g0")
        push = make_socket(ctx, zmq.PUSH, t)
        dealer.connect(ends["leases"])
        push.connect(ends["chunks"])
        dealer.send(encode(LeaseRequest(run_id="w", worker_id="g0", capacity=3)))
        assert dealer.poll(60_000)
        leases = WireDecoder("w").decode(dealer.recv()).leases

        def chunk(lease, seq, ids, done=False):
            return encode(
                Chunk(
                    run_id="w",
                    worker_id="g0",
                    lease_id=lease.lease_id,
                    seq=seq,
                    token_ids=ids,
                    logprobs=[-1.0] * len(ids),
                    versions=[0] * len(ids),
                    finished=done,
                    finish_reason="stop" if done else None,
                )
            )

        push.send(chunk(leases[0], 0, [5, 6]))
        push.send(chunk(leases[1], 0, [7], done=True))
        wal = lambda: b"".join(p.read_bytes() for p in (tmp_path / "buffer_wal").glob("*.wal"))  # noqa: E731
        wait_for(
            lambda: sum(isinstance(e, Chunked) for e in read_events(wal())) == 2, 60, "the log"
        )
        buffer.send_signal(signal.SIGKILL)
        buffer.wait()
        assert not (tmp_path / "buffer_counters.json").exists()  # it had no chance to save
        buffer = _start_buffer(config_path, log)
        push.send(chunk(leases[0], 1, [8], done=True))  # the lease from before the kill
        g1 = make_socket(ctx, zmq.DEALER, t, identity="g1")
        g1.connect(ends["leases"])
        g1.send(encode(LeaseRequest(run_id="w", worker_id="g1", capacity=1)))
        assert g1.poll(180_000)
        grant = WireDecoder("w").decode(g1.recv())
        # The last sample of the first two prompts: not a lease the dead process issued.
        assert (grant.leases[0].group_id, grant.leases[0].sample_index) == (1, 1)
        wait_for(lambda: "restored" in log.read_text(), 30, "the restore message")
        # The chunk sent after the restart finishes leases[0]'s sample; its reward is logged
        # in the loop turn that applied the chunk and scored any sample the replay left
        # unscored, so once it is in the log the counters below are final.
        key = (leases[0].group_id, leases[0].sample_index)
        segments = lambda: (tmp_path / "buffer_wal").glob("*.wal")  # noqa: E731
        wait_for(
            lambda: any(
                isinstance(e, Rewarded) and tuple(e.key) == key
                for p in segments()
                for e in read_events(p.read_bytes())
            ),
            60,
            "the reward of the sample finished after the restart",
        )
    finally:
        ctx.destroy(linger=0)
        buffer.send_signal(signal.SIGTERM)
        buffer.wait(timeout=60)
    counters = json.loads((tmp_path / "buffer_counters.json").read_text())
    assert counters["buffer/leases_issued"] == 4
    assert counters["buffer/tokens_received"] == 4  # 2 + 1 before the kill, 1 after
    assert counters["buffer/samples_scored"] == 2  # both finished samples, once each
    assert counters["buffer/samples_created"] == 4
    assert counters.get("buffer/chunks_unknown_lease", 0) == 0


def test_trainer_ranks_restarted_by_one_launch_keep_its_clock(tmp_path, monkeypatch, dist_info):
    """``time_limit_s`` and logged times count from the first trainer start of a launch:
    a restarted trainer reads that start back; a new launch starts a new clock."""
    monkeypatch.setenv("ASYNCRL_LAUNCH_ID", "launch-1")
    first = stage_clock(str(tmp_path), dist_info)
    time.sleep(0.05)
    assert stage_clock(str(tmp_path), dist_info) == first  # the restarted process
    monkeypatch.setenv("ASYNCRL_LAUNCH_ID", "launch-2")
    second = stage_clock(str(tmp_path), dist_info)
    assert second != first  # relaunched: a fresh clock, saved for this launch's restarts
    saved = json.loads((tmp_path / "clock.json").read_text())
    assert saved == {"launch": "launch-2", "start": second}
