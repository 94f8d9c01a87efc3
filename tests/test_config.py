from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, apply_overrides, load_json, save_json
from asyncrl.engine.config import EngineConfig
from asyncrl.stages.sft import SFTExperiment

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_parse_into_field_types():
    cfg = SFTExperiment()
    apply_overrides(
        cfg,
        [
            "optim.lr=0.01",
            "sft.max_steps=7",
            "trainer.resume=false",
            "trainer.packing=padded",
            "task.eval_path=none",
            "task.dataset_kwargs.max_digits=3",
            'task.dataset_kwargs.operators=["+"]',
        ],
    )
    assert cfg.optim.lr == 0.01 and isinstance(cfg.optim.lr, float)
    assert cfg.sft.max_steps == 7 and cfg.trainer.resume is False
    assert cfg.trainer.packing == "padded" and cfg.task.eval_path is None
    assert cfg.task.dataset_kwargs["max_digits"] == 3
    assert cfg.task.dataset_kwargs["operators"] == ["+"]


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ConfigError) as err:
        apply_overrides(SFTExperiment(), ["optim.lrr=0.1"])
    assert "optim.lrr" in str(err.value) and "optim.lr" in str(err.value)
    with pytest.raises(ConfigError, match="trainer.num_rank'"):
        apply_overrides(SFTExperiment(), ["trainer.num_rank=2"])


def test_unparsable_value_names_key_and_type():
    with pytest.raises(ConfigError) as err:
        apply_overrides(SFTExperiment(), ["sft.max_steps=many"])
    assert "sft.max_steps" in str(err.value) and "int" in str(err.value)
    with pytest.raises(ConfigError, match="trainer.packing"):
        apply_overrides(SFTExperiment(), ["trainer.packing=zigzag"])
    with pytest.raises(ConfigError, match="section"):
        apply_overrides(SFTExperiment(), ["optim=1"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(SFTExperiment(), ["optim.lr"])


def test_finalize_derives_once_and_json_roundtrip(tmp_path):
    cfg = SFTExperiment(run_dir=str(tmp_path / "run"))
    apply_overrides(cfg, ["sft.max_steps=42"])
    cfg.finalize()
    assert cfg.optim.total_steps == 42 and cfg.sft.export_dir.endswith("hf")
    save_json(cfg, tmp_path / "c.json")
    assert load_json(tmp_path / "c.json") == cfg


def test_launcher_rejects_bad_override_and_prints_config():
    bad = subprocess.run(
        [sys.executable, "launch/local.py", "experiments/tiny_sft.py", "optim.lrr=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "optim.lrr" in bad.stderr and "optim.lr" in bad.stderr
    ok = subprocess.run(
        [
            sys.executable,
            "launch/local.py",
            "experiments/tiny_sft.py",
            "optim.lr=0.5",
            "run_dir=/nonexistent/x",
            "--print-config",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    printed = json.loads(ok.stdout)
    assert printed["optim"]["lr"] == 0.5 and printed["run_dir"] == "/nonexistent/x"
    assert not Path("/nonexistent/x").exists()


@pytest.mark.parametrize(
    ("settings", "plan"),
    [
        ({}, ("embedded", "none", "buckets", False)),
        ({"backend": "remote", "remote.server": "embedded"}, ("remote", "embedded", "disk", False)),
        (
            {"backend": "remote", "remote.weight_update": "nccl"},
            ("remote", "sglang", "sglang_nccl", False),
        ),
        ({"backend": "remote", "remote.server": "vllm"}, ("remote", "vllm", "disk", False)),
        (
            {
                "backend": "remote",
                "remote.server": "vllm",
                "remote.weight_update": "gloo",
                "remote.urls": '["http://h:1"]',
            },
            ("remote", "vllm", "vllm_transfer", True),
        ),
        (
            {"backend": "remote", "remote.server": "vllm", "remote.weight_update": "nccl"},
            ("remote", "vllm", "vllm_transfer", False),
        ),
    ],
)
def test_the_backend_plan_resolves_the_engine_settings(settings, plan):
    cfg = apply_overrides(EngineConfig(), [f"{k}={v}" for k, v in settings.items()])
    got = cfg.plan()
    assert (got.engine, got.server, got.weights, got.attached) == plan
    assert got.own_sampler == (got.server in ("sglang", "vllm"))
