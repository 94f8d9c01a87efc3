"""The study tools end to end on a tiny model: every point is a real launcher run, the
CSV and plots are written, the final JSON line carries the figures the issue names, and
a finished point is not run again."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.launcher.study import evals_of

ROOT = Path(__file__).resolve().parents[1]


def tiny(model_dir: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        "rl.max_steps=2",
        "eval.every_steps=1",
        "eval.num_examples=8",
        "task.train_size=200",
        "task.eval_size=20",
        "task.rl_split=train",
        "buffer.prompts_per_batch=2",
        "buffer.samples_per_prompt=2",
        "engine.embedded.max_slots=8",
        "metrics.tensorboard=false",
    ]


def run_tool(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "etas, runs",
    [
        ("0", {("0", True)}),  # CI's one short run
        pytest.param("0,1", {("0", True), ("1", True), ("1", False)}, marks=pytest.mark.slow),
    ],
)
def test_staleness_study(tmp_path, tiny_model_dir, etas, runs):
    out = tmp_path / "staleness"
    args = [
        "tools/staleness_study.py",
        "--etas",
        etas,
        "--time-limit",
        "0",
        "--out",
        str(out),
        "--set",
        *tiny(tiny_model_dir),
    ]
    result = run_tool(args)
    assert {(r["eta"], r["decoupled"]) for r in result["runs"]} == runs  # η = 0 runs once
    for r in result["runs"]:
        assert r["steps"] == 2 and r["trained_tokens_per_s"] > 0
        assert sum(r["staleness_histogram"].values()) == 2 * 2 * 2  # steps × prompts × samples
        if r["eta"] == "0":
            assert set(r["staleness_histogram"]) == {"0"}
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert (
        len(rows) == len(runs)
        and "generator_idle_fraction" in rows[0]
        and "accuracy_at_min.0" in rows[0]
    )
    for png in ("accuracy_vs_time.png", "throughput_vs_eta.png", "final_accuracy_vs_eta.png"):
        assert (out / png).stat().st_size > 1000
    # A second call reuses the finished runs instead of running them again.
    logs = {p: p.stat().st_mtime for p in out.glob("*/launch.log")}
    run_tool(args)
    assert {p: p.stat().st_mtime for p in out.glob("*/launch.log")} == logs


def test_throughput_study(tmp_path, tiny_model_dir):
    out = tmp_path / "throughput"
    result = run_tool(
        [
            "tools/throughput_study.py",
            "--time-limit",
            "0",
            "--sweep-time-limit",
            "0",
            "--target",
            "0.0",
            "--out",
            str(out),
            "--set",
            *tiny(tiny_model_dir),
        ]
    )
    for mode in ("async", "sync", "colocated"):
        # target 0: the first evaluation reaches it, so the figure is that evaluation's time
        # on the trainer's clock (how long after the start depends on the machine's load)
        first_eval_s = min(t for t, _ in evals_of(out / f"{mode}-s0"))
        assert result[f"{mode}_s_to_target"] == first_eval_s >= 0
        assert result[f"{mode}_trained_tokens_per_s"] > 0
    assert (out / "results.csv").exists()


def test_compare_policies_pairs_the_problems(tiny_model_dir):
    """The same policy twice: equal accuracies and no discordant problem; and the sign
    test against hand-computed values."""
    sys.path.insert(0, str(ROOT / "tools"))
    from compare_policies import sign_test

    assert sign_test(0, 5) == 2 / 32 and sign_test(3, 3) == 1.0 and sign_test(0, 0) == 1.0
    assert abs(sign_test(1, 9) - 2 * 11 / 1024) < 1e-12
    figures = run_tool(
        [
            "tools/compare_policies.py",
            "experiments/tiny_grpo.py",
            tiny_model_dir,
            tiny_model_dir,
            "--eval-size",
            "30",
        ]
    )
    assert 0 < figures["problems"] <= 30
    assert figures["accuracy_a"] == figures["accuracy_b"]
    assert figures["b_right_a_wrong"] == figures["a_right_b_wrong"] == 0


def test_compare_image_policies_pairs_the_same_pictures(tmp_path):
    """Per category and over all (the categories' mean): the discordant pictures counted
    each way; and the same policy twice judged on every held-out scene with no difference."""
    sys.path.insert(0, str(ROOT / "tools"))
    from compare_image_policies import paired

    from asyncrl.image.model import ImageModelConfig, ImagePolicy
    from asyncrl.image.scenes import CATEGORIES, split

    cats = ["single"] * 4 + ["counting"] * 2 + ["two_objects", "position"]
    a = [True, True, False, False, True, False, False, True]
    b = [True, False, True, True, True, True, False, True]
    rows = paired(cats, a, b)
    assert (rows["single"]["b_right_a_wrong"], rows["single"]["a_right_b_wrong"]) == (2, 1)
    assert rows["single"]["success_a"] == 0.5 and rows["single"]["success_b"] == 0.75
    assert rows["counting"]["success_b"] == 1.0 and rows["position"]["sign_test_p"] == 1.0
    assert rows["overall"]["success_b"] == (0.75 + 1.0 + 0.0 + 1.0) / 4
    assert (rows["overall"]["b_right_a_wrong"], rows["overall"]["a_right_b_wrong"]) == (3, 1)
    policy = tmp_path / "policy"
    ImagePolicy(ImageModelConfig(layers=1, heads=2, head_dim=8, text_dim=16)).save(policy)
    figures = run_tool(
        ["tools/compare_image_policies.py", str(policy), str(policy), "--noises", "1"]
    )
    assert figures["scenes"] == len(split(held_out=True)) and figures["noises"] == 1
    by = figures["by_category"]
    assert sum(by[c]["pictures"] for c in CATEGORIES) == figures["scenes"]
    assert by["overall"]["b_right_a_wrong"] == by["overall"]["a_right_b_wrong"] == 0


def _elastic_study():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "elastic_study", ROOT / "tools" / "elastic_study.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_elastic_study_runs_each_fixed_count_and_an_elastic_run_not_told_the_best():
    study = _elastic_study()
    args = study.parse_args(
        [
            "--role",
            "rewards",
            "--counts",
            "1,2",
            "--seeds",
            "0,1",
            "--time-limit",
            "60",
            "--reward-model",
            "rm",
            "--set",
            "a=b",
        ]
    )
    points = {p.name: p for p in study.points_for(args)}
    assert sorted(points) == [
        "elastic_s0",
        "elastic_s1",
        "fixed1_s0",
        "fixed1_s1",
        "fixed2_s0",
        "fixed2_s1",
    ]
    assert "reward.model_servers=2" in points["fixed2_s1"].overrides
    elastic = points["elastic_s0"].overrides
    assert {"placement=elastic", "reward.model_servers=1", "elastic.max_reward_servers=2"} <= set(
        elastic
    )
    assert {"reward.source=model", "reward.model_path=rm", "a=b", "seed=0"} <= set(elastic)
    rows = [
        {"seed": s, "placement": p, "count": c, "trained_tokens_per_s": v, "elastic": None}
        for s, p, c, v in [
            (0, "fixed", 1, 100.0),
            (0, "fixed", 2, 150.0),
            (0, "elastic", 1, 141.0),
            (1, "fixed", 1, 110.0),
            (1, "fixed", 2, 130.0),
            (1, "elastic", 1, 147.0),
        ]
    ]
    summary = study.summarize(rows, "rewards")
    assert summary["fixed_trained_tokens_per_s"] == {"1": 105.0, "2": 140.0}
    assert summary["elastic_trained_tokens_per_s"] == 144.0
    assert summary["elastic_against_best_fixed"] == pytest.approx(144 / 140 - 1)
    with pytest.raises(SystemExit, match="--reward-model"):
        study.points_for(study.parse_args(["--role", "rewards"]))


def test_the_elastic_study_lends_the_trainer_s_waits_at_each_fixed_count_when_asked():
    study = _elastic_study()
    args = study.parse_args(["--counts", "1", "--lend"])
    points = {p.name: p for p in study.points_for(args)}
    assert sorted(points) == ["fixed1_s0", "lend1_s0"]  # one count: nowhere to move
    assert "generate_while_waiting=true" in points["lend1_s0"].overrides
    assert "generate_while_waiting=true" not in points["fixed1_s0"].overrides
    rows = [
        {"seed": 0, "placement": p, "count": 1, "trained_tokens_per_s": v, "elastic": None}
        for p, v in [("fixed", 100.0), ("lending", 120.0)]
    ]
    summary = study.summarize(rows, "generators")
    assert summary["lending_trained_tokens_per_s"] == {"1": 120.0}
    assert summary["lending_against_best_fixed"] == pytest.approx(0.2)
    assert summary["elastic_trained_tokens_per_s"] is None
