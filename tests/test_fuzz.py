"""Fuzz every ZeroMQ socket that receives messages with random, truncated, mistyped,
wrong-version, wrong-run, misplaced and multi-frame messages: the buffer process's three
sockets, a generator process's lease DEALER and weights SUB, a trainer rank's DEALER
(``BufferClient``) and the trainer's weights PUB. None crashes, each bad frame is counted
by kind, and each keeps serving good ones. (A generator's PUSH only sends.)

Why one file: one method, applied to every socket that receives: the same generators of bad
frames against each process in turn.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import msgspec
import torch
import zmq

from asyncrl.buffer.client import BufferClient
from asyncrl.buffer.config import BufferConfig, RolloutConfig
from asyncrl.config import save_json
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.embedded import EmbeddedEngineConfig
from asyncrl.engine.leases import SamplingConfig
from asyncrl.interfaces import FullParameters
from asyncrl.models import ModelConfig
from asyncrl.tasks import TaskConfig
from asyncrl.transport import (
    RunSite,
    TransportConfig,
    bind,
    make_socket,
    read_endpoints,
    write_endpoints,
)
from asyncrl.weights.receiver import WeightsReceiver
from asyncrl.weights.sender import BucketPublisher
from asyncrl.wire import (
    PROTOCOL_VERSION,
    Batch,
    BatchRequest,
    Chunk,
    Heartbeat,
    Lease,
    LeaseGrant,
    LeaseRequest,
    Sample,
    SamplingSpec,
    TensorMeta,
    VersionAnnounce,
    WeightsAnnounce,
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


def bad_weights(rng: random.Random) -> list[list[bytes]]:
    """Weight updates a generator must count and drop (each once): garbage, a truncated or
    foreign header, and headers whose tensor frames do not match them."""

    def announce(tensors, **kw) -> bytes:
        fields = {"run_id": RUN, "version": 5, "tensors": tensors, **kw}
        return encode(WeightsAnnounce(**fields))

    meta = [TensorMeta("w", "float32", [4])]
    cases = [
        [bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))), b"x" * 8] for _ in range(10)
    ]
    cases += [
        [announce(meta)[:-3], b"x" * 16],  # truncated header
        [announce(meta, run_id="someone-else"), b"x" * 16],
        [announce(meta, protocol=PROTOCOL_VERSION + 7), b"x" * 16],
        [encode(VersionAnnounce(run_id=RUN, version=5))],  # not a weights message
        [announce(meta)],  # a tensor frame missing
        [announce(meta), b"x" * 15],  # the wrong size for its shape
        [announce([TensorMeta("w", "float99", [4])]), b"x" * 16],  # no such dtype
        [announce([TensorMeta("w", "Tensor", [4])]), b"x" * 16],  # not a dtype
    ]
    rng.shuffle(cases)
    return cases


def _config(tmp_path, model_dir: str) -> RolloutConfig:
    return RolloutConfig(
        run_dir=str(tmp_path),
        run_id=RUN,
        model=ModelConfig(path=model_dir),
        task=TaskConfig(train_size=100, eval_size=10),
        buffer=BufferConfig(prompts_per_batch=2, samples_per_prompt=2),
        sampling=SamplingConfig(max_new_tokens=8),
        transport=TransportConfig(heartbeat_s=0.1),
        engine=EngineConfig(embedded=EmbeddedEngineConfig(max_slots=2, max_seq_len=64, threads=1)),
    )


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
        chunk = encode(
            Chunk(
                run_id=RUN,
                worker_id="x",
                lease_id="none",
                seq=0,
                token_ids=[1],
                logprobs=[0.0],
                versions=[0],
            )
        )
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
    pub = make_socket(ctx, zmq.XPUB, cfg.transport)  # a PUB that sees subscriptions
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
        assert pub.poll(30_000) and pub.recv() == b"\x01", "the generator never subscribed"
        weights = bad_weights(rng)
        for frames in weights:
            pub.send_multipart(frames)
        sent += len(weights)
        # A good lease after all that: the generator streams its tokens back.
        identity, _ = router.recv_multipart()
        lease = Lease(
            run_id=RUN,
            lease_id="L",
            prompt_id=0,
            group_id=0,
            sample_index=0,
            prompt_ids=[5, 6, 7],
            sampling=SamplingSpec(max_new_tokens=5),
        )
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
        assert beat is not None and beat.counters["bad_frames"] == sent, beat
        assert proc.poll() is None, "the generator died"
    finally:
        ctx.destroy(linger=0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, (tmp_path / "gen.log").read_text()[-3000:]


def test_fuzzing_a_trainer_rank(tmp_path):
    """A fake buffer answers a trainer rank's BatchRequest with garbage, another protocol's
    and another run's batches and another step's batch before the right one: the rank's
    ``BufferClient`` counts and drops the bad frames, skips the other step's (a repeated
    answer), and returns the right batch."""
    transport = TransportConfig()
    ctx = zmq.Context()
    router = make_socket(ctx, zmq.ROUTER, transport)
    endpoint = bind(router, transport, tmp_path, "t")
    write_endpoints(tmp_path, "buffer", {"chunks": "", "leases": "", "trainer": endpoint})
    client = BufferClient(str(tmp_path), RUN, rank=0, transport=transport)
    got: list[Batch] = []
    thread = threading.Thread(target=lambda: got.append(client.request_batch(3, 1, timeout_s=60)))
    thread.start()
    try:
        assert router.poll(30_000), "no BatchRequest"
        identity, request = router.recv_multipart()
        assert WireDecoder(RUN).decode(request) == BatchRequest(
            run_id=RUN, step=3, rank=0, world_size=1
        )
        sample = Sample(
            prompt_id=0,
            group_id=0,
            sample_index=0,
            token_ids=[5, 6],
            logprobs=[0.0, -1.0],
            versions=[-1, 0],
            loss_mask=[0, 1],
            reward=1.0,
        )
        good = Batch(run_id=RUN, step=3, rank=0, samples=[sample])
        expected: Counter[str] = Counter()
        misplaced = encode(VersionAnnounce(run_id=RUN, version=1))
        for kind, frames in bad_frames(random.Random(2), encode(good), misplaced):
            if kind == "frames":
                continue  # a DEALER reads frame by frame: each is judged on its own
            router.send_multipart([identity, *frames])
            # It expects only a Batch: any other message is undecodable to it.
            expected["decode"] += 1
        for kind, batch in (
            (
                "protocol",
                Batch(run_id=RUN, step=3, rank=0, samples=[], protocol=PROTOCOL_VERSION + 1),
            ),
            ("run_id", Batch(run_id="someone-else", step=3, rank=0, samples=[])),
        ):
            router.send_multipart([identity, encode(batch)])
            expected[kind] += 1
        router.send_multipart([identity, encode(Batch(run_id=RUN, step=2, rank=0, samples=[]))])
        router.send_multipart([identity, encode(good)])
        thread.join(timeout=60)
        assert got == [good]
        assert client.decoder.errors == expected
    finally:
        thread.join(timeout=60)
        client.close()
        ctx.destroy(linger=0)


def test_fuzzing_the_weights_publisher(tmp_path):
    """Strangers' frames on the trainer's PUB socket, where only subscriptions come in:
    garbage, unsubscriptions, multi-frame and oversized ones. A generator's SUB still
    receives the next version intact."""
    transport = TransportConfig(max_message_bytes=1 << 16)
    transport.weights.anchor_every = 1  # a late subscriber then needs no anchor request
    site = RunSite(str(tmp_path), RUN, transport)
    publisher = BucketPublisher(site)
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    publisher.publish(0, FullParameters.of(state))  # binds the sockets
    ctx = zmq.Context()
    try:
        endpoint = read_endpoints(tmp_path, "trainer", timeout_s=10)["weights"]
        rng = random.Random(3)
        xsub = make_socket(ctx, zmq.XSUB, transport)
        xsub.connect(endpoint)
        for _ in range(50):
            xsub.send_multipart(
                [
                    bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
                    for _ in range(rng.randint(1, 3))
                ]
            )
        xsub.send(b"\x00")  # an unsubscription from nothing
        xsub.send(b"\x01" + b"x" * (1 << 17))  # over the size limit: the connection is dropped
        sub = make_socket(ctx, zmq.SUB, transport, max_message_bytes=transport.max_weights_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        receiver, received, version = WeightsReceiver(timeout_s=30), None, 0
        deadline = time.time() + 30
        while received is None and time.time() < deadline:
            version += 1  # PUB drops what it sends before the subscription lands
            publisher.publish(version, FullParameters.of(state))
            if sub.poll(200):
                frames = sub.recv_multipart()
                received = receiver.accept(WireDecoder(RUN).decode(frames[0]), frames[1])
        assert received is not None, "the SUB never received the weights"
        assert torch.equal(received[1]["w"], state["w"])
    finally:
        ctx.destroy(linger=0)
        publisher.close()
