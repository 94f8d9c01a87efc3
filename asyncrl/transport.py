"""ZeroMQ transport: endpoints, sockets with bounded queues, and the rendezvous file.

Patterns (docs/architecture.md, Messages): generators PUSH chunks and heartbeats to the
buffer's PULL socket; generators (DEALER) ask the buffer (ROUTER) for leases; trainer ranks
(DEALER) ask the buffer (ROUTER) for batches and announce versions; the trainer PUBlishes
weights that generators SUBscribe to. Endpoints default to ``ipc://`` sockets inside the run
directory (or loopback TCP on ports the OS picks); whoever binds writes its endpoints into
``RUN_DIR/endpoints/ROLE.json`` and the others read them there, so no port is hard-coded.
Across nodes (``launch/slurm.py``) the run directory is on a shared filesystem and
``host="*"`` binds every interface and advertises this node's name.

Sockets are made here: ``server_socket`` for those that bind, ``client_socket`` for those
that connect. Both turn on CURVE (``asyncrl.security``) when ``curve_enabled``, which it is
whenever a socket is reachable from other machines; ``bind`` refuses a non-loopback TCP
bind of a socket without it. Every socket refuses incoming messages over a size limit.
``WeightSyncConfig`` (``transport.weights``) sets how weights travel over them: buckets,
their dtype, anchors and deltas (``asyncrl.weights``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import zmq

from asyncrl import security


@dataclass
class WeightSyncConfig:
    dtype: Literal["train", "bfloat16"] = "train"
    """Dtype on the wire: the training dtype (the engine then runs exactly the trainer's
    weights) or bf16 (half of fp32's bytes; the engine runs them rounded, as a bf16 server
    would, so the behavior logprobs drift further from the trainer's)."""
    bucket_mb: int = 64
    """Size of one bucket (one message): the largest piece of a version held in flight, and
    the unit a checksum covers. A tensor larger than a bucket spans several."""
    anchor_every: int = 50
    """Every this many versions (and a lineage's first) the whole weights go out, not a
    delta; a generator that lost its place waits at most this long without asking. 1 sends
    only anchors."""
    compress_level: int = 1
    """zlib level of the deltas (0: none). XORed neighbours are mostly zero bytes once
    byte-shuffled, so the fastest level already shrinks them several times; higher ones cost
    the sender thread more than they save."""
    timeout_s: float = 120.0
    """How long a generator waits for the rest of a version it has started to receive
    before it drops it and asks for an anchor, and how long ``publish`` waits for the
    sender to finish the previous version before it says what it is waiting for and fails."""

    probe_text: str = ""
    """A fixed text each generator scores after every weight flip and the trainer scores
    with the weights it published; the largest difference of their token logprobs is
    logged (``weights/probe_max_abs_diff``). Empty: no probe. Embedded engines only."""
    probe_alarm: float = 0.1
    """A difference above this many nats is an alarm: an error logged and counted
    (``weights/probe_alarms``). Measured on the CPU: the training dtype on the wire, 0;
    bf16 weights, 0.0008 nats on the test model and 0.013 on Qwen2.5-0.5B's shape."""
    probe_stop: bool = False
    """Stop the run at an alarm instead of going on."""

    def check(self) -> None:
        if self.bucket_mb < 1:
            raise ValueError(f"transport.weights.bucket_mb must be >= 1, got {self.bucket_mb}")
        if self.anchor_every < 1:
            raise ValueError(
                f"transport.weights.anchor_every must be >= 1, got {self.anchor_every}"
            )
        if not 0 <= self.compress_level <= 9:
            raise ValueError(
                f"transport.weights.compress_level must be in 0..9, got {self.compress_level}"
            )
        if self.probe_alarm <= 0:
            raise ValueError(f"transport.weights.probe_alarm must be > 0, got {self.probe_alarm}")
        if self.timeout_s <= 0:
            raise ValueError(f"transport.weights.timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class TransportConfig:
    scheme: Literal["ipc", "tcp"] = "ipc"
    """``ipc``: Unix sockets in the run directory; ``tcp``: ``host`` on ports the OS picks."""
    host: str = "127.0.0.1"
    """Interface the buffer and trainer bind to with ``tcp`` (loopback unless told otherwise);
    ``*`` binds every interface and advertises this node's hostname (``ASYNCRL_HOST``
    overrides the name), for processes spread over several nodes."""
    high_water_mark: int = 10_000
    """Messages queued per socket before senders block (bounded memory)."""
    curve: Literal["auto", "on", "off"] = "auto"
    """ZeroMQ CURVE: encryption, and both ends authenticated by the keys in ``RUN_DIR/keys``
    (``asyncrl.security``). ``auto``: on when ``scheme`` is ``tcp`` and ``host`` is not a
    loopback address, i.e. whenever other machines can reach the sockets; ``on``: always
    (ipc and loopback too); ``off``: never, refused for a non-loopback ``host``."""
    max_message_bytes: int = 256 << 20
    """Incoming frames larger than this are refused (ZeroMQ drops the sender's connection) on
    every socket but the generators' weights SUB. The largest frame is a trainer rank's
    Batch, at most ~20 bytes per token in msgpack (id <= 5, logprob 9, version <= 5, loss
    mask 1): 256 MiB holds ~13M tokens per rank per step, e.g. 256 samples of 32k tokens
    (8.4M). Chunks, requests and heartbeats are under a megabyte."""
    max_weights_bytes: int = 8 << 30
    """The same limit on a generator's weights SUB socket, where each tensor is one frame:
    the largest tensor of a 405B model (its 128256 x 16384 bf16 embedding) is 4.2 GB."""
    chunk_tokens: int = 16
    """A generator flushes a lease's new tokens once this many have accumulated …"""
    chunk_ms: float = 50.0
    """… or once this many milliseconds have passed since its last flush, whichever first."""
    heartbeat_s: float = 1.0
    """Interval of generator heartbeats."""
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Weights to embedded engines: buckets, deltas between anchors, checksums."""


@dataclass(frozen=True)
class RunSite:
    """Where a run's processes meet: its directory (endpoints, sockets, keys), its id
    (carried by every message; another run's are refused) and the transport settings.
    What a component that binds or connects sockets takes instead of the experiment."""

    run_dir: str
    run_id: str
    transport: TransportConfig


def bind(
    sock: zmq.Socket, cfg: TransportConfig, run_dir: str | Path, name: str, previous: str = ""
) -> str:
    """Bind ``sock`` to a fresh endpoint for ``name`` and return the endpoint string. With
    ``previous`` (the endpoint a dead process of the same role had), TCP binds the same
    port again when it is free, so peers that dialed it reconnect by themselves (ipc
    paths are the same anyway)."""
    if cfg.scheme == "ipc":
        directory = Path(run_dir).resolve() / "sockets"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        path.unlink(missing_ok=True)
        endpoint = f"ipc://{path}"
        sock.bind(endpoint)
        return endpoint
    if not security.is_loopback(cfg.host) and not sock.getsockopt(zmq.CURVE_SERVER):
        raise ValueError(
            f"refusing to bind transport.host={cfg.host!r} without CURVE: make the socket with "
            "server_socket (transport.curve=auto or on), or bind a loopback host"
        )
    port = previous.rpartition(":")[2] if previous.startswith("tcp://") else ""
    if port.isdigit():
        try:
            sock.bind(f"tcp://{cfg.host}:{port}")
            return f"tcp://{advertised_host(cfg.host)}:{port}"
        except zmq.ZMQError:
            pass  # taken meanwhile: a fresh port (peers re-read the endpoints file)
    port = sock.bind_to_random_port(f"tcp://{cfg.host}")
    return f"tcp://{advertised_host(cfg.host)}:{port}"


def advertised_host(host: str) -> str:
    """The address peers connect to for a socket bound on ``host``. A wildcard bind is
    reached by this node's name, which cluster nodes resolve to a routable address (the
    bound address 0.0.0.0 means nothing to a peer)."""
    if host not in ("*", "0.0.0.0"):
        return host
    return os.environ.get("ASYNCRL_HOST") or socket.gethostname()


def make_socket(
    ctx: zmq.Context,
    kind: int,
    cfg: TransportConfig,
    identity: str | None = None,
    *,
    max_message_bytes: int | None = None,
) -> zmq.Socket:
    """A socket with bounded queues and message size (``cfg.max_message_bytes`` unless
    given), without CURVE: ``server_socket`` and ``client_socket`` add it."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # never hang on exit with undelivered messages
    sock.setsockopt(zmq.SNDHWM, cfg.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, cfg.high_water_mark)
    limit = cfg.max_message_bytes if max_message_bytes is None else max_message_bytes
    sock.setsockopt(zmq.MAXMSGSIZE, limit)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    return sock


def server_socket(
    ctx: zmq.Context, kind: int, cfg: TransportConfig, run_dir: str | Path
) -> zmq.Socket:
    """A socket other processes connect to (it binds). With CURVE it holds the run's
    server keys and ``ctx`` runs an authenticator that accepts only the run's client key:
    destroy ``ctx`` with ``close_context``."""
    sock = make_socket(ctx, kind, cfg)
    if security.curve_enabled(cfg):
        security.secure_server(sock, ctx, run_dir)
    return sock


def client_socket(
    ctx: zmq.Context,
    kind: int,
    cfg: TransportConfig,
    run_dir: str | Path,
    identity: str | None = None,
    *,
    max_message_bytes: int | None = None,
) -> zmq.Socket:
    """A socket that connects to a ``server_socket``; with CURVE it holds the run's client
    keys and accepts only a server with the run's server key."""
    sock = make_socket(ctx, kind, cfg, identity, max_message_bytes=max_message_bytes)
    if security.curve_enabled(cfg):
        security.secure_client(sock, run_dir)
    return sock


def close_context(ctx: zmq.Context, linger: int = 0) -> None:
    """``ctx.destroy(linger)``, after stopping the CURVE authenticator a ``server_socket``
    may have started in it (its thread polls sockets ``destroy`` would close under it)."""
    security.stop_authenticator(ctx)
    ctx.destroy(linger=linger)


def write_endpoints(run_dir: str | Path, role: str, endpoints: dict[str, str]) -> None:
    """Publish ``role``'s endpoints as ``RUN_DIR/endpoints/ROLE.json`` (atomic replace; one
    file per role, so roles never overwrite each other)."""
    directory = Path(run_dir) / "endpoints"
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{role}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(endpoints, indent=2))
    os.replace(tmp, directory / f"{role}.json")


def read_endpoints(
    run_dir: str | Path, role: str, timeout_s: float = 60.0
) -> dict[str, str] | None:
    """Wait up to ``timeout_s`` for ``role``'s endpoints; None if they never appear."""
    path = Path(run_dir) / "endpoints" / f"{role}.json"
    deadline = time.time() + timeout_s
    while not path.exists():
        if time.time() >= deadline:
            return None
        time.sleep(0.05)
    return json.loads(path.read_text())
