"""ZeroMQ transport: endpoints, sockets with bounded queues, and the rendezvous file.

Patterns (DESIGN §3): generators PUSH chunks and heartbeats to the buffer's PULL socket;
generators (DEALER) ask the buffer (ROUTER) for leases; trainer ranks (DEALER) ask the
buffer (ROUTER) for batches and announce versions; the trainer PUBlishes weights that
generators SUBscribe to. Endpoints default to ``ipc://`` sockets inside the run directory
(or loopback TCP on ports the OS picks); whoever binds writes its endpoints into
``RUN_DIR/endpoints/ROLE.json`` and the others read them there, so no port is hard-coded.
Across nodes (``launch/slurm.py``) the run directory is on a shared filesystem and
``host="*"`` binds every interface and advertises this node's name.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq


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
    max_message_bytes: int = 1 << 30
    """Larger incoming messages are refused by ZeroMQ (weights excepted: see the trainer)."""
    chunk_tokens: int = 16
    """A generator flushes a lease's new tokens once this many have accumulated …"""
    chunk_ms: float = 50.0
    """… or once this many milliseconds have passed since its last flush, whichever first."""
    heartbeat_s: float = 1.0
    """Interval of generator heartbeats."""


def bind(sock: zmq.Socket, cfg: TransportConfig, run_dir: str | Path, name: str) -> str:
    """Bind ``sock`` to a fresh endpoint for ``name`` and return the endpoint string."""
    if cfg.scheme == "ipc":
        directory = Path(run_dir).resolve() / "sockets"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        path.unlink(missing_ok=True)
        endpoint = f"ipc://{path}"
        sock.bind(endpoint)
        return endpoint
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
    ctx: zmq.Context, kind: int, cfg: TransportConfig, identity: str | None = None
) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # never hang on exit with undelivered messages
    sock.setsockopt(zmq.SNDHWM, cfg.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, cfg.high_water_mark)
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    return sock


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
