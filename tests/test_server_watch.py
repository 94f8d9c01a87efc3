"""No silent hang when a server dies (``asyncrl.engine.server_watch``), and a run whose
trainer never steps still ends at its time limit: against asyncrl's front, launched by
the engine or attached, killed mid-request."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.engine.base import Request, SamplingParams, ServerFailed
from asyncrl.engine.remote import RemoteEngine

from .sglang_client import free_port, start_server, wait_healthy
from .test_remote_engine import ROOT, drain, perturbed_weights, post, remote_config


def front(model_dir: str, log_dir) -> tuple[subprocess.Popen, str]:
    """asyncrl's front in its own process group; (process, URL)."""
    port, log_path = free_port(), log_dir / "front.log"
    cmd = [sys.executable, "-m", "asyncrl.serving.serve", "--model", model_dir]
    cmd += ["--port", str(port), "--max-slots", "8", "--max-seq-len", "128", "--threads", "1"]
    proc = start_server(cmd, log_path)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log_path, timeout=120)
    return proc, url


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def under_way(engine: RemoteEngine) -> str:
    """The id of a request the engine's server is generating: one that has tokens and has
    not finished. The tiny model samples its EOS about one token in twenty, so a request
    may end at its first token; then another is sent."""
    for attempt in range(20):
        rid = f"r{attempt}"
        engine.submit(Request(rid, [3, 4, 5], SamplingParams(max_new_tokens=100)))
        while not (out := engine.step()).tokens and not out.finished:  # sent at a step
            pass
        if not any(f.request_id == rid for f in out.finished):
            return rid
    raise AssertionError("20 requests in a row ended at their first tokens")


def test_an_attached_server_that_stays_down_ends_the_engine_naming_it(
    tiny_model_dir, tmp_path, caplog
):
    """Its requests wait for it (logged every few seconds with its URL and the error);
    after ``dead_after_s`` the next step raises ``ServerFailed`` naming the URL."""
    proc, url = front(tiny_model_dir, tmp_path)
    engine = RemoteEngine(tiny_model_dir, remote_config(urls=[url], dead_after_s=12).remote)
    try:
        post(url, "/slow_down", {"forward_sleep_time": 0.05})
        engine.submit(Request("a", [3, 4, 5], SamplingParams(max_new_tokens=100)))
        time.sleep(0.5)
        kill(proc)
        start = time.monotonic()
        caplog.set_level(logging.WARNING, logger="asyncrl.remote")
        with pytest.raises(ServerFailed, match=url) as failed:
            while time.monotonic() - start < 60:
                engine.step()
        took = time.monotonic() - start
        assert 12 <= took <= 12 + 10, took
        assert "dead_after_s=12" in str(failed.value)
        waits = [r for r in caplog.records if "cannot reach the server at" in r.message]
        assert len(waits) >= 2 and all(url in r.message for r in waits)
        assert engine.status().metrics["engine/servers_down"] == 1
    finally:
        engine.close()


def test_an_idle_engine_reports_its_lost_server_in_its_status(tiny_model_dir, tmp_path):
    """Its one request aborted after the server went down, the engine has nothing to step
    (and no free slot to lease into): the failure still shows, in ``status().failure``,
    which the generator reads every turn, so an idle generator stops too."""
    proc, url = front(tiny_model_dir, tmp_path)
    engine = RemoteEngine(tiny_model_dir, remote_config(urls=[url], dead_after_s=8).remote)
    try:
        post(url, "/slow_down", {"forward_sleep_time": 0.05})
        rid = under_way(engine)
        kill(proc)  # within a decode step (50 ms) of its last token: it is still running
        start = time.monotonic()
        while engine.status().metrics["engine/servers_down"] == 0:
            assert time.monotonic() - start < 20, "the lost server was never noticed"
            engine.step()
        engine.abort(rid)
        while (status := engine.status()).failure is None:
            assert time.monotonic() - start < 30, "no failure reported"
            time.sleep(0.2)
        assert url in status.failure and "dead_after_s=8" in status.failure
        assert status.free_slots <= 0 and 8 <= time.monotonic() - start <= 8 + 10
    finally:
        engine.close()


def test_a_launched_server_that_dies_is_restarted_and_its_request_goes_on(tiny_model_dir, tmp_path):
    """The engine starts its server again on the same port; the request in flight is sent
    again as prompt + tokens so far and finishes; the restart is counted."""
    engine = RemoteEngine(
        tiny_model_dir, remote_config(max_inflight=4).remote, log_dir=tmp_path, name="g0"
    )
    try:
        url = engine.urls[0]
        post(url, "/slow_down", {"forward_sleep_time": 0.05})
        params = SamplingParams(max_new_tokens=60, temperature=0.0)
        engine.submit(Request("a", [3, 4, 5], params))
        tokens: list = []
        while len(tokens) < 5:
            tokens += engine.step().tokens
        os.killpg(engine.servers[0].server.process.pid, signal.SIGKILL)
        more, finished = drain(engine, ["a"], timeout_s=120)
        assert finished["a"].reason in ("length", "eos")
        assert finished["a"].num_tokens == len(tokens) + len(more.get("a", []))
        status = engine.status()
        assert status.metrics["engine/server_restarts"] == 1 and engine.urls == [url]
        assert status.metrics["engine/servers_down"] == 0
    finally:
        engine.close()


def test_a_launched_server_dead_when_weights_come_is_restarted_and_gets_them(
    tiny_model_dir, tmp_path
):
    """A server that dies while the engine has no request out is found by the weight
    update that cannot reach it (no request would: it gets none while it waits for
    weights): the engine starts it again, and the next announcement of those weights
    brings them in."""
    engine = RemoteEngine(tiny_model_dir, remote_config().remote, log_dir=tmp_path, name="g0")
    try:
        os.killpg(engine.servers[0].server.process.pid, signal.SIGKILL)
        engine.servers[0].server.process.wait(timeout=30)
        weights = perturbed_weights(tiny_model_dir, tmp_path / "v1")
        engine.stage_weights(str(weights), 1)
        deadline = time.monotonic() + 180
        while (m := engine.status().metrics)["engine/server_restarts"] < 1 or m[
            "engine/servers_down"
        ]:
            assert time.monotonic() < deadline, m
            engine.step()
            time.sleep(0.1)
        engine.stage_weights(str(weights), 1, wait=True)  # the trainer's next announcement
        assert engine.status().metrics["engine/version"] == 1
    finally:
        engine.close()


def test_a_run_whose_trainer_never_steps_ends_at_its_time_limit(tiny_model_dir, tmp_path):
    """A generator too slow to fill a batch (its server takes 5 s a decode step): the
    trainer waits for its first batch, and at ``time_limit_s`` it stops waiting and the
    run ends, well within the limit plus a minute."""
    proc, url = front(tiny_model_dir, tmp_path)
    try:
        post(url, "/slow_down", {"forward_sleep_time": 5.0})
        run_dir = tmp_path / "run"
        cmd = [sys.executable, "launch/local.py", "experiments/tiny_grpo.py"]
        cmd += [f"run_dir={run_dir}", f"model.path={tiny_model_dir}", "time_limit_s=20"]
        cmd += ["eval.every_steps=0", "rl.max_steps=50", "engine.backend=remote"]
        cmd += ["engine.remote.server=sglang", f'engine.remote.urls=["{url}"]']
        start = time.monotonic()
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        took = time.monotonic() - start
    finally:
        kill(proc)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = (run_dir / "summary.json").read_text()
    assert '"steps": 0' in summary
    assert took < 20 + 60, took
    assert "the time limit passed waiting" in (run_dir / "logs" / "trainer_0.log").read_text()


HOLDER = """
import subprocess, sys, time
from asyncrl.engine.servers import die_with_parent
child = subprocess.Popen(["sleep", "300"], start_new_session=True, preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(300)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie awaiting its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launched_server_ends_when_its_launcher_is_killed():
    """A server in its own process group (so a stop reaches its engine core) outlives a
    SIGKILLed launcher unless it asked for a death signal: ``die_with_parent`` does."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, cwd=ROOT)
    child = int(holder.stdout.readline())
    assert running(child)
    holder.kill()
    holder.wait(timeout=30)
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = running(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the launched process outlived its SIGKILLed launcher"
