"""Who may talk to a run's sockets: ZeroMQ CURVE keys and the authenticator.

Threat model. A socket bound to a non-loopback interface (``transport.host="*"`` on a
cluster) can be reached by anyone on the network: another user's job, a scanner, a
misdirected client. Without protection such a peer could feed the buffer chunks, take
leases, receive a Batch or the weights. CURVE (ZeroMQ's CurveZMQ) encrypts every
connection and authenticates both ends: a client must know the server's public key, and
the server accepts only clients whose public key is in ``RUN_DIR/keys/authorized/``
(checked by a ZAP authenticator thread in the server's context); anyone else's handshake
fails, and their messages never reach the application. ``ipc://`` sockets live in the run
directory and loopback TCP never leaves the host, so there the filesystem permissions and
the host's users are the boundary and CURVE is off unless forced (``transport.curve="on"``).

What nobody gets by any route: an object from the network that is unpickled. Every socket
carries msgpack ``msgspec`` structs or raw tensor bytes (``asyncrl.wire``), and each socket
refuses frames over its configured size (``TransportConfig.max_message_bytes``, and
``max_weights_bytes`` on the generators' weights SUB).

Keys. One server keypair for every socket that binds (the buffer's three, the trainer's
weights PUB) and one client keypair for every process that connects (generators, trainer
ranks): all processes of a run share the run directory, whose keys directory only its
owner can read (0700, files 0600). ``ensure_keys`` makes them once, atomically, whoever
calls it first (the launcher's ``prepare``, else the first process to bind); connecting
processes wait for them (``secure_client``).

    RUN_DIR/keys/server.key, server.key_secret   the binding side
    RUN_DIR/keys/client.key, client.key_secret   the connecting side
    RUN_DIR/keys/authorized/client.key           public keys the authenticator accepts
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)


class CurveKeyError(RuntimeError):
    """A key file is missing, unreadable, malformed or readable by others."""


@dataclass(frozen=True)
class KeyPaths:
    directory: Path
    """``RUN_DIR/keys``."""

    @property
    def server_public(self) -> Path:
        return self.directory / "server.key"

    @property
    def server_secret(self) -> Path:
        return self.directory / "server.key_secret"

    @property
    def client_public(self) -> Path:
        return self.directory / "client.key"

    @property
    def client_secret(self) -> Path:
        return self.directory / "client.key_secret"

    @property
    def authorized(self) -> Path:
        """Directory of the public keys (``*.key``) of the clients servers accept."""
        return self.directory / "authorized"


def key_paths(run_dir: str | Path) -> KeyPaths:
    return KeyPaths(Path(run_dir).resolve() / "keys")


def ensure_keys(run_dir: str | Path) -> KeyPaths:
    """Generate the run's keys into ``RUN_DIR/keys`` unless they exist; idempotent.

    Safe when several processes call it at once (on one host or over a shared filesystem):
    each writes a complete private directory and renames it into place; the first rename
    wins and the others use its keys (renaming onto a non-empty directory fails)."""
    keys = key_paths(run_dir)
    if keys.directory.exists():
        return keys
    keys.directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".keys-", dir=keys.directory.parent))  # mode 0700
    try:
        zmq.auth.create_certificates(tmp, "server")
        zmq.auth.create_certificates(tmp, "client")
        (tmp / "authorized").mkdir()
        shutil.copyfile(tmp / "client.key", tmp / "authorized" / "client.key")
        for path in [tmp, *tmp.rglob("*")]:
            path.chmod(0o700 if path.is_dir() else 0o600)
        try:
            os.rename(tmp, keys.directory)
        except OSError:
            if not keys.directory.is_dir():
                raise
            # Another process's keys got there first: use those.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return keys


def wait_for_keys(run_dir: str | Path, timeout_s: float = 60.0) -> KeyPaths:
    """The run's keys, once whoever binds (or the launcher) has made them."""
    keys = key_paths(run_dir)
    deadline = time.monotonic() + timeout_s
    while not keys.directory.exists():
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"no CURVE keys in {keys.directory} after {timeout_s:.0f} s: they are made by "
                "the launcher or the first process that binds (asyncrl.security.ensure_keys)"
            )
        time.sleep(0.05)
    return keys


def load_keypair(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 keys from a certificate file; raises ``CurveKeyError`` naming
    the file when it is missing, unreadable, malformed, or a secret file others can read."""
    try:
        mode = path.stat().st_mode
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveKeyError(f"CURVE key file {path}: {e}") from None
    if secret:
        if secret_key is None:
            raise CurveKeyError(f"CURVE key file {path} holds no secret key")
        if stat.S_IMODE(mode) & 0o077:
            raise CurveKeyError(
                f"CURVE key file {path} is accessible to other users "
                f"(mode {stat.S_IMODE(mode):o}); chmod 600 it"
            )
    return public, secret_key


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or name) only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", a hostname, an interface name: reachable from the network


class CurveSettings(Protocol):
    """The transport settings CURVE depends on (``asyncrl.transport.TransportConfig`` has
    them; named here structurally, since the transport imports this module)."""

    curve: str
    scheme: str
    host: str


def curve_enabled(cfg: CurveSettings) -> bool:
    """Whether the run's sockets use CURVE (``TransportConfig.curve``). Raises ValueError
    for ``curve="off"`` on a non-loopback TCP host: an unauthenticated open port."""
    if cfg.curve not in ("auto", "on", "off"):
        raise ValueError(f"transport.curve must be auto, on or off, not {cfg.curve!r}")
    exposed = cfg.scheme == "tcp" and not is_loopback(cfg.host)
    if cfg.curve == "off" and exposed:
        raise ValueError(
            f"transport.curve=off with transport.host={cfg.host!r} would open unauthenticated "
            "ports to the network; use transport.curve=auto (or on), or bind a loopback host"
        )
    return cfg.curve == "on" or (cfg.curve == "auto" and exposed)


class AuthorizedKeys:
    """The ZAP check: a client's public key must be one of ``authorized/*.key`` (read when
    the authenticator starts). Refusals are counted, and the first of each key logged."""

    def __init__(self, directory: Path) -> None:
        if not directory.is_dir():
            raise CurveKeyError(f"CURVE authorized-keys directory {directory} is missing")
        try:
            self.keys = set(zmq.auth.load_certificates(directory))
        except (OSError, ValueError) as e:
            raise CurveKeyError(f"CURVE authorized keys in {directory}: {e}") from None
        self.refused: dict[bytes, int] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if key not in self.refused:
            log.warning("refused a peer with an unknown CURVE key %s", key.decode())
        self.refused[key] = self.refused.get(key, 0) + 1
        return False


_authenticators: dict[zmq.Context, tuple[ThreadAuthenticator, AuthorizedKeys]] = {}
_lock = threading.Lock()


def secure_server(sock: zmq.Socket, ctx: zmq.Context, run_dir: str | Path) -> None:
    """Make ``sock`` (of ``ctx``, before it binds) a CURVE server with the run's server
    keys, and start ``ctx``'s authenticator if it has none yet: without one, ZeroMQ would
    let any key through. Stop it with ``stop_authenticator`` before destroying ``ctx``."""
    keys = ensure_keys(run_dir)
    public, secret = load_keypair(keys.server_secret, secret=True)
    with _lock:
        if ctx not in _authenticators:
            authorized = AuthorizedKeys(keys.authorized)
            auth = ThreadAuthenticator(ctx, log=log.getChild("zap"))
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=authorized)
            _authenticators[ctx] = (auth, authorized)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, run_dir: str | Path, timeout_s: float = 60.0) -> None:
    """Give ``sock`` (before it connects) the run's client keys and the server's public
    key, waiting up to ``timeout_s`` for the keys to exist."""
    keys = wait_for_keys(run_dir, timeout_s)
    public, secret = load_keypair(keys.client_secret, secret=True)
    server_public, _ = load_keypair(keys.server_public, secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def refused_peers(ctx: zmq.Context) -> int:
    """Handshakes ``ctx``'s authenticator refused for an unknown key (0 without one)."""
    with _lock:
        entry = _authenticators.get(ctx)
    return sum(entry[1].refused.values()) if entry is not None else 0


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s authenticator thread, if it has one: it polls sockets of ``ctx``, which
    ``ctx.destroy`` would otherwise close under it."""
    with _lock:
        entry = _authenticators.pop(ctx, None)
    if entry is not None:
        entry[0].stop()
