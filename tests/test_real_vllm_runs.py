"""Runs of the asynchronous loop whose generator drives a real vLLM server (the CPU build,
``tests/real_vllm.py``): attached by URL, its weights and labels following the trainer
and its tokens' versions exact; launched, killed mid-run and restarted while the run
goes on; attached, killed and staying down, which stops the run naming its URL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from subprocess import PIPE, STDOUT

import pytest

from asyncrl.engine.servers import die_with_parent

from .real_vllm import VLLM_PYTHON, real_vllm, restore_server, vllm_server, wait_until
from .test_remote_engine import ROOT

pytestmark = real_vllm


def grpo(run_dir: Path, model_dir: str, *overrides: str) -> list[str]:
    """``bpe_grpo`` (the BPE model's recipe) shrunk to a few small steps on ``model_dir``,
    its generator on vLLM's API."""
    cmd = [sys.executable, "launch/local.py", "experiments/bpe_grpo.py", f"run_dir={run_dir}"]
    cmd += [f"model.path={model_dir}", "eval.every_steps=0", "task.train_size=200"]
    cmd += ["buffer.prompts_per_batch=2", "buffer.samples_per_prompt=4", "rl.update_epochs=1"]
    cmd += ["buffer.dynamic_sampling=false", "buffer.max_staleness=1", "time_limit_s=400"]
    cmd += ["transport.heartbeat_s=0.2", "engine.backend=remote", "engine.remote.server=vllm"]
    return cmd + ["engine.remote.max_inflight=8", "trainer.checkpoint_every=0", *overrides]


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(f"{url}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def report(run_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "tools/run_report.py", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def trained_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    return sum('"train/loss"' in line for line in lines)


def test_async_grpo_attached_to_real_vllm(real_vllm_url, vllm_models, tmp_path):
    """Five steps: the generator loads each published version into vLLM and labels it, so
    ``/weight_info`` reads the trainer's versions in order and the last one at the end;
    every token's version is exact (the tokens sampled with the proximal version have
    behavior logprobs equal to the trainer's to float32 rounding: a token labelled with
    the wrong version would differ by far more); ``run_report`` prints the mismatch."""
    run_dir, url = tmp_path / "run", real_vllm_url
    labels: list[str] = []
    done = threading.Event()

    def watch() -> None:  # what /weight_info reads while the run goes on
        while not done.is_set():
            label = get(url, "/weight_info")["weight_version"]
            if not labels or labels[-1] != label:
                labels.append(label)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    cmd = grpo(run_dir, vllm_models["qwen-tied"], "rl.max_steps=5")
    cmd.append(f'engine.remote.urls=["{url}"]')
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        done.set()
        watcher.join(timeout=5)
        final = get(url, "/weight_info")["weight_version"]
        restore_server(url, vllm_models["qwen-tied"])  # for the tests after this one
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads((run_dir / "generator_g0_summary.json").read_text())
    versions = [int(label) for label in labels if label.isdigit()]
    assert versions == sorted(versions) and len(versions) >= 2, labels
    assert final == str(int(summary["version"])) and int(final) >= 3
    figures = report(run_dir)
    assert figures["steps"] == 5
    assert figures["mismatch_tokens"] > 0
    assert figures["mismatch_abs_logprob_diff_max"] < 1e-3, figures


def server_pid(run_dir: Path) -> int:
    """The pid of the generator's launched vLLM server (its API process)."""
    url = json.loads((run_dir / "endpoints" / "servers-g0.json").read_text())["0"]
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(
        ["pgrep", "-f", f"vllm.entrypoints.openai.api_server.*--port {port}"],
        capture_output=True,
        text=True,
    )
    return int(out.stdout.split()[0])


@pytest.mark.slow  # two minutes; CI restarts a killed server in tests/test_server_watch.py
def test_a_launched_real_vllm_killed_mid_run_is_restarted(vllm_models, tmp_path):
    """The generator's launched server is SIGKILLed after the first steps: the engine
    launches it again on its port, its requests go on there, it gets the newest weights
    before any request, and the run reaches its last step; the restart is counted in the
    generator's summary and the run report."""
    run_dir = tmp_path / "run"
    cmd = grpo(run_dir, vllm_models["qwen-tied"], "rl.max_steps=30")
    cmd += [f"engine.remote.python={VLLM_PYTHON}", "engine.remote.dtype=float32"]
    cmd += ['engine.remote.extra_args=["--enforce-eager"]']
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=PIPE, stderr=STDOUT, preexec_fn=die_with_parent)
    try:
        wait_until(lambda: trained_steps(run_dir) >= 2, 400, "two steps")
        os.killpg(os.getpgid(server_pid(run_dir)), signal.SIGKILL)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output.decode()[-4000:]
    summary = json.loads((run_dir / "generator_g0_summary.json").read_text())
    assert summary["engine"]["engine/server_restarts"] >= 1
    figures = report(run_dir)
    assert figures["steps"] == 30 and figures["server_restarts"] >= 1
    assert figures["mismatch_abs_logprob_diff_max"] < 1e-3, figures


@pytest.mark.slow  # CI has the same end in tests/test_server_watch.py, against the double
def test_an_attached_real_vllm_that_stays_down_stops_the_run(vllm_models, tmp_path):
    """An attached server killed mid-run and never back: its generator logs it with the
    URL every few seconds, and ``dead_after_s`` after it went away the run stops with an
    error naming it (within ``dead_after_s`` + 30 s), not a crash loop of restarts."""
    run_dir, dead_after_s = tmp_path / "run", 20
    log_dir = tmp_path / "server"
    log_dir.mkdir()
    with vllm_server(vllm_models["qwen-tied"], log_dir) as url:
        cmd = grpo(run_dir, vllm_models["qwen-tied"], "rl.max_steps=200")
        cmd += [f'engine.remote.urls=["{url}"]', f"engine.remote.dead_after_s={dead_after_s}"]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=PIPE, stderr=STDOUT, preexec_fn=die_with_parent
        )
        try:
            wait_until(lambda: trained_steps(run_dir) >= 2, 400, "two steps")
            port = url.rsplit(":", 1)[1]
            pids = subprocess.run(
                ["pgrep", "-f", f"vllm.entrypoints.openai.api_server.*--port {port}"],
                capture_output=True,
                text=True,
            ).stdout.split()
            os.killpg(os.getpgid(int(pids[0])), signal.SIGKILL)
            killed = time.monotonic()
            output, _ = proc.communicate(timeout=dead_after_s + 120)
            took = time.monotonic() - killed
        finally:
            if proc.poll() is None:
                proc.kill()
    text = output.decode()
    assert proc.returncode != 0, text[-3000:]
    assert took <= dead_after_s + 30, took
    assert url in text and f"dead_after_s={dead_after_s}" in text, text[-3000:]
    log = (run_dir / "logs" / "generator_0.log").read_text()
    assert log.count(f"cannot reach the server at {url}") >= 2
