"""Weights in buckets, by deltas: the trainer's publisher and a generator's intake over real
ZeroMQ sockets, with real optimizer steps in between; the receiver's rules one by one.

Why one file: one path, weights in buckets by deltas from the trainer's publisher to a
generator's intake, over the same sockets and optimizer steps in every case.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
import zmq

from asyncrl.buffer.config import RolloutConfig
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.generator.stats import GeneratorStats
from asyncrl.generator.weights import WeightsIntake
from asyncrl.interfaces import FullParameters
from asyncrl.models import ModelConfig, load_model
from asyncrl.trainer.publish import NoWeightPublisher
from asyncrl.transport import WeightSyncConfig
from asyncrl.weights import codec
from asyncrl.weights.receiver import NeedAnchor, WeightsReceiver
from asyncrl.weights.sender import BucketPublisher
from asyncrl.wire import WeightsBucket
from tests.runs import wait_for


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One real AdamW step on a next-token loss over random tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _params(model: torch.nn.Module) -> FullParameters:
    return FullParameters.of({n: p.detach() for n, p in model.named_parameters()})


def _sync_run(tmp_path, model_dir, weights: WeightSyncConfig, versions: int, corrupt=None):
    """Publish ``versions`` versions, a training step before each, into a generator's
    intake and engine; returns (trainer model, engine, intake, publisher)."""
    cfg = RolloutConfig(run_dir=str(tmp_path), run_id="ws")
    cfg.transport.weights = weights
    trainer = load_model(ModelConfig(path=model_dir))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    engine = EmbeddedEngine(model_dir, EmbeddedEngineConfig(max_slots=1, max_seq_len=32))
    publisher, ctx, stop = BucketPublisher(cfg.site()), zmq.Context(), threading.Event()
    intake = WeightsIntake(cfg, "g0", engine, GeneratorStats(), ctx, stop)
    try:
        publisher.publish(0, _params(trainer))  # the lineage's first: an anchor
        wait_for(
            lambda: engine.status().staged_version == 0 or intake.receiver.version == 0, poll_s=0.02
        )
        for version in range(1, versions + 1):
            _train(trainer, optimizer, version)
            if corrupt is not None and version == corrupt:
                _corrupt_next_delta(publisher)
            publisher.publish(version, _params(trainer))
            publisher.wait_sent()
            time.sleep(0.05)  # let the intake keep up, as a training step would
        wait_for(lambda: intake.receiver.version == versions and intake.lineage, poll_s=0.02)
        engine.step()  # flips to the staged version at the step boundary
        wait_for(lambda: _flipped(engine, versions), poll_s=0.02)
    finally:
        stop.set()
        intake.join(timeout=5)
        publisher.close()
        ctx.destroy(linger=0)
    return trainer, engine, intake, publisher


def _flipped(engine: EmbeddedEngine, version: int) -> bool:
    engine.step()
    return engine.status().version == version


def _corrupt_next_delta(publisher: BucketPublisher) -> None:
    """Flip one byte of the next delta's first payload on its way out, as a bad link
    would (the publisher's own buffers stay as they are)."""
    original = publisher._send_bucket

    def corrupting(record, slot, anchor, version, base, index, *rest):
        if anchor or index != 0:
            return original(record, slot, anchor, version, base, index, *rest)
        socket, publisher.pub = publisher.pub, _BadLink(publisher.pub)
        try:
            return original(record, slot, anchor, version, base, index, *rest)
        finally:
            publisher.pub = socket

    publisher._send_bucket = corrupting


class _BadLink:
    """A socket whose next multipart message arrives with its payload's last byte flipped."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket

    def send_multipart(self, frames, copy: bool = True) -> None:
        header, payload = frames
        damaged = bytearray(payload)
        damaged[-1] ^= 0xFF
        self.socket.send_multipart([header, bytes(damaged)], copy=copy)


def _engine_params(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return dict(engine.weights.active.model.named_parameters())


def test_after_many_deltas_the_engine_holds_the_trainers_weights_bit_for_bit(
    tmp_path, tiny_model_dir
):
    weights = WeightSyncConfig(bucket_mb=1, anchor_every=6)
    trainer, engine, intake, publisher = _sync_run(tmp_path, tiny_model_dir, weights, 14)
    kinds = [r["kind"] for r in publisher.history]
    assert kinds.count("delta") >= 10 and kinds[0] == "anchor", kinds
    for name, param in trainer.named_parameters():
        assert torch.equal(_engine_params(engine)[name].view(torch.int32), param.view(torch.int32))
    deltas = [r for r in publisher.history if r["kind"] == "delta"]
    assert all(r["bytes"] < r["full_bytes"] for r in deltas)  # the XOR compresses
    # It asked once on joining (nothing received yet), and never for lack of a delta.
    assert intake.anchors_asked <= 1 and not intake.decoder.errors


def test_bf16_on_the_wire_gives_the_trainers_weights_rounded(tmp_path, tiny_model_dir):
    weights = WeightSyncConfig(dtype="bfloat16", bucket_mb=1, anchor_every=4)
    trainer, engine, _, publisher = _sync_run(tmp_path, tiny_model_dir, weights, 6)
    for name, param in trainer.named_parameters():
        rounded = param.detach().to(torch.bfloat16).to(torch.float32)
        assert torch.equal(_engine_params(engine)[name], rounded)
    assert publisher.history[0]["full_bytes"] < sum(
        p.nbytes for p in trainer.parameters()
    )  # half of fp32's, plus alignment


def test_a_corrupted_bucket_is_detected_and_the_anchor_recovers(tmp_path, tiny_model_dir):
    weights = WeightSyncConfig(bucket_mb=1, anchor_every=100)
    trainer, engine, intake, publisher = _sync_run(tmp_path, tiny_model_dir, weights, 6, corrupt=3)
    assert intake.decoder.errors["frames"] >= 1  # the checksum caught it
    assert intake.anchors_asked >= 1 and publisher.anchors_requested >= 1
    assert "anchor" in [r["kind"] for r in publisher.history[1:]]  # sent on request
    for name, param in trainer.named_parameters():
        assert torch.equal(_engine_params(engine)[name], param.detach())


# ---- the receiver's rules ---------------------------------------------------------------
def _buckets(
    flat: torch.Tensor, layout: codec.Layout, version: int, kind: str, base=None, old=None
):
    out = []
    ranges = layout.ranges(256)
    for i, (start, end) in enumerate(ranges):
        new = flat[start:end]
        payload = (
            new.numpy().tobytes()
            if kind == "anchor"
            else codec.encode_delta(new, old[start:end], layout.itemsize, 1)
        )
        header = WeightsBucket(
            run_id="r",
            version=version,
            lineage="L",
            kind=kind,
            base=version if base is None else base,
            index=i,
            count=len(ranges),
            start=start,
            end=end,
            total=layout.total,
            checksum=codec.checksum(new),
            itemsize=layout.itemsize,
            compressed=kind == "delta",
            layout=list(layout.spans) if kind == "anchor" and i == 0 else [],
        )
        out.append((header, payload))
    return out


@pytest.fixture
def versions():
    layout = codec.Layout.of(
        [("a", torch.float32, torch.Size([100])), ("b", torch.float32, torch.Size([30]))]
    )
    gen = torch.Generator().manual_seed(0)
    flats = [torch.randint(0, 256, (layout.total,), dtype=torch.uint8, generator=gen)]
    for _ in range(3):
        nxt = flats[-1].clone()
        nxt[::7] ^= 1
        flats.append(nxt)
    return layout, flats


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (random bytes make NaNs, which ``torch.equal`` calls unequal)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _feed(receiver, buckets):
    result = None
    for header, payload in buckets:
        result = receiver.accept(header, payload)
    return result


def test_receiver_rebuilds_versions_and_refuses_a_delta_it_cannot_apply(versions):
    layout, flats = versions
    receiver = WeightsReceiver(timeout_s=60)
    with pytest.raises(NeedAnchor, match="nothing received"):
        _feed(receiver, _buckets(flats[1], layout, 1, "delta", 0, flats[0]))
    version, tensors = _feed(receiver, _buckets(flats[0], layout, 0, "anchor"))
    assert version == 0 and _same_bytes(tensors["a"], layout.views(flats[0])["a"])
    assert _feed(receiver, _buckets(flats[1], layout, 1, "delta", 0, flats[0]))[0] == 1
    # v2 is missed: the delta v2 -> v3 does not apply to v1.
    with pytest.raises(NeedAnchor, match="mirror holds v1"):
        _feed(receiver, _buckets(flats[3], layout, 3, "delta", 2, flats[2]))
    assert receiver.version == -1 and receiver.waiting
    version, tensors = _feed(receiver, _buckets(flats[3], layout, 3, "anchor"))
    assert version == 3 and _same_bytes(tensors["b"], layout.views(flats[3])["b"])


def test_receiver_refuses_a_gap_and_a_version_stalled_half_way(versions):
    layout, flats = versions
    receiver = WeightsReceiver(timeout_s=5)
    _feed(receiver, _buckets(flats[0], layout, 0, "anchor"))
    delta = _buckets(flats[1], layout, 1, "delta", 0, flats[0])
    assert len(delta) >= 3
    with pytest.raises(NeedAnchor, match="bucket 2 of v1 after bucket 0"):
        _feed(receiver, [delta[0], delta[2]])
    receiver = WeightsReceiver(timeout_s=5)
    _feed(receiver, _buckets(flats[0], layout, 0, "anchor"))
    receiver.accept(*delta[0])
    receiver.expire(time.monotonic() + 1)  # not yet
    with pytest.raises(NeedAnchor, match="stalled: 1 of"):
        receiver.expire(time.monotonic() + 10)


def test_shuffled_xor_delta_round_trips(versions):
    layout, flats = versions
    old, new = flats[0].clone(), flats[2]
    codec.apply_delta(old, codec.encode_delta(new, flats[0], 4, 1), 4, True)
    assert torch.equal(old, new)
    with pytest.raises(ValueError, match="decompress"):
        codec.apply_delta(old, b"not zlib", 4, True)


def test_a_generator_that_joins_between_anchors_asks_for_one(tmp_path, tiny_model_dir):
    """A restarted generator (empty mirror) sees only deltas: it asks, and the trainer's
    sender answers with the newest version whole, while the trainer publishes nothing."""
    cfg = RolloutConfig(run_dir=str(tmp_path), run_id="ws")
    trainer = load_model(ModelConfig(path=tiny_model_dir))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    publisher, ctx, stop = BucketPublisher(cfg.site()), zmq.Context(), threading.Event()
    engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=1, max_seq_len=32))
    intake = None
    try:
        for version in range(3):
            _train(trainer, optimizer, version)
            publisher.publish(version, _params(trainer))
            publisher.wait_sent()  # the trainer's core would wait for the read before a step
        intake = WeightsIntake(cfg, "g0", engine, GeneratorStats(), ctx, stop)
        wait_for(lambda: intake.receiver.version == 2, poll_s=0.02)
        assert publisher.anchors_requested >= 1
        _train(trainer, optimizer, 3)
        publisher.publish(3, _params(trainer))  # a delta on top of the anchor it got
        wait_for(lambda: intake.receiver.version == 3, poll_s=0.02)
        wait_for(lambda: _flipped(engine, 3), poll_s=0.02)
    finally:
        stop.set()
        if intake is not None:
            intake.join(timeout=5)
        publisher.close()
        ctx.destroy(linger=0)
    for name, param in trainer.named_parameters():
        assert torch.equal(_engine_params(engine)[name], param.detach())


def _priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness")
def test_the_parameter_read_keeps_the_trainers_priority_and_the_sending_yields(tmp_path):
    """The next optimizer step waits for the read, so it runs at the trainer's priority;
    encoding and sending, which decode steps overlap, run lower."""
    cfg = RolloutConfig(run_dir=str(tmp_path), run_id="ws")
    state = {"w": torch.randn(64, 64)}
    seen = {}

    def reading():
        seen["read"] = _priority()
        yield from state.items()

    publisher = BucketPublisher(cfg.site())
    real_send = publisher._send_bucket

    def sending(*args):
        seen["send"] = _priority()
        real_send(*args)

    publisher._send_bucket = sending
    try:
        for version in range(2):  # an anchor, then a delta
            publisher.publish(version, FullParameters(FullParameters.of(state).specs, reading()))
            publisher.wait_sent()
    finally:
        publisher.close()
    assert seen["read"] == _priority()
    assert seen["send"] >= min(_priority() + 1, 19)


def test_a_generator_follows_a_restarted_trainer(tmp_path, tiny_model_dir):
    """The trainer dies and another binds the same endpoints with a new lineage: the
    generator takes its weights (the first anchor, or one it asks for) whatever their
    version, though lower than the dead trainer's."""
    cfg = RolloutConfig(run_dir=str(tmp_path), run_id="ws")
    trainer = load_model(ModelConfig(path=tiny_model_dir))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    ctx, stop = zmq.Context(), threading.Event()
    engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=1, max_seq_len=32))
    first = BucketPublisher(cfg.site())
    first.publish(5, _params(trainer))
    intake = WeightsIntake(cfg, "g0", engine, GeneratorStats(), ctx, stop)
    second = None
    try:
        wait_for(lambda: intake.receiver.version == 5, poll_s=0.02)
        first.close()  # the trainer dies; its successor resumes from version 2
        second = BucketPublisher(cfg.site())
        for version in (2, 3, 4):
            _train(trainer, optimizer, version)
            second.publish(version, _params(trainer))
            second.wait_sent()
        wait_for(
            lambda: (intake.receiver.lineage, intake.receiver.version) == (second.lineage, 4),
            poll_s=0.02,
        )
        wait_for(lambda: _flipped(engine, 4), poll_s=0.02)
    finally:
        stop.set()
        intake.join(timeout=5)
        for publisher in (first, second):
            if publisher is not None:
                publisher.close()
        ctx.destroy(linger=0)
    for name, param in trainer.named_parameters():
        assert torch.equal(_engine_params(engine)[name], param.detach())


def test_a_failed_gather_on_another_rank_is_raised_not_printed():
    def failing():
        yield "w", torch.zeros(2)
        raise ConnectionError("peer gone")

    publisher = NoWeightPublisher()
    publisher.publish(3, FullParameters([("w", torch.float32, (2,))], failing()))
    with pytest.raises(RuntimeError, match="v3's parameters failed: peer gone"):
        publisher.publish(4, _params(torch.nn.Linear(1, 1)))
