"""Helpers of the sglang suites (``test_sglang_protocol.py``, ``test_sglang_wheels.py``,
``test_remote_engine.py``): launching a server, a thin aiohttp client that checks
sglang's SSE framing, shared checks, and ``serving`` for the stub servers those suites
build to stand in for a release of sglang."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from asyncrl.engine.servers import die_with_parent


@dataclass
class Server:
    kind: str
    url: str
    model_dir: str
    logprob_atol: float
    """sglang computes in reduced precision; the embedded server in float32."""


def start_server(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """``cmd`` logging to ``log_path``, in its own process group (so that a stop reaches
    every process it starts) and with a death signal (so that a suite killed before the
    stop leaves no server behind)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, model_dir: str, port: int) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if kind == "embedded":
        return [
            sys.executable,
            "-m",
            "asyncrl.serving.serve",
            "--model",
            model_dir,
            *common,
            "--max-slots",
            "32",
            "--max-seq-len",
            "128",
            "--threads",
            "1",
        ]
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_dir,
        *common,
        "--mem-fraction-static",
        "0.2",
        "--disable-cuda-graph",
        "--context-length",
        "128",
    ]


@contextlib.contextmanager
def serving(app: web.Application) -> Iterator[str]:
    """Serve ``app`` on a free port from an event loop of its own thread (so synchronous
    callers, such as the trainer's publishers, can call it); yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(app)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner.addresses[0][1]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log_path.read_text()[-3000:]}")


class Api:
    """A thin aiohttp client for one server."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def __aenter__(self) -> Api:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def call(self, method: str, path: str, body=None, raw: bytes | None = None):
        """(status, JSON body, or text when it is not JSON)."""
        kwargs = {"data": raw, "headers": {"Content-Type": "application/json"}} if raw else {}
        if raw is None and body is not None:
            kwargs = {"json": body}
        async with self.session.request(method, self.url + path, **kwargs) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text

    async def post(self, path: str, body=None):
        return await self.call("POST", path, body if body is not None else {})

    async def generate(self, body: dict) -> dict:
        status, out = await self.post("/generate", body)
        assert status == 200, out
        return out

    async def stream(self, body: dict) -> AsyncIterator[dict]:
        """The events of a streamed ``/generate``, checking sglang's SSE framing:
        ``data: {json}`` then a blank line, per event; ``data: [DONE]`` last."""
        async with self.session.post(self.url + "/generate", json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            while True:
                line = await r.content.readline()
                assert line.startswith(b"data: ") and line.endswith(b"\n"), line
                assert await r.content.readline() == b"\n"
                if line[6:].strip() == b"[DONE]":
                    assert await r.content.read() == b"", "bytes after [DONE]"
                    return
                yield json.loads(line[6:])


def run(server: Server, test) -> None:
    async def main() -> None:
        async with Api(server.url) as api:
            await test(api)

    asyncio.run(main())


async def collect(stream: AsyncIterator[dict], into: list[tuple[float, dict]]) -> dict:
    """Drain ``stream`` into ``(arrival time, event)`` pairs; returns the last event."""
    async for event in stream:
        into.append((time.monotonic(), event))
    return into[-1][1]


async def until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def greedy(prompt: list[int], max_new_tokens: int, **extra) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    return {"input_ids": prompt, "sampling_params": params, **extra}


def check_response(out: dict, prompt: list[int], tokenizer, max_new_tokens: int) -> None:
    """sglang's response shape and finish semantics: a length finish at exactly
    max_new_tokens, or a stop at EOS (kept in output_ids, dropped from the text)."""
    ids, meta = out["output_ids"], out["meta_info"]
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(ids) and 1 <= len(ids) <= max_new_tokens
    assert isinstance(meta["weight_version"], str)
    finish = meta["finish_reason"]
    if finish["type"] == "length":
        assert len(ids) == max_new_tokens and finish["length"] == max_new_tokens
        text_ids = ids
    else:
        assert (
            finish == {"type": "stop", "matched": tokenizer.eos_token_id}
            and ids[-1] == finish["matched"]
        )
        text_ids = ids[:-1]
    assert out["text"] == tokenizer.decode(text_ids, skip_special_tokens=True)
