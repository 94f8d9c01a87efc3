"""Fuzz the sockets of a real buffer process and a real generator process with random,
truncated, mistyped, wrong-version, wrong-run, misplaced and multi-frame messages:
neither crashes, each bad frame is counted by kind, and both keep serving good ones."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import msgspec
import zmq

from asyncrl.buffer.core import BufferConfig
from asyncrl.config import save_json
from asyncrl.engine.embedded import EngineConfig
from asyncrl.models import ModelConfig
from asyncrl.rollout import RolloutConfig, SamplingConfig
from asyncrl.tasks import TaskConfig
from asyncrl.transport import TransportConfig, bind, make_socket, read_endpoints, write_endpoints
from asyncrl.wire import (
    PROTOCOL_VERSION,
    Chunk,
    Heartbeat,
    Lease,
    LeaseGrant,
    LeaseRequest,
    SamplingSpec,
    VersionAnnounce,
    WireDecoder,
    encode,
)

RUN = "fuzz"


def bad_frames(rng: random.Random, good: bytes, misplaced: bytes) -> list[tuple[str, list[bytes]]]:
    """(expected error kind, frames) pairs; ``good`` is a valid message for the socket."""
    cases: list[tuple[str, list[bytes]]] = []
    for _ in range(30):
        cases.append(("decode", [bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))]))
    for _ in range(10):
        cases.append(("decode", [good[: rng.randrange(len(good))]]))  # truncated
    cases.append(
        ("decode", [msgspec.msgpack.encode({"type": "Chunk", "run_id": RUN, "seq": "one"})])
    )
    cases.append(("decode", [msgspec.msgpack.encode({"type": "Pickled", "run_id": RUN})]))
    cases.append(("decode", [msgspec.msgpack.encode([1, 2, 3])]))
    cases.append(
        (
            "protocol",
            [encode(VersionAnnounce(run_id=RUN, version=1, protocol=PROTOCOL_VERSION + 7))],
        )
    )
    cases.append(("run_id", [encode(VersionAnnounce(run_id="someone-else", version=1))]))
    cases.append(("unexpected", [misplaced]))
    cases.append(("frames", [good, good]))
    rng.shuffle(cases)
    return cases


def _config(tmp_path, model_dir: str) -> RolloutConfig:
    return RolloutConfig(
        run_dir=str(tmp_path), run_id=RUN, model=ModelConfig(path=model_dir),
        task=TaskConfig(train_size=100, eval_size=10), buffer=BufferConfig(prompts_per_batch=2, samples_per_prompt=2),
        sampling=SamplingConfig(max_new_tokens=8), transport=TransportConfig(heartbeat_s=0.1),
        engine=EngineConfig(max_slots=2, max_seq_len=64, threads=1),
    )  # fmt: skip


def _spawn(args: list[str], log) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )


def test_fuzzing_every_buffer_socket(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir)
    save_json(cfg, tmp_path / "rollout.json")
    with open(tmp_path / "buffer.log", "wb") as log:
        proc = _spawn(["asyncrl.buffer.server", "--config", str(tmp_path / "rollout.json")], log)
    rng = random.Random(0)
    expected: Counter[str] = Counter()
    ctx = zmq.Context()
    try:
        endpoints = read_endpoints(tmp_path, "buffer", timeout_s=60)
        push = make_socket(ctx, zmq.PUSH, cfg.transport)
        push.connect(endpoints["chunks"])
        leases = make_socket(ctx, zmq.DEALER, cfg.transport, identity="fuzzer")
        leases.connect(endpoints["leases"])
        trainer = make_socket(ctx, zmq.DEALER, cfg.transport, identity="fuzz-trainer")
        trainer.connect(endpoints["trainer"])
        chunk = encode(Chunk(run_id=RUN, worker_id="x", lease_id="none", seq=0, token_ids=[1], logprobs=[0.0],
                             versions=[0]))  # fmt: skip
        request = encode(LeaseRequest(run_id=RUN, worker_id="fuzzer", capacity=1))
        for sock, good, misplaced in (
            (push, chunk, request),
            (leases, request, chunk),
            (trainer, request, chunk),
        ):
            for kind, frames in bad_frames(rng, good, misplaced):
                sock.send_multipart(frames)
                expected[kind] += 1
        # Still serving: a good lease request is answered.
        leases.send(request)
        assert leases.poll(30_000), "the buffer stopped answering"
        grant = WireDecoder(RUN).decode(leases.recv())
        assert isinstance(grant, LeaseGrant) and len(grant.leases) == 1
    finally:
        ctx.destroy(linger=0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, (tmp_path / "buffer.log").read_text()[-3000:]
    counts = json.loads((tmp_path / "buffer_counters.json").read_text())
    got = {
        k.removeprefix("buffer/bad_frames_"): int(v)
        for k, v in counts.items()
        if "bad_frames_" in k
    }
    assert got == dict(expected)


def test_fuzzing_a_generator(tmp_path, tiny_model_dir):
    """A fake buffer and a fake trainer send the generator garbage lease grants and weight
    updates; it survives, counts them in its heartbeats, and still generates for a good lease."""
    cfg = _config(tmp_path, tiny_model_dir)
    save_json(cfg, tmp_path / "rollout.json")
    ctx = zmq.Context()
    pull = make_socket(ctx, zmq.PULL, cfg.transport)
    router = make_socket(ctx, zmq.ROUTER, cfg.transport)
    pub = make_socket(ctx, zmq.PUB, cfg.transport)
    write_endpoints(
        tmp_path,
        "buffer",
        {
            "chunks": bind(pull, cfg.transport, tmp_path, "c"),
            "leases": bind(router, cfg.transport, tmp_path, "l"),
            "trainer": "",
        },
    )
    write_endpoints(tmp_path, "trainer", {"weights": bind(pub, cfg.transport, tmp_path, "w")})
    with open(tmp_path / "gen.log", "wb") as log:
        proc = _spawn(
            [
                "asyncrl.generator.worker",
                "--config",
                str(tmp_path / "rollout.json"),
                "--worker-id",
                "g",
            ],
            log,
        )
    rng = random.Random(1)
    decoder = WireDecoder(RUN)
    try:
        grant = encode(LeaseGrant(run_id=RUN, leases=[]))
        sent = 0
        for kind, frames in bad_frames(rng, grant, encode(VersionAnnounce(run_id=RUN, version=1))):
            if kind == "frames":
                continue  # a DEALER accepts any frame count; the grant frame itself is judged
            assert router.poll(30_000), "the generator stopped asking for leases"
            identity, _ = router.recv_multipart()
            router.send_multipart([identity, *frames])
            sent += 1
        for _ in range(20):  # garbage weight updates on the PUB socket (some may precede the SUB)
            pub.send_multipart([bytes(rng.randrange(256) for _ in range(16)), b"x" * 8])
        # A good lease after all that: the generator streams its tokens back.
        identity, _ = router.recv_multipart()
        lease = Lease(run_id=RUN, lease_id="L", prompt_id=0, group_id=0, sample_index=0, prompt_ids=[5, 6, 7],
                      sampling=SamplingSpec(max_new_tokens=5), deadline=time.time() + 60)  # fmt: skip
        router.send_multipart([identity, encode(LeaseGrant(run_id=RUN, leases=[lease]))])
        finished, beat = False, None
        deadline = time.time() + 60
        while time.time() < deadline and not (
            finished and beat and beat.counters.get("bad_frames", 0) >= sent
        ):
            if pull.poll(1000):
                msg = decoder.decode(pull.recv())
                finished = finished or (isinstance(msg, Chunk) and msg.finished)
                beat = msg if isinstance(msg, Heartbeat) else beat
        assert finished, "no finished chunk for the good lease"
        assert beat is not None and beat.counters["bad_frames"] >= sent, beat
        assert proc.poll() is None, "the generator died"
    finally:
        ctx.destroy(linger=0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, (tmp_path / "gen.log").read_text()[-3000:]
