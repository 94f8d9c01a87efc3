"""GPU placement (``asyncrl.launcher.devices``): which GPUs each process of a run sees on one
machine, what each Slurm step asks for, and that the local launcher and the servers a
generator launches apply it. Pure planning: GPU counts are injected, so it all runs on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import apply_overrides
from asyncrl.engine.config import RemoteEngineConfig
from asyncrl.engine.servers import server_command, server_env
from asyncrl.launcher.devices import (
    DeviceError,
    job_gpus_per_node,
    local_devices,
    slurm_step_gpus,
    srun_gpu_flags,
    visible_gpus,
)
from asyncrl.launcher.prepare import Prepared
from asyncrl.launcher.sbatch import SlurmOptions
from asyncrl.stages.rl_config import RLExperiment
from asyncrl.stages.sft import SFTExperiment

ROOT = Path(__file__).resolve().parents[1]
EIGHT = [str(i) for i in range(8)]
TP2 = ["engine.backend=remote", "engine.remote.server=sglang", "engine.remote.tp_size=2"]


def rl_stage(tmp_path: Path, *overrides: str) -> Prepared:
    """An RL stage with ``overrides``: its config and process list, nothing started."""
    cfg = apply_overrides(RLExperiment(run_dir=str(tmp_path)), list(overrides))
    config_path = tmp_path / "config.json"
    return Prepared(cfg, config_path, cfg.processes(str(config_path)))


def plan(stage: Prepared, visible: list[str], share: bool = False) -> dict[str, str]:
    return local_devices(stage.cfg, stage.processes, share=share, visible=visible)


# ---- what is visible -------------------------------------------------------------------
@pytest.mark.parametrize(
    "listed, count, want",
    [
        (None, 2, ["0", "1"]),
        ("4,5, 6", 3, ["4", "5", "6"]),
        ("GPU-aa,GPU-bb", 2, ["GPU-aa", "GPU-bb"]),
        ("0,1,7", 2, ["0", "1"]),  # CUDA stops at the first id it cannot find
        ("0,1", 0, []),  # a CPU build of torch: no GPU, whatever the variable says
        ("", 0, []),
    ],
)
def test_visible_gpus_come_from_cuda_visible_devices_or_the_device_count(listed, count, want):
    environ = {} if listed is None else {"CUDA_VISIBLE_DEVICES": listed}
    assert visible_gpus(environ, lambda: count) == want


# ---- one machine -----------------------------------------------------------------------
def test_trainer_ranks_share_their_gpus_and_each_server_gets_its_tensor_parallel_width(
    tmp_path,
):
    stage = rl_stage(tmp_path, "trainer.num_ranks=2", "num_generators=2", *TP2)
    assert plan(stage, EIGHT) == {
        # Every rank sees both and picks its own with LOCAL_RANK (asyncrl.trainer.dist).
        "trainer_0": "0,1",
        "trainer_1": "0,1",
        "generator_0": "2,3",
        "generator_1": "4,5",
        "buffer": "",  # sees no GPU: it opens no CUDA context on one another process holds
    }
    servers = rl_stage(tmp_path, "num_generators=1", *TP2, "engine.remote.num_servers=3")
    assert plan(servers, EIGHT)["generator_0"] == "1,2,3,4,5,6"


def test_plans_follow_the_visible_ids_and_the_devices_set_to_cpu(tmp_path):
    stage = rl_stage(tmp_path, "trainer.num_ranks=2", "num_generators=2")
    assert plan(stage, ["4", "5", "6", "7"]) == {
        "trainer_0": "4,5",
        "trainer_1": "4,5",
        "generator_0": "6",
        "generator_1": "7",
        "buffer": "",
    }
    cpu_trainer = rl_stage(tmp_path, "trainer.device=cpu", "num_generators=2")
    assert plan(cpu_trainer, ["0", "1"]) == {
        "trainer_0": "",
        "generator_0": "0",
        "generator_1": "1",
        "buffer": "",
    }
    attached = rl_stage(tmp_path, "engine.backend=remote", 'engine.remote.urls=["http://h:1"]')
    assert plan(attached, ["0"]) == {"trainer_0": "0", "generator_0": "", "buffer": ""}
    colocated = rl_stage(tmp_path, "placement=colocated")
    assert plan(colocated, ["0", "1"]) == {"trainer_0": "0"}
    sft = SFTExperiment(run_dir=str(tmp_path))
    sft.trainer.num_ranks = 3
    assert local_devices(sft, sft.processes("c.json"), visible=EIGHT) == dict.fromkeys(
        ["trainer_0", "trainer_1", "trainer_2"], "0,1,2"
    )


def test_without_gpus_nothing_is_set_unless_a_process_needs_one(tmp_path):
    assert plan(rl_stage(tmp_path, "num_generators=2", "trainer.num_ranks=2"), []) == {}
    assert (
        plan(rl_stage(tmp_path, "engine.backend=remote", "engine.remote.server=embedded"), []) == {}
    )
    with pytest.raises(DeviceError, match="trainer.num_ranks=1, trainer.device=cuda needs a GPU"):
        plan(rl_stage(tmp_path, "trainer.device=cuda"), [])
    with pytest.raises(DeviceError, match=r"tp_size=2 \(sglang\) needs a GPU"):
        plan(rl_stage(tmp_path, *TP2), [])


def test_a_run_that_does_not_fit_names_the_keys_and_the_count(tmp_path):
    stage = rl_stage(tmp_path, "trainer.num_ranks=2", "num_generators=2", *TP2)
    with pytest.raises(DeviceError) as info:
        plan(stage, ["0", "1", "2", "3"])
    message = str(info.value)
    assert "needs 6 GPUs and 4 are visible" in message
    assert "trainer 2 (trainer.num_ranks=2, trainer.device=auto)" in message
    assert "generators 2 × 2 (num_generators=2, engine.remote.num_servers=1" in message
    assert "engine.remote.tp_size=2" in message and "--share-gpus" in message


def test_sharing_spreads_groups_and_keeps_a_server_on_consecutive_gpus(tmp_path):
    one = rl_stage(tmp_path)
    assert plan(one, ["0"], share=True) == {"trainer_0": "0", "generator_0": "0", "buffer": ""}
    stage = rl_stage(tmp_path, "trainer.num_ranks=2", "num_generators=2", *TP2)
    assert plan(stage, ["0", "1", "2"], share=True) == {
        "trainer_0": "0,1",
        "trainer_1": "0,1",
        "generator_0": "1,2",  # the least used two consecutive GPUs
        "generator_1": "0,1",
        "buffer": "",
    }
    with pytest.raises(
        DeviceError,
        match=r"generator_0 needs 2 GPUs \(engine.remote.num_servers=1 .*\) and 1 are visible",
    ):
        plan(rl_stage(tmp_path, *TP2), ["0"], share=True)


def test_the_local_launcher_gives_each_process_its_gpus(tmp_path):
    from launch.local import local_processes

    stage = rl_stage(tmp_path, "trainer.num_ranks=2", "num_generators=2", *TP2)
    procs = {p.name: p for p in local_processes(stage, plan(stage, EIGHT))}
    assert procs["trainer_1"].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert procs["trainer_1"].env["LOCAL_RANK"] == "1"
    assert procs["generator_1"].env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert procs["buffer"].env["CUDA_VISIBLE_DEVICES"] == ""
    # This machine has no GPU: the environment stays the launcher's, as CPU runs always had.
    for proc in local_processes(rl_stage(tmp_path, "trainer.num_ranks=2", "num_generators=2")):
        assert proc.env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_the_local_launcher_refuses_a_plan_that_does_not_fit_before_starting_anything(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    import torch

    import launch.local as local

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(local, "run_stage", lambda *a: pytest.fail("a process was started"))
    argv = ["experiments/tiny_grpo.py", f"run_dir={tmp_path}", f"model.path={tiny_model_dir}"]
    assert local.main([*argv, "trainer.num_ranks=2"]) == 2
    assert "needs 3 GPUs and 2 are visible" in capsys.readouterr().err


def test_launched_servers_take_their_slice_of_the_generators_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5")
    embedded = RemoteEngineConfig(server="embedded", num_servers=4)
    assert server_env(embedded, 1)["CUDA_VISIBLE_DEVICES"] == "3"
    assert "VLLM_SERVER_DEV_MODE" not in server_env(embedded, 1)
    vllm = RemoteEngineConfig(server="vllm", num_servers=2, tp_size=2)
    assert server_env(vllm, 1)["CUDA_VISIBLE_DEVICES"] == "4,5"
    # sglang takes them itself, counted within what the generator sees.
    sglang = RemoteEngineConfig(server="sglang", num_servers=2, tp_size=2)
    assert server_env(sglang, 1) is None
    cmd = server_command(sglang, "model", 30001, 1, 0)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "2" and cmd[cmd.index("--tp-size") + 1] == "2"


# ---- Slurm -----------------------------------------------------------------------------
def test_slurm_steps_ask_for_their_gpus_and_nodes_must_hold_them(tmp_path):
    stage = rl_stage(tmp_path, "trainer.num_ranks=4", "num_generators=3", *TP2)
    opts = SlurmOptions(gen_nodes=2, train_nodes=2, gpus_per_node=8)
    steps = slurm_step_gpus(stage.cfg, stage.processes, opts)
    assert steps == {
        "buffer": 0,
        "generator_0": 2,
        "generator_1": 2,
        "generator_2": 2,
        "trainer": 2,
    }
    # One node for everything: 3 generators × 2 + 4 ranks.
    one = SlurmOptions(gen_nodes=1, train_nodes=1, nodes=1, gpus_per_node=8)
    with pytest.raises(DeviceError, match="node 0 of the job needs 10 GPUs .* is 8"):
        slurm_step_gpus(stage.cfg, stage.processes, one)
    assert slurm_step_gpus(stage.cfg, stage.processes, SlurmOptions(2, 2)) == {}


def test_the_job_asks_for_gpus_only_when_a_process_needs_one(tmp_path):
    opts = SlurmOptions(gen_nodes=2, train_nodes=1)
    servers = rl_stage(tmp_path, "trainer.num_ranks=2", "num_generators=3", *TP2)
    # The busiest node: generators 0 and 2 (round-robin) hold 4.
    assert job_gpus_per_node(servers.cfg, servers.processes, opts) == 4
    auto = rl_stage(tmp_path, "trainer.num_ranks=2", "num_generators=3")
    assert job_gpus_per_node(auto.cfg, auto.processes, opts) == 0  # maybe a CPU cluster
    cuda = rl_stage(tmp_path, "trainer.num_ranks=2", "trainer.device=cuda")
    assert job_gpus_per_node(cuda.cfg, cuda.processes, opts) == 2
    assert job_gpus_per_node(auto.cfg, auto.processes, SlurmOptions(2, 1, gpus_per_node=3)) == 3
    assert srun_gpu_flags(2, 8) == ["--gpus-per-task=2"]
    assert srun_gpu_flags(0, 8) == ["--gres=none"] and srun_gpu_flags(0, 0) == []


# ---- tools/gpu_check (its CPU-runnable parts) --------------------------------------------
def test_gpu_check_says_in_its_json_line_why_nothing_ran_without_cuda(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", "tools/gpu_check.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["env"]["cuda"] is False and figures["ok"] is False
    for part in ("model", "trainer", "engine", "loop", "nccl", "gpu_tests", "vllm_tests"):
        assert figures[part]["skipped"].startswith("no CUDA device"), part


def test_gpu_check_trainer_part_publishes_the_trained_weights_into_the_engine(
    tmp_path, tiny_model_dir
):
    """The trainer part's logic on the CPU: steps whose loss falls (in fp32: bf16 compute is
    CUDA's, so its own verdict is false here), then the publish into a decoding engine."""
    cmd = [sys.executable, "tools/gpu_check.py", "--child", "trainer", "--device", "cpu"]
    cmd += ["--model", tiny_model_dir, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = json.loads(proc.stdout.strip().splitlines()[-1])
    trainer, publish = parts["trainer"], parts["publish"]
    assert (
        trainer["loss_last"] < trainer["loss_first"] and trainer["compute_dtype"] == "torch.float32"
    )
    assert publish["ok"], publish
    assert (
        publish["max_logprob_diff_trainer_weights"]
        < 1e-4
        < publish["max_logprob_diff_start_weights"]
    )
    assert not parts["trainer_cpu_offload"].get("ok")  # offload needs an accelerator


def test_gpu_check_bounds_each_part_and_reports_what_became_of_it(tmp_path, monkeypatch):
    """Its parent with stand-in parts: one that hangs (with a child of its own) is killed at
    its limit, one that crashes says how, and the figures of those that ran are kept."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import gpu_check

    py = sys.executable
    parts = {
        "model": [py, "-c", "print('built')"],
        "trainer": [py, "-c", 'print(\'{"trainer": {"ok": true}, "publish": {"ok": true}}\')'],
        "engine": ["bash", "-c", "sleep 61.25 & sleep 60"],
        "nccl": [py, "-c", "import sys; print('no NCCL here', file=sys.stderr); sys.exit(3)"],
        "gpu_tests": [py, "-c", "print('3 passed in 1.0s')"],
    }
    monkeypatch.setattr(gpu_check, "env_figures", lambda: {"cuda": True})
    monkeypatch.setattr(gpu_check, "plan", lambda out, model: parts)
    monkeypatch.setitem(gpu_check.LIMITS_S, "engine", 1)
    start = time.monotonic()
    figures = gpu_check.run_all(tmp_path, budget_s=100)
    assert time.monotonic() - start < 30
    assert figures["trainer"]["ok"] and figures["publish"] == {"ok": True}
    assert figures["engine"]["error"].startswith("timed out after 1 s")
    assert figures["nccl"] == {
        "ok": False,
        "error": "exit 3: no NCCL here",
        "seconds": figures["nccl"]["seconds"],
    }
    assert figures["gpu_tests"]["summary"] == "3 passed in 1.0s" and figures["ok"] is False
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "sleep 61.25" not in ps  # the hung part's own child went with it
    # Too little budget left: the later parts are skipped, saying so.
    figures = gpu_check.run_all(tmp_path, budget_s=10)
    assert figures["model"]["skipped"] == "out of time (10 s budget)"
