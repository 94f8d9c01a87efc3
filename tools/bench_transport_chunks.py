"""Chunk ingestion by the real buffer process (half of ``tools/bench_transport.py``).

A real buffer (``python -m asyncrl.buffer.server``: ``BufferServer`` around a
``RolloutBuffer``, rewards in its reward pool) runs in its own process with
``max_staleness=None``, long lease and heartbeat timeouts and ``prompts_per_batch=1``.
Two sender processes each take ``--leases`` leases through the leases ROUTER socket
(``LeaseRequest`` → ``LeaseGrant``), pre-encode their share of ``--chunks`` chunks of 16
tokens (16 logprobs, 16 versions), spread round-robin over their leases with increasing
``seq`` and never finished, and on "go" push them as fast as ZeroMQ takes them (PUSH,
ipc, a send queue as deep as the run; the server keeps its configured receive queue).

The end is detected by the server itself, with no hook. The bench first leases two whole
groups (``samples_per_prompt`` leases each) for itself. It finishes the first (one
one-token chunk per lease) and waits for it as step 0's batch, outside the clock, so the
reward workers, which start on first use, are up. The second is the sentinel: half of
its leases go to each sender, which ends its stream with one finished one-token chunk per
sentinel lease, and a ``BatchRequest`` for step 1 waits in the server before "go".
ZeroMQ keeps each sender's messages in order, so the sentinel group is complete (the
only one, hence step 1's whole batch with ``prompts_per_batch=1``) only once the server
has decoded and applied (``RolloutBuffer.on_chunk``) every chunk of both senders; it
answers when the group's rewards come back, a few milliseconds later. ``chunks_per_s`` =
``--chunks`` / (arrival of that Batch − first send of either sender), with
``time.monotonic`` (one system-wide clock on Linux). Encoding is outside the window; the
8 sentinel chunks and their scoring are inside it. Afterwards the server is stopped and
its ``buffer_counters.json`` must show every token received and no chunk unknown,
duplicate or malformed. Each run starts a fresh server.

Why one file: one benchmark, its senders, its server and its check of the buffer's books,
run as one command.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import signal
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq
from bench_transport_common import RUN_ID, WAIT_S

from asyncrl.transport import TransportConfig, make_socket
from asyncrl.wire import (
    Batch,
    BatchRequest,
    Chunk,
    LeaseGrant,
    LeaseRequest,
    WireDecoder,
    encode,
)

CHILD_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
ENTRY = Path(__file__).with_name("bench_transport.py")
"""The bench's entry point; its hidden ``--serve-profiled`` runs the profiled server."""


# ---- chunk senders (child processes) ---------------------------------------------------
def take_leases(ctx: zmq.Context, endpoint: str, worker_id: str, count: int) -> list[str]:
    """Lease ids of ``count`` samples, asked for through the buffer's leases socket."""
    dealer = make_socket(ctx, zmq.DEALER, TransportConfig(), identity=worker_id)
    dealer.connect(endpoint)
    decoder = WireDecoder(RUN_ID, expected=LeaseGrant)
    lease_ids: list[str] = []
    while len(lease_ids) < count:
        wanted = count - len(lease_ids)
        dealer.send(encode(LeaseRequest(run_id=RUN_ID, worker_id=worker_id, capacity=wanted)))
        if not dealer.poll(int(WAIT_S * 1000)):
            raise TimeoutError(f"{worker_id}: no LeaseGrant after {WAIT_S:.0f} s")
        grant = decoder.decode(dealer.recv())
        lease_ids += [lease.lease_id for lease in grant.leases]
    dealer.close()
    return lease_ids


def encode_chunks(worker_id: str, lease_ids: list[str], n: int, tokens: int) -> list[bytes]:
    """``n`` chunks round-robin over the leases (chunk i: lease i mod L, seq i div L)."""
    token_ids = [3 + j % 50 for j in range(tokens)]
    logprobs = [-0.5 - j / 100 for j in range(tokens)]
    versions = [0] * tokens
    return [
        encode(
            Chunk(
                run_id=RUN_ID,
                worker_id=worker_id,
                lease_id=lease_ids[i % len(lease_ids)],
                seq=i // len(lease_ids),
                token_ids=token_ids,
                logprobs=logprobs,
                versions=versions,
            )
        )
        for i in range(n)
    ]


def finished_chunk(worker_id: str, lease_id: str) -> bytes:
    """A lease's only chunk: one token, finished (the sample then gets scored)."""
    return encode(
        Chunk(
            run_id=RUN_ID,
            worker_id=worker_id,
            lease_id=lease_id,
            seq=0,
            token_ids=[3],
            logprobs=[-1.0],
            versions=[0],
            finished=True,
            finish_reason="stop",
        )
    )


def sender_main(conn: Connection, worker_id: str) -> None:
    """Serve runs until told ``None``: take leases, encode, wait for "go", push, report."""
    while (job := conn.recv()) is not None:
        ctx = zmq.Context()
        try:
            lease_ids = take_leases(ctx, job["leases_endpoint"], worker_id, job["leases"])
            messages = encode_chunks(worker_id, lease_ids, job["chunks"], job["tokens"])
            messages += [finished_chunk(worker_id, lease_id) for lease_id in job["sentinels"]]
            push = make_socket(ctx, zmq.PUSH, TransportConfig())
            push.setsockopt(zmq.SNDHWM, len(messages) + 1)  # never block on our own queue
            push.connect(job["chunks_endpoint"])
            conn.send("ready")
            conn.recv()  # "go"
            start = time.monotonic()
            for message in messages:
                push.send(message, copy=True)
            conn.send({"start": start, "sent": time.monotonic()})
            conn.recv()  # the server has everything: our socket may close (LINGER is 0)
        except Exception as e:  # reported, so the bench fails now rather than at a timeout
            conn.send({"error": f"{worker_id}: {e!r}"})
        finally:
            ctx.destroy(linger=0)


# ---- chunk ingestion (the bench's side) -------------------------------------------------
def write_rollout_config(run_dir: Path, model_dir: Path, samples_per_prompt: int) -> Path:
    from asyncrl.buffer.config import BufferConfig, RolloutConfig
    from asyncrl.config import save_json
    from asyncrl.models import ModelConfig
    from asyncrl.tasks import TaskConfig

    # Unbounded admission; nothing expires mid-run (the bench holds leases without heartbeats).
    buffer = BufferConfig(
        prompts_per_batch=1,
        samples_per_prompt=samples_per_prompt,
        max_staleness=None,
        progress_timeout_s=3600.0,
        heartbeat_timeout_s=3600.0,
    )
    cfg = RolloutConfig(
        run_dir=str(run_dir),
        run_id=RUN_ID,
        model=ModelConfig(path=str(model_dir)),
        task=TaskConfig(train_size=2000, eval_size=10),
        buffer=buffer,
    )
    path = run_dir / "rollout.json"
    save_json(cfg, path)
    return path


def start_server(config: Path, profile_to: Path | None, children: list) -> subprocess.Popen:
    if profile_to is None:
        args = ["-m", "asyncrl.buffer.server", "--config", str(config)]
    else:
        args = [str(ENTRY), "--serve-profiled", str(config), str(profile_to)]
    with open(config.parent / "buffer.log", "wb") as log:
        command = [sys.executable, *args]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=CHILD_ENV)
    children.append(proc)
    return proc


def wait_endpoints(run_dir: Path, server: subprocess.Popen) -> dict[str, str]:
    path = run_dir / "endpoints" / "buffer.json"
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            log = (run_dir / "buffer.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the buffer never published its endpoints:\n{log}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def stop_server(server: subprocess.Popen, run_dir: Path) -> dict[str, float]:
    server.send_signal(signal.SIGTERM)
    if server.wait(timeout=WAIT_S) != 0:
        log = (run_dir / "buffer.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the buffer exited with {server.returncode}:\n{log}")
    return json.loads((run_dir / "buffer_counters.json").read_text())


def check_counters(counts: dict[str, float], expected_tokens: int) -> None:
    bad = {
        k: v
        for k, v in counts.items()
        if v and ("bad_frames" in k or k.startswith("buffer/chunks_"))
    }
    if counts.get("buffer/tokens_received") != expected_tokens or bad:
        raise RuntimeError(f"the buffer did not ingest every chunk cleanly: {counts}")


def chunk_run(
    args: argparse.Namespace,
    run_dir: Path,
    model_dir: Path,
    senders: list[Connection],
    children: list,
    profile_to: Path | None = None,
) -> dict[str, float]:
    """One run against a fresh server; returns chunks/s and the senders' own push time."""
    run_dir.mkdir(parents=True)
    samples = args.samples_per_prompt  # size of the warm-up and the sentinel group
    server = start_server(write_rollout_config(run_dir, model_dir, samples), profile_to, children)
    endpoints = wait_endpoints(run_dir, server)
    ctx = zmq.Context()
    try:
        trainer = make_socket(ctx, zmq.DEALER, TransportConfig(), identity="bench-trainer")
        trainer.connect(endpoints["trainer"])
        leases = take_leases(ctx, endpoints["leases"], "bench", 2 * samples)
        warm_up(ctx, endpoints["chunks"], trainer, leases[:samples])
        sentinels = leases[samples:]
        per_sender = args.chunks // len(senders)
        for i, conn in enumerate(senders):
            conn.send(
                {
                    "leases_endpoint": endpoints["leases"],
                    "chunks_endpoint": endpoints["chunks"],
                    "leases": args.leases,
                    "chunks": per_sender,
                    "tokens": args.chunk_tokens,
                    "sentinels": sentinels[i :: len(senders)],
                }
            )
        for conn in senders:
            expect(conn, "ready")
        trainer.send(encode(BatchRequest(run_id=RUN_ID, step=1, rank=0, world_size=1)))
        time.sleep(0.1)  # the request waits in the server before the clock starts
        for conn in senders:
            conn.send("go")
        if not trainer.poll(int(WAIT_S * 1000)):
            raise TimeoutError("the buffer never completed the sentinel group")
        end = time.monotonic()
        batch = WireDecoder(RUN_ID, expected=Batch).decode(trainer.recv())
        reports = [expect(conn, None) for conn in senders]
        for conn in senders:
            conn.send("done")
    finally:
        ctx.destroy(linger=0)
    counts = stop_server(server, run_dir)
    check_counters(counts, per_sender * len(senders) * args.chunk_tokens + 2 * samples)
    if len(batch.samples) != samples:
        raise RuntimeError(f"sentinel batch has {len(batch.samples)} samples, expected {samples}")
    start = min(r["start"] for r in reports)
    return {
        "chunks_per_s": per_sender * len(senders) / (end - start),
        "send_s": max(r["sent"] for r in reports) - start,
        "total_s": end - start,
    }


def warm_up(ctx: zmq.Context, chunks_endpoint: str, trainer: zmq.Socket, leases: list[str]) -> None:
    """Finish one group and wait for it as step 0's batch, outside the clock, so that the
    server's reward workers (started on first use) are up before the timed run."""
    push = make_socket(ctx, zmq.PUSH, TransportConfig())
    push.connect(chunks_endpoint)
    for lease_id in leases:
        push.send(finished_chunk("bench", lease_id))
    trainer.send(encode(BatchRequest(run_id=RUN_ID, step=0, rank=0, world_size=1)))
    if not trainer.poll(int(WAIT_S * 1000)):
        raise TimeoutError("the buffer never completed the warm-up group")
    WireDecoder(RUN_ID, expected=Batch).decode(trainer.recv())


def expect(conn: Connection, what: str | None) -> Any:
    if not conn.poll(WAIT_S):
        raise TimeoutError(f"a child process never answered (waiting for {what or 'a report'})")
    answer = conn.recv()
    if isinstance(answer, dict) and "error" in answer:
        raise RuntimeError(answer["error"])
    if what is not None and answer != what:
        raise RuntimeError(f"expected {what!r} from a child process, got {answer!r}")
    return answer


def serve_profiled(config: str, out: str) -> None:
    """The real server entry point, with ``BufferServer.serve`` run under cProfile."""
    from asyncrl.buffer import server

    profiler = cProfile.Profile()
    serve = server.BufferServer.serve
    server.BufferServer.serve = lambda self: profiler.runcall(serve, self)
    try:
        server.main(["--config", config])
    finally:
        profiler.dump_stats(out)


def top_costs(profile: Path, count: int = 12) -> dict[str, Any]:
    """Where ``serve`` spent its time: idle (own time of zmq's ``poll``, i.e. waiting),
    busy, and ``[function, calls, own seconds, share of busy]`` for the costliest."""
    stats = pstats.Stats(str(profile), stream=io.StringIO()).stats
    total = max(ct for (_, _, name), (_, _, _, ct, _) in stats.items() if name == "serve")
    idle = sum(
        tt
        for (path, _, name), (_, _, tt, _, _) in stats.items()
        if name == "poll" and path.endswith("zmq/sugar/poll.py")
    )
    busy = total - idle
    rows = []
    for (path, line, name), (_, calls, tottime, _, _) in stats.items():
        if not (name == "poll" and path.endswith("zmq/sugar/poll.py")):
            where = f"{Path(path).name}:{line}({name})" if line else name
            rows.append([where, calls, round(tottime, 3), round(tottime / busy, 3)])
    rows.sort(key=lambda row: -row[2])
    return {
        "serve_s": round(total, 3),
        "idle_s": round(idle, 3),
        "busy_s": round(busy, 3),
        "top": rows[:count],
    }


def build_model_dir(work: Path) -> Path:
    import string

    from asyncrl.models import TinyModelConfig, build_tiny_model

    return build_tiny_model(work / "model", [string.printable], TinyModelConfig())


def run_chunks(args: argparse.Namespace, work: Path, children: list) -> dict[str, Any]:
    model_dir = build_model_dir(work)
    spawn = mp.get_context("spawn")
    senders, procs = [], []
    for i in range(args.senders):
        ours, theirs = spawn.Pipe()
        procs.append(spawn.Process(target=sender_main, args=(theirs, f"sender{i}"), daemon=True))
        procs[-1].start()
        children.append(procs[-1])
        senders.append(ours)
    runs = [
        chunk_run(args, work / f"chunks{r}", model_dir, senders, children) for r in range(args.runs)
    ]
    median = statistics.median(r["chunks_per_s"] for r in runs)
    out: dict[str, Any] = {
        "chunks_per_s": round(median),
        "chunks_per_s_runs": [round(r["chunks_per_s"]) for r in runs],
        "chunk_send_s_runs": [round(r["send_s"], 3) for r in runs],
        "chunk_total_s_runs": [round(r["total_s"], 3) for r in runs],
    }
    if args.profile == "always" or (args.profile == "auto" and median < args.target):
        profile = work / "serve.prof"
        profiled = chunk_run(args, work / "profiled", model_dir, senders, children, profile)
        out["profiled_chunks_per_s"] = round(profiled["chunks_per_s"])
        out["profile_top"] = top_costs(profile)
        pstats.Stats(str(profile), stream=sys.stderr).sort_stats("tottime").print_stats(20)
    for conn in senders:
        conn.send(None)
    for proc in procs:  # gone before the weights runs start
        proc.join(timeout=10)
    return out
