"""The buffer process saves its state and resumes it: leases survive a restart, and the
counters carry on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import zmq

from asyncrl.buffer.config import BufferConfig, RolloutConfig
from asyncrl.config import save_json
from asyncrl.models import ModelConfig
from asyncrl.tasks import TaskConfig
from asyncrl.transport import make_socket, read_endpoints
from asyncrl.wire import Chunk, LeaseGrant, LeaseRequest, WireDecoder, encode


def _run_buffer_once(cfg: RolloutConfig, config_path, action) -> dict:
    """Start the buffer, run ``action(endpoints, ctx)``, stop it, return its counters."""
    for stale in (config_path.parent / "endpoints").glob("*.json"):
        stale.unlink()  # the previous process's endpoints
    with open(config_path.parent / "buffer.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.buffer.server", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
    ctx = zmq.Context()
    try:
        action(read_endpoints(cfg.run_dir, "buffer", timeout_s=60), ctx)
    finally:
        ctx.destroy(linger=0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    return json.loads((config_path.parent / "buffer_counters.json").read_text())


def test_buffer_restarts_from_its_saved_state(tmp_path, tiny_model_dir):
    cfg = RolloutConfig(
        run_dir=str(tmp_path),
        run_id="r",
        model=ModelConfig(path=tiny_model_dir),
        task=TaskConfig(train_size=100, eval_size=10),
        buffer=BufferConfig(prompts_per_batch=2, samples_per_prompt=2, heartbeat_timeout_s=60),
    )
    config_path = tmp_path / "rollout.json"
    save_json(cfg, config_path)
    leases = []

    def take_leases(endpoints, ctx):
        dealer = make_socket(ctx, zmq.DEALER, cfg.transport, identity="g0")
        dealer.connect(endpoints["leases"])
        dealer.send(encode(LeaseRequest(run_id="r", worker_id="g0", capacity=3)))
        assert dealer.poll(30_000)
        leases.extend(WireDecoder("r").decode(dealer.recv()).leases)

    first = _run_buffer_once(cfg, config_path, take_leases)
    assert first["buffer/leases_issued"] == 3 and (tmp_path / "buffer_state.msgpack").exists()

    def stream_into_old_lease(endpoints, ctx):
        push = make_socket(ctx, zmq.PUSH, cfg.transport)
        push.connect(endpoints["chunks"])
        push.send(
            encode(
                Chunk(
                    run_id="r",
                    worker_id="g0",
                    lease_id=leases[0].lease_id,
                    seq=0,
                    token_ids=[5, 6],
                    logprobs=[-1.0, -1.0],
                    versions=[0, 0],
                )
            )
        )
        dealer = make_socket(ctx, zmq.DEALER, cfg.transport, identity="g1")
        dealer.connect(endpoints["leases"])
        dealer.send(encode(LeaseRequest(run_id="r", worker_id="g1", capacity=1)))
        assert dealer.poll(30_000)
        grant = WireDecoder("r").decode(dealer.recv())
        assert isinstance(grant, LeaseGrant)
        # The fourth sample of the first two prompts, not a new prompt's first: state resumed.
        assert grant.leases[0].lease_id not in {lease.lease_id for lease in leases}
        assert (grant.leases[0].group_id, grant.leases[0].sample_index) == (1, 1)

    second = _run_buffer_once(cfg, config_path, stream_into_old_lease)
    assert second["buffer/leases_issued"] == 4
    assert second["buffer/tokens_received"] == 2  # the lease from before the restart still counts
    assert second["buffer/samples_created"] == first["buffer/samples_created"] == 4
