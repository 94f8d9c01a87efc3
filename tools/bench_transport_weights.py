"""Weights broadcast over PUB/SUB (half of ``tools/bench_transport.py``).

A state dict of ``--tensors`` float32 tensors of ``--tensor-numel`` elements is
published with ``encode_tensors`` on a PUB socket to ``--subscribers`` processes that
receive the multipart message and rebuild the tensors with ``decode_tensors`` (zero-copy
views of the frames), as a generator does. Slow joiners are handled by a handshake before
any timing: the bench publishes tensor-less hellos until every subscriber has answered
over a PUSH socket. Each subscriber then reports, for each update, the ``time.monotonic``
at which its tensors were rebuilt; a run lasts from just before ``encode_tensors`` to the
latest of those times. ``--weights-warmup`` broadcasts go first, untimed (a receiver's
first update pays page faults on fresh buffers; later ones are the steady state).
``weights_gb_per_s`` = state dict bytes / that time (GB = 1e9 bytes), per broadcast: the
bytes are not multiplied by the number of subscribers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import zmq
from bench_transport_common import RUN_ID, WAIT_S

from asyncrl.transport import TransportConfig, bind, make_socket
from asyncrl.weights.frames import decode_tensors, encode_tensors
from asyncrl.wire import WeightsAnnounce, WireDecoder, encode

HELLO, STOP = -1, -2  # WeightsAnnounce versions that carry no tensors


# ---- weights subscribers (child processes) ---------------------------------------------
def subscriber_main(index: int, pub_endpoint: str, report_endpoint: str) -> None:
    """Receive updates as a generator does; report when each one's tensors are rebuilt."""
    ctx = zmq.Context()
    try:
        transport = TransportConfig()
        sub = make_socket(ctx, zmq.SUB, transport, max_message_bytes=transport.max_weights_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub_endpoint)
        report = make_socket(ctx, zmq.PUSH, TransportConfig())
        report.connect(report_endpoint)
        decoder = WireDecoder(RUN_ID, expected=WeightsAnnounce)
        greeted = False
        while sub.poll(int(WAIT_S * 1000)):
            frames = sub.recv_multipart(copy=False)
            announce = decoder.decode(frames[0].buffer)
            if announce.version == STOP:
                break
            if announce.version == HELLO:
                if not greeted:
                    report.send_json({"subscriber": index, "version": HELLO})
                greeted = True
                continue
            tensors = decode_tensors(announce, [f.buffer for f in frames[1:]])
            done = time.monotonic()
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            report.send_json(
                {"subscriber": index, "version": announce.version, "time": done, "bytes": nbytes}
            )
            del tensors, frames
    finally:
        ctx.destroy(linger=0)


def weights_runs(args: argparse.Namespace, work: Path, children: list) -> tuple[list[float], int]:
    """GB/s of each broadcast, and the state dict's size in bytes."""
    import torch

    state = {f"layer{i}.weight": torch.rand(args.tensor_numel) for i in range(args.tensors)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    transport = TransportConfig()
    ctx = zmq.Context()
    try:
        pub = make_socket(ctx, zmq.PUB, transport)
        pull = make_socket(ctx, zmq.PULL, transport)
        endpoints = [bind(pub, transport, work, "weights"), bind(pull, transport, work, "reports")]
        spawn = mp.get_context("spawn")
        procs = [
            spawn.Process(target=subscriber_main, args=(i, *endpoints), daemon=True)
            for i in range(args.subscribers)
        ]
        for proc in procs:
            proc.start()
            children.append(proc)
        handshake(pub, pull, args.subscribers)
        seconds = [
            broadcast(pub, pull, state, version, args.subscribers)
            for version in range(1, args.weights_warmup + args.runs + 1)
        ]
        pub.send_multipart([encode(WeightsAnnounce(run_id=RUN_ID, version=STOP, tensors=[]))])
        for proc in procs:
            proc.join(timeout=10)
    finally:
        ctx.destroy(linger=0)
    return [nbytes / 1e9 / s for s in seconds[args.weights_warmup :]], nbytes


def broadcast(
    pub: zmq.Socket, pull: zmq.Socket, state: dict[str, Any], version: int, subscribers: int
) -> float:
    """Seconds from publishing ``state`` until every subscriber has rebuilt it."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    start = time.monotonic()
    pub.send_multipart(encode_tensors(version, RUN_ID, state), copy=False)
    reports = [r for r in collect(pull, subscribers) if r["version"] == version]
    if len(reports) != subscribers or any(r["bytes"] != nbytes for r in reports):
        raise RuntimeError(f"update {version} was not rebuilt whole everywhere: {reports}")
    return max(r["time"] for r in reports) - start


def handshake(pub: zmq.Socket, pull: zmq.Socket, subscribers: int) -> None:
    """Publish hellos until every subscriber has one (PUB drops what no one hears yet)."""
    hello = encode(WeightsAnnounce(run_id=RUN_ID, version=HELLO, tensors=[]))
    greeted: set[int] = set()
    deadline = time.monotonic() + WAIT_S
    while len(greeted) < subscribers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(greeted)} of {subscribers} subscribers joined")
        pub.send(hello)
        while pull.poll(50):
            greeted.add(pull.recv_json()["subscriber"])


def collect(pull: zmq.Socket, count: int) -> list[dict[str, Any]]:
    reports = []
    while len(reports) < count:
        if not pull.poll(int(WAIT_S * 1000)):
            raise TimeoutError("a subscriber never reported")
        report = pull.recv_json()
        if report["version"] != HELLO:  # a late answer to the handshake
            reports.append(report)
    return reports
