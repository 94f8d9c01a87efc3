"""Security: CURVE keeps strangers off a buffer bound to every interface, keys
are private and made once, defaults bind loopback, oversized messages are refused, and
nothing from the network is unpickled.

Why one file: one property, that nothing from the network gets in unasked, checked at every
door: CURVE, key files, bind addresses, message limits, pickle.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from asyncrl import security
from asyncrl.buffer.config import BufferConfig, RolloutConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring
from asyncrl.buffer.server import BufferServer
from asyncrl.models import ModelConfig
from asyncrl.security import CurveKeyError, curve_enabled, ensure_keys, secure_client
from asyncrl.tasks import TaskConfig, build_task
from asyncrl.tasks.stream import TaskPrompts
from asyncrl.transport import (
    TransportConfig,
    bind,
    client_socket,
    make_socket,
    read_endpoints,
    server_socket,
)
from asyncrl.wire import Chunk, LeaseGrant, LeaseRequest, WireDecoder, encode

RUN = "sec"
ROOT = Path(__file__).resolve().parent.parent
ASYNCRL = ROOT / "asyncrl"


class RunningBuffer:
    """A real ``BufferServer`` serving in a thread of this process."""

    def __init__(self, tmp_path: Path, model_dir: str, transport: TransportConfig) -> None:
        self.cfg = RolloutConfig(
            run_dir=str(tmp_path),
            run_id=RUN,
            model=ModelConfig(path=model_dir),
            task=TaskConfig(train_size=100, eval_size=10),
            transport=transport,
            buffer=BufferConfig(prompts_per_batch=2, samples_per_prompt=2, heartbeat_timeout_s=60),
        )
        prompts = TaskPrompts(build_task(self.cfg.task), model_dir, self.cfg.seed)
        self.buffer = RolloutBuffer(self.cfg.buffer, RUN, prompts, self.cfg.sampling.spec())
        self.server = BufferServer(self.cfg, self.buffer, InlineScoring(lambda *_: 0.0))
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()
        self.endpoints = read_endpoints(tmp_path, "buffer", timeout_s=30)
        assert self.endpoints is not None

    def tokens(self) -> int:
        return self.buffer.state.counts["tokens_received"]

    def wait_tokens(self, n: int, timeout_s: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.tokens() != n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.tokens() == n

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def chunk(lease_id: str, seq: int, tokens: list[int]) -> bytes:
    return encode(
        Chunk(
            run_id=RUN,
            worker_id="g0",
            lease_id=lease_id,
            seq=seq,
            token_ids=tokens,
            logprobs=[-1.0] * len(tokens),
            versions=[0] * len(tokens),
        )
    )


def take_lease(dealer: zmq.Socket, worker_id: str = "g0") -> str:
    dealer.send(encode(LeaseRequest(run_id=RUN, worker_id=worker_id, capacity=1)))
    assert dealer.poll(15_000), "no lease for a client with the right keys"
    grant = WireDecoder(RUN).decode(dealer.recv())
    assert isinstance(grant, LeaseGrant) and len(grant.leases) == 1
    return grant.leases[0].lease_id


def offer(sock: zmq.Socket, frame: bytes) -> None:
    """Send without blocking. A stranger's socket may have no pipe to send into (its
    handshake refused before the send): a blocking send would wait there for ever, and a
    message it could not even queue was not delivered either."""
    with contextlib.suppress(zmq.Again):
        sock.send(frame, zmq.NOBLOCK)


# ---- the acceptance test -----------------------------------------------------
def test_client_without_the_right_curve_keys_cannot_deliver_a_chunk_to_a_protected_buffer(
    tmp_path, tiny_model_dir, monkeypatch
):
    # Bound on every interface: curve=auto turns CURVE on. Peers dial it over loopback.
    monkeypatch.setenv("ASYNCRL_HOST", "127.0.0.1")
    running = RunningBuffer(tmp_path, tiny_model_dir, TransportConfig(scheme="tcp", host="0.0.0.0"))
    server = running.server
    ctx = zmq.Context()
    try:
        assert all(s.curve_server for s in (server.chunks, server.leases, server.trainer))
        t, run_dir = running.cfg.transport, running.cfg.run_dir
        # The run's own client: a lease, and its chunk counts.
        dealer = client_socket(ctx, zmq.DEALER, t, run_dir, identity="g0")
        dealer.connect(running.endpoints["leases"])
        push = client_socket(ctx, zmq.PUSH, t, run_dir)
        push.connect(running.endpoints["chunks"])
        lease_id = take_lease(dealer)
        push.send(chunk(lease_id, 0, [5, 6]))
        assert running.wait_tokens(2), "the right keys' chunk was not accepted"

        # Three strangers try the same: another run's keys; fresh client keys with this
        # run's (public) server key; no CURVE at all. Each asks for a lease and sends the
        # next chunk of the real lease, which would count if it got through.
        other_run = tmp_path / "other-run"
        ensure_keys(other_run)
        fresh_public, fresh_secret = zmq.curve_keypair()
        server_public, _ = security.load_keypair(
            security.key_paths(run_dir).server_public, secret=False
        )

        def other_runs_keys(sock):
            secure_client(sock, other_run)

        def fresh_keys(sock):
            sock.curve_publickey, sock.curve_secretkey = fresh_public, fresh_secret
            sock.curve_serverkey = server_public

        strangers = []
        for name, arm in (("other", other_runs_keys), ("fresh", fresh_keys), ("plain", None)):
            s_dealer = make_socket(ctx, zmq.DEALER, t, identity=f"intruder-{name}")
            s_push = make_socket(ctx, zmq.PUSH, t)
            if arm is not None:
                arm(s_dealer)
                arm(s_push)
            s_dealer.connect(running.endpoints["leases"])
            s_push.connect(running.endpoints["chunks"])
            request = encode(LeaseRequest(run_id=RUN, worker_id=name, capacity=1))
            offer(s_dealer, request)
            offer(s_push, chunk(lease_id, 1, [7]))
            strangers.append((name, s_dealer))
        time.sleep(2.0)
        for name, s_dealer in strangers:
            assert not s_dealer.poll(0), f"{name}: a stranger was answered"
        assert running.tokens() == 2, "a stranger's chunk was accepted"
        assert server.buffer.state.counts["leases_issued"] == 1
        # The fresh key reached the authenticator (its refusal is counted when handled).
        deadline = time.monotonic() + 30
        while security.refused_peers(server.ctx) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert security.refused_peers(server.ctx) >= 1

        # The buffer still serves its own client: the next chunk is not a duplicate.
        push.send(chunk(lease_id, 1, [7, 8]))
        assert running.wait_tokens(4)
    finally:
        ctx.destroy(linger=0)
        running.stop()
    assert security.refused_peers(server.ctx) == 0  # its authenticator was stopped


@pytest.mark.slow
def test_a_run_bound_to_every_interface_trains_over_curve(tmp_path, tiny_model_dir):
    """The launcher makes the keys; buffer, generator and trainer talk CURVE on every
    socket (weights included) and train."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "launch/local.py",
        "experiments/tiny_grpo.py",
        f"run_dir={run_dir}",
        f"model.path={tiny_model_dir}",
        "rl.max_steps=2",
        "eval.num_examples=8",
        "task.train_size=200",
        "buffer.prompts_per_batch=2",
        "buffer.samples_per_prompt=4",
        "engine.embedded.max_slots=8",
        "transport.heartbeat_s=0.2",
        "transport.scheme=tcp",
        "transport.host=0.0.0.0",
        # Two steps end in a second: a generator that joins after v1's anchor went out
        # would ask for one the closing trainer no longer serves. Every version whole.
        "transport.weights.anchor_every=1",
    ]
    env = dict(os.environ, ASYNCRL_HOST="127.0.0.1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    counters = json.loads((run_dir / "buffer_counters.json").read_text())
    assert counters["buffer/generator_version_max"] >= 1  # weights came over the CURVE PUB
    assert json.loads((run_dir / "endpoints" / "trainer.json").read_text())["weights"].startswith(
        "tcp://127.0.0.1:"
    )
    assert mode(run_dir / "keys") == 0o700


# ---- keys ------------------------------------------------------------------------------
def test_keys_are_private_and_made_once(tmp_path):
    keys = ensure_keys(tmp_path)
    assert keys.directory == (tmp_path / "keys").resolve()
    assert mode(keys.directory) == mode(keys.authorized) == 0o700
    files = sorted(p for p in keys.directory.rglob("*") if p.is_file())
    names = [str(p.relative_to(keys.directory)) for p in files]
    assert names == [
        "authorized/client.key",
        "client.key",
        "client.key_secret",
        "server.key",
        "server.key_secret",
    ]
    assert all(mode(p) == 0o600 for p in files)
    before = {p: p.read_bytes() for p in files}
    assert ensure_keys(tmp_path) == keys
    assert {p: p.read_bytes() for p in files} == before
    client_public, _ = security.load_keypair(keys.client_public, secret=False)
    assert security.AuthorizedKeys(keys.authorized).keys == {client_public}


def test_keys_made_by_many_processes_at_once_are_one_set(tmp_path):
    barrier = threading.Barrier(8)
    made = []

    def make():
        barrier.wait()
        made.append(ensure_keys(tmp_path))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 8 and len(set(made)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["keys"]  # no temporary directory left
    security.load_keypair(made[0].server_secret, secret=True)


def test_missing_or_exposed_key_files_are_named(tmp_path):
    keys = ensure_keys(tmp_path)
    ctx = zmq.Context()
    try:
        keys.client_secret.unlink()
        with pytest.raises(CurveKeyError, match=str(keys.client_secret)):
            secure_client(ctx.socket(zmq.DEALER), tmp_path)
        keys.server_secret.chmod(0o644)
        with pytest.raises(CurveKeyError, match="chmod 600"):
            security.secure_server(ctx.socket(zmq.ROUTER), ctx, tmp_path)
        with pytest.raises(TimeoutError, match="no CURVE keys"):
            secure_client(ctx.socket(zmq.DEALER), tmp_path / "nowhere", timeout_s=0.1)
    finally:
        security.stop_authenticator(ctx)
        ctx.destroy(linger=0)


# ---- where sockets bind ------------------------------------------------------------------
def test_defaults_bind_ipc_or_loopback_and_curve_follows_the_host(tmp_path):
    default = TransportConfig()
    assert (default.scheme, default.host, default.curve) == ("ipc", "127.0.0.1", "auto")
    assert not curve_enabled(default)
    for host, on in (
        ("127.0.0.1", False),
        ("localhost", False),
        ("127.0.0.2", False),
        ("*", True),
        ("0.0.0.0", True),
        ("10.1.2.3", True),
        ("node7", True),
    ):
        assert curve_enabled(TransportConfig(scheme="tcp", host=host)) is on, host
    assert curve_enabled(TransportConfig(curve="on"))  # forced, even on ipc
    ctx = zmq.Context()
    try:
        sock = server_socket(ctx, zmq.PULL, default, tmp_path)
        assert bind(sock, default, tmp_path, "x").startswith(f"ipc://{tmp_path.resolve()}")
        assert not (tmp_path / "keys").exists()  # no CURVE, no keys
    finally:
        ctx.destroy(linger=0)


def test_unauthenticated_ports_on_the_network_are_refused(tmp_path):
    exposed_off = TransportConfig(scheme="tcp", host="*", curve="off")
    with pytest.raises(ValueError, match="transport.curve=off"):
        curve_enabled(exposed_off)
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="transport.curve=off"):
            server_socket(ctx, zmq.PULL, exposed_off, tmp_path)
        # A socket made without CURVE cannot bind a non-loopback interface either.
        plain = make_socket(ctx, zmq.PULL, exposed_off)
        with pytest.raises(ValueError, match="without CURVE"):
            bind(plain, TransportConfig(scheme="tcp", host="0.0.0.0"), tmp_path, "x")
        # Loopback without CURVE is allowed: the host is the boundary.
        loopback = TransportConfig(scheme="tcp", host="127.0.0.1", curve="off")
        assert bind(make_socket(ctx, zmq.PULL, loopback), loopback, tmp_path, "y").startswith(
            "tcp://127.0.0.1:"
        )
    finally:
        ctx.destroy(linger=0)


# ---- message size ------------------------------------------------------------------------
def test_a_message_over_the_size_limit_is_refused_and_the_buffer_keeps_serving(
    tmp_path, tiny_model_dir
):
    running = RunningBuffer(tmp_path, tiny_model_dir, TransportConfig(max_message_bytes=1 << 16))
    ctx = zmq.Context()
    try:
        t = running.cfg.transport
        dealer = make_socket(ctx, zmq.DEALER, t, identity="g0")
        dealer.connect(running.endpoints["leases"])
        push = make_socket(ctx, zmq.PUSH, t)
        push.connect(running.endpoints["chunks"])
        lease_id = take_lease(dealer)
        push.send(chunk(lease_id, 0, [5, 6]))
        assert running.wait_tokens(2)
        # A valid chunk of 20k tokens (~200 KB of msgpack), over the 64 KiB limit: were it
        # let through, it would count.
        big = chunk(lease_id, 1, list(range(20_000)))
        assert len(big) > t.max_message_bytes
        sender = make_socket(ctx, zmq.PUSH, t)
        sender.connect(running.endpoints["chunks"])
        sender.send(big)
        time.sleep(1.5)
        assert running.tokens() == 2
        # Still serving, nothing accepted lost: the next chunk and a new lease.
        push.send(chunk(lease_id, 1, [7]))
        assert running.wait_tokens(3)
        take_lease(dealer)
        assert running.buffer.state.counts["chunks_duplicate"] == 0
    finally:
        ctx.destroy(linger=0)
        running.stop()


# ---- no pickle ---------------------------------------------------------------------------
UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
UNPICKLING_CALLS = {
    "recv_pyobj",
    "send_pyobj",
    "recv_serialized",
    # torch.distributed's object collectives pickle between ranks (over gloo's sockets).
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}
LOCAL_TORCH_LOADS = {"trainer/checkpoint.py"}
"""The one ``torch.load``: the trainer's own checkpoint files on local disk."""


def test_nothing_from_the_network_is_unpickled():
    found = []
    for path in sorted(ASYNCRL.rglob("*.py")):
        where = str(path.relative_to(ASYNCRL))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                names = []
            found += [f"{where}: import {n}" for n in names if n in UNPICKLING_MODULES]
            if isinstance(node, ast.Attribute) and node.attr in UNPICKLING_CALLS:
                found.append(f"{where}: .{node.attr}")
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                found.append(f"{where}: allow_pickle=")
            is_torch_load = (
                isinstance(node, ast.Attribute)
                and node.attr == "load"
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            )
            if is_torch_load and where not in LOCAL_TORCH_LOADS:
                found.append(f"{where}: torch.load")
    assert found == []
