"""Benchmark: chunk ingestion by the real buffer process, and weights broadcast over PUB/SUB.

Each half lives in its own module, whose docstring says how it measures:
``tools/bench_transport_chunks.py`` (``chunks_per_s``: chunks a real buffer server decodes
and applies per second) and ``tools/bench_transport_weights.py`` (``weights_gb_per_s``: a
state dict published once and rebuilt by every subscriber). ``--help`` prints both.

Every figure is the median over ``--runs`` runs; the machine is shared, so expect spread.
If the chunk median is below ``--target`` (or with ``--profile always``) one more run,
not counted, profiles ``BufferServer.serve`` with cProfile; the top costs go to stderr and
into the JSON (idle = time inside zmq's poll). Ends with one JSON line:

    {"chunks_per_s": ..., "weights_gb_per_s": ..., ...}

    python tools/bench_transport.py [--chunks 200000] [--runs 3] [--tensors 25]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_transport_chunks as chunks
import bench_transport_weights as weights
from bench_transport_common import cleanup


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="\n\n".join([__doc__, chunks.__doc__, weights.__doc__]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--chunks", type=int, default=200_000, help="chunks per run, all senders")
    parser.add_argument("--chunk-tokens", type=int, default=16, help="tokens per chunk")
    parser.add_argument("--senders", type=int, default=2, help="chunk sender processes")
    parser.add_argument("--leases", type=int, default=64, help="leases per sender")
    parser.add_argument("--samples-per-prompt", type=int, default=8, help="group size")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--tensors", type=int, default=25, help="tensors in the state dict")
    parser.add_argument("--tensor-numel", type=int, default=1_000_000, help="float32s per tensor")
    parser.add_argument("--subscribers", type=int, default=2, help="weights subscriber processes")
    parser.add_argument(
        "--weights-warmup",
        type=int,
        default=1,
        help="broadcasts before the timed ones (first-touch page faults)",
    )
    parser.add_argument("--target", type=float, default=50_000, help="chunks/s goal")
    parser.add_argument(
        "--profile",
        choices=["auto", "always", "never"],
        default="auto",
        help="profile the server in an extra run (auto: below --target)",
    )
    parser.add_argument("--skip", choices=["chunks", "weights"], action="append", default=[])
    parser.add_argument("--serve-profiled", nargs=2, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_profiled:
        chunks.serve_profiled(*args.serve_profiled)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still clean up on SIGTERM
    began = time.monotonic()
    children: list = []
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_transport") as tmp:
        try:
            if "chunks" not in args.skip:
                result |= chunks.run_chunks(args, Path(tmp), children)
            if "weights" not in args.skip:
                rates, nbytes = weights.weights_runs(args, Path(tmp), children)
                result |= {
                    "weights_gb_per_s": round(statistics.median(rates), 3),
                    "weights_gb_per_s_runs": [round(r, 3) for r in rates],
                    "weights_bytes": nbytes,
                }
        finally:
            cleanup(children)
    result |= {
        "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens,
        "senders": args.senders,
        "leases_per_sender": args.leases,
        "subscribers": args.subscribers,
        "runs": args.runs,
        "wall_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
