from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.weights.frames import decode_tensors, encode_tensors
from asyncrl.wire import (
    PROTOCOL_VERSION,
    Chunk,
    Heartbeat,
    Lease,
    LeaseRevoked,
    SamplingSpec,
    VersionAnnounce,
    WeightsAnnounce,
    WireDecoder,
    WireError,
    encode,
)

RUN = "run-1"


def test_every_message_round_trips_with_its_tag():
    lease = Lease(
        run_id=RUN,
        lease_id="l1",
        prompt_id=3,
        group_id=7,
        sample_index=1,
        prompt_ids=[1, 2, 3],
        sampling=SamplingSpec(max_new_tokens=9, temperature=0.7, seed=5),
    )
    chunk = Chunk(
        run_id=RUN,
        worker_id="g0",
        lease_id="l1",
        seq=2,
        token_ids=[4, 5],
        logprobs=[-0.1, -2.0],
        versions=[3, 4],
        finished=True,
        finish_reason="eos",
    )
    beat = Heartbeat(
        run_id=RUN, worker_id="g0", kind="generator", version=4, counters={"tokens": 10.0}
    )
    revoked = LeaseRevoked(run_id=RUN, worker_id="g0", lease_ids=["l1", "l2"])
    decoder = WireDecoder(RUN)
    for message in (lease, chunk, beat, revoked, VersionAnnounce(run_id=RUN, version=2)):
        frame = encode(message)
        assert type(message).__name__.encode() in frame  # tagged by class name
        assert decoder.decode(frame) == message
    assert not decoder.errors


def test_bad_frames_are_counted_by_kind_not_raised():
    decoder = WireDecoder(RUN)
    good = encode(VersionAnnounce(run_id=RUN, version=1))
    assert decoder.try_decode(good[:-3]) is None  # truncated
    assert decoder.try_decode(b"\xc1garbage") is None  # not msgpack
    assert (
        decoder.try_decode(
            msgspec.msgpack.encode({"type": "VersionAnnounce", "run_id": RUN, "version": "x"})
        )
        is None
    )
    assert decoder.try_decode(msgspec.msgpack.encode({"type": "Pickle", "run_id": RUN})) is None
    assert (
        decoder.try_decode(
            encode(VersionAnnounce(run_id=RUN, version=1, protocol=PROTOCOL_VERSION + 1))
        )
        is None
    )
    assert decoder.try_decode(encode(VersionAnnounce(run_id="other", version=1))) is None
    assert decoder.errors == {"decode": 4, "protocol": 1, "run_id": 1}
    with pytest.raises(WireError) as err:
        decoder.decode(b"")
    assert err.value.kind == "decode"


def test_a_decoder_for_one_type_refuses_the_others():
    decoder = WireDecoder(RUN, expected=Chunk)
    assert decoder.try_decode(encode(VersionAnnounce(run_id=RUN, version=1))) is None
    assert decoder.errors["decode"] == 1


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(data):
    decoder = WireDecoder(RUN)
    result = decoder.try_decode(data)
    assert result is None or result.run_id == RUN
    assert sum(decoder.errors.values()) == (result is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
def test_tensors_travel_as_raw_frames(dtype):
    tensors = {
        "a": torch.randn(3, 4).to(dtype),
        "b.c": torch.arange(5).to(dtype),
        "empty": torch.zeros(0, 2, dtype=dtype),
    }
    header, *frames = encode_tensors(7, RUN, tensors)
    announce = WireDecoder(RUN).decode(header)
    assert isinstance(announce, WeightsAnnounce) and announce.version == 7
    assert len(header) < 200  # the header holds metadata only
    out = decode_tensors(announce, [bytes(f) for f in frames])
    for name, t in tensors.items():
        assert out[name].dtype == dtype and torch.equal(out[name], t)


def test_tensor_frames_that_do_not_fit_are_refused():
    header, *frames = encode_tensors(1, RUN, {"w": torch.ones(4)})
    announce = WireDecoder(RUN).decode(header)
    with pytest.raises(WireError, match="bytes for shape"):
        decode_tensors(announce, [bytes(frames[0])[:-1]])
    with pytest.raises(WireError, match="frames for"):
        decode_tensors(announce, [])
