"""The discrete-event simulator (``asyncrl.sim``): the staleness bound at η = 0 and without
bound, admission against the real buffer, conservation of samples, calibration on a
hand-made run directory, the colocated placement's serial sum, and the command line.

Why one file: one component, the simulator, against the invariants of the system it models
and the real buffer's admission; calibration and its command line read the run directories
the other cases build.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring
from asyncrl.generator.stats import GeneratorStats, batch_bucket
from asyncrl.sim import SimConfig, SimParams, run_simulation, simulate
from asyncrl.sim.buffer import SimBuffer
from asyncrl.sim.calibrate import calibrate
from asyncrl.wire import Chunk, SamplingSpec

ROOT = Path(__file__).resolve().parents[1]


def small_config(**kw) -> SimConfig:
    base = dict(
        cores=64,
        duration_s=30.0,
        eval_every=0,
        prompts_per_batch=4,
        samples_per_prompt=2,
        engine_slots=8,
        max_new_tokens=16,
        max_staleness=2,
        dynamic_sampling=False,
    )
    return SimConfig(**{**base, **kw})


def small_params(**kw) -> SimParams:
    base = dict(
        decode_fixed_s=0.002,
        decode_per_seq_s=0.0005,
        prefill_per_token_s=0.0,
        recompute_per_token_s=0.0,
        flip_fixed_s=0.0,
        message_s=0.001,
        weight_sync_s=0.0,
        train_per_token_s=1e-3,
        train_fixed_s=0.0,
        prep_per_token_s=2e-4,
        publish_s=0.005,
        eval_s=0.0,
        completion_lengths={4: 1.0, 6: 1.0},
        prompt_lengths={10: 1.0},
        filter_schedule=[(0, 0.0)],
        gen_parallel_fraction=0.0,
        train_parallel_fraction=0.0,
    )
    return SimParams(**{**base, **kw})


def mean_staleness(histogram: dict[str, int]) -> float:
    return sum(int(k) * v for k, v in histogram.items()) / sum(histogram.values())


def test_eta0_consumes_only_fresh_samples_and_generators_idle_while_training():
    # The weights reach the generator 20 ms after the buffer opens the next batch: the
    # generator holds that batch's leases until they are in, so nothing is decoded with
    # the old weights and nothing is dropped as stale.
    cfg = small_config(max_staleness=0)
    out = simulate(small_params(weight_sync_s=0.02), cfg)
    assert out["steps"] > 20
    assert set(out["staleness_histogram"]) == {"0"}
    assert out["counts"].get("groups_stale", 0) == 0
    phases = out["trainer_phase_s_per_step"]
    train_share = (
        (phases["prep"] + phases["train"] + phases["publish"]) * out["steps"] / out["sim_time_s"]
    )
    assert 0.3 < train_share < 0.9
    # The generator idles while the trainer trains and then until the weights are in.
    weights_share = 0.02 * out["steps"] / out["sim_time_s"]
    assert out["generator_idle_fraction"] == pytest.approx(train_share + weights_share, abs=0.03)
    # … and the trainer idles while the generator works: the two shares add up to ~1.
    assert out["trainer_idle_fraction"] + train_share == pytest.approx(1.0, abs=0.03)


def test_unbounded_eta_with_a_slow_trainer_never_idles_generators_and_staleness_grows():
    params = small_params(train_per_token_s=0.02)  # a step of ~120 tokens takes ~2.4 s
    short = simulate(params, small_config(max_staleness=None, duration_s=30.0))
    long = simulate(params, small_config(max_staleness=None, duration_s=90.0))
    assert short["generator_idle_fraction"] < 0.01 and long["generator_idle_fraction"] < 0.01
    assert long["trainer_idle_fraction"] < 0.01
    assert (
        mean_staleness(long["staleness_histogram"])
        > 2 * mean_staleness(short["staleness_histogram"])
        > 0
    )
    assert max(int(k) for k in long["staleness_histogram"]) > 20  # ~37 steps, all behind
    # bounded, the same system never consumes anything older than η
    bounded = simulate(params, small_config(max_staleness=3, duration_s=30.0))
    assert max(int(k) for k in bounded["staleness_histogram"]) <= 3
    assert bounded["generator_idle_fraction"] > 0.5


def test_admission_matches_the_real_buffer_step_by_step():
    """The same script of leases, finishes (kept or filtered), consumption and versions
    through ``RolloutBuffer`` and ``SimBuffer``: the same prompts leased at every point."""
    B, n, eta = 2, 2, 1
    real = RolloutBuffer(
        BufferConfig(
            prompts_per_batch=B, samples_per_prompt=n, max_staleness=eta, dynamic_sampling=True
        ),
        "run",
        lambda pos: (pos, [1, 2, 3]),
        SamplingSpec(),
    )
    scoring = InlineScoring(lambda prompt_id, tokens, reason: float(tokens[0]))
    params = small_params(filter_schedule=[(0, 0.0)])
    cfg = small_config(
        prompts_per_batch=B, samples_per_prompt=n, max_staleness=eta, dynamic_sampling=True
    )
    sim = SimBuffer(cfg, params, random.Random(0))
    real_leases, sim_leases = [], []

    def lease() -> tuple[int, int]:
        got_real, got_sim = real.leases.lease("g0", 100, 0.0), sim.lease(100)
        real_leases.extend(got_real)
        sim_leases.extend(got_sim)
        return len(got_real), len(got_sim)

    def finish_group(i: int, keep: bool, version: int) -> None:
        params.filter_schedule = [(0, 0.0 if keep else 1.0)]
        for j in range(n):
            lease_ = real_leases[i * n + j]
            token = j if keep else 1  # distinct rewards keep a group, equal ones filter it
            real.leases.on_chunk(
                Chunk(
                    run_id="run",
                    worker_id="g0",
                    lease_id=lease_.lease_id,
                    seq=0,
                    token_ids=[token],
                    logprobs=[0.0],
                    versions=[version],
                    finished=True,
                    finish_reason="eos",
                ),
                0.0,
            )
            scoring.pump(real)
            sample = sim_leases[i * n + j]
            sample.first_version = version
            sim.finish(sample)

    assert lease() == ((0 + eta + 1) * B * n,) * 2  # version 0: (v + η + 1)·B prompts
    assert lease() == (0, 0)
    finish_group(0, keep=True, version=0)
    assert lease() == (0, 0)
    finish_group(1, keep=False, version=0)  # filtered: its count goes back, one new prompt
    assert lease() == (n, n)
    finish_group(2, keep=True, version=0)
    assert real.batches.batch_for(0, 0, 1) is not None and sim.take(0) is not None
    assert lease() == (0, 0)  # consuming does not open the gate; a new version does
    real.batches.set_version(1)
    sim.set_version(1)
    assert lease() == (B * n, B * n)
    finish_group(3, keep=True, version=0)
    finish_group(4, keep=True, version=2)
    real.batches.set_version(3)
    sim.set_version(3)
    # at step 3 group 3 (version 0) is stale (3 − 0 > η): dropped, its prompt re-queued;
    # group 4 (version 2) is fresh but alone, so no batch yet
    assert real.batches.batch_for(3, 0, 1) is None and sim.take(3) is None
    assert real.state.counts["groups_stale"] == sim.counts["groups_stale"] == 1
    assert real.state.prompts_counted == sim.prompts_counted == 5
    assert lease() == (5 * n, 5 * n)  # the re-queued prompt and 4 new: (3 + η + 1)·B counted
    assert real.state.prompts_counted == sim.prompts_counted == (3 + eta + 1) * B
    # the stale group's prompt went out again first, in both
    assert real_leases[-5 * n].prompt_id == real_leases[3 * n].prompt_id and not sim.retry
    assert real.state.counts["samples_created"] == sim.counts["samples_created"]
    assert len(real_leases) == len(sim_leases)


def test_samples_are_conserved():
    cfg = small_config(max_staleness=1, dynamic_sampling=True, num_generators=2, duration_s=40.0)
    params = small_params(filter_schedule=[(0, 0.3), (50, 0.6)], weight_sync_s=0.05)
    sim = run_simulation(params, cfg)
    c = sim.buffer.counts
    in_flight = sim.buffer.in_flight()
    assert (
        c["samples_created"]
        == c["samples_consumed"] + c["samples_filtered"] + c["samples_stale"] + in_flight
    )
    assert min(c["samples_consumed"], c["samples_filtered"], c["samples_stale"], in_flight) > 0
    sim.buffer.check_accounting()
    # every created sample is in exactly one place: queued, in an engine, or done
    running = sum(g.running + len(g.waiting) + len(g.inbox or []) for g in sim.generators)
    finished_in_groups = sum(g.finished for g in sim.buffer.groups.values())
    queued = len(sim.buffer.to_lease)
    on_the_wire = in_flight - running - finished_in_groups - queued
    assert 0 <= on_the_wire <= cfg.engine_slots * cfg.num_generators


def test_simulation_is_deterministic_for_a_seed():
    cfg = small_config(dynamic_sampling=True)
    params = small_params(filter_schedule=[(0, 0.5)])
    assert simulate(params, cfg) == simulate(params, cfg)
    assert (
        simulate(params, cfg)["counts"]
        != simulate(params, small_config(dynamic_sampling=True, seed=1))["counts"]
    )


def test_colocated_throughput_is_the_serial_sum_of_its_phases():
    L, prompt, B, n = 5, 10, 4, 2  # all B·n samples fit the slots: one wave of L engine steps
    params = small_params(
        completion_lengths={L: 1.0},
        prompt_lengths={prompt: 1.0},
        prefill_per_token_s=1e-4,
        eval_s=0.05,
    )
    cfg = small_config(
        placement="colocated",
        max_staleness=0,
        prompts_per_batch=B,
        samples_per_prompt=n,
        engine_slots=B * n,
        eval_every=2,
        duration_s=60.0,
    )
    tokens = B * n * (prompt + L)
    p = params
    generate = (
        L * p.decode_fixed_s
        + L * B * n * p.decode_per_seq_s
        + B * n * prompt * p.prefill_per_token_s
    )
    train = tokens * (p.prep_per_token_s + p.train_per_token_s) + p.publish_s
    cycle = generate + train + p.eval_s / cfg.eval_every
    out = simulate(params, cfg)
    assert out["steps_per_s"] == pytest.approx(1 / cycle, rel=0.01)
    assert out["trained_tokens_per_s"] == pytest.approx(tokens / cycle, rel=0.01)
    assert out["trainer_idle_fraction"] == pytest.approx(generate / cycle, rel=0.01)
    assert set(out["staleness_histogram"]) == {"0"}


# ---- calibration -----------------------------------------------------------------------
KNOWN = dict(
    train_per_token=4e-4,
    train_fixed=0.2,
    prep_per_token=1e-4,
    publish=0.003,
    eval_extra=0.5,
    decode_fixed=0.004,
    decode_per_seq=3e-4,
    flip_extra=0.06,
    stage=0.02,
    completion=5.0,
    prompt=20.0,
)


def write_run(run_dir: Path, by_batch: dict | None = None) -> None:
    """A run directory whose figures follow ``KNOWN`` exactly."""
    k, B, n = KNOWN, 8, 4
    run_dir.mkdir(parents=True)
    config = {
        "placement": "async",
        "num_generators": 1,
        "time_limit_s": 100.0,
        "buffer": {
            "prompts_per_batch": B,
            "samples_per_prompt": n,
            "max_staleness": 2,
            "dynamic_sampling": True,
        },
        "engine": {
            "max_slots": 32,
            "threads": 1,
            "max_prefill_tokens": 2048,
            "flip_policy": "recompute",
        },
        "trainer": {"num_ranks": 1, "threads_per_rank": 1},
        "sampling": {"max_new_tokens": 16},
        "eval": {"every_steps": 5},
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    lines, t = [], 0.0
    for step in range(1, 41):
        tokens = B * n * (k["prompt"] + k["completion"]) * (1 + 0.2 * ((step % 5) - 2) / 2)
        wait = 0.05 * (step % 3)
        step_s = k["train_per_token"] * tokens + k["train_fixed"]
        evaluated = step % 5 == 0
        t += (
            wait
            + k["prep_per_token"] * tokens
            + step_s
            + k["publish"]
            + (k["eval_extra"] if evaluated else 0)
        )
        rec = {
            "process": "trainer",
            "step": step,
            "time": t,
            "train/loss": 0.0,
            "train/tokens": tokens,
            "train/step_s": step_s,
            "train/wait_for_batch_s": wait,
            "train/weight_publish_s": k["publish"],
        }
        if evaluated:
            rec["eval/accuracy"] = 0.5
        lines.append(rec)
    for j, batch in enumerate([8, 12, 16, 20, 24, 28, 32] * 2):
        steps = 100.0
        busy = steps * (k["decode_fixed"] + k["decode_per_seq"] * batch)
        lines.append(
            {
                "process": "generator_g0",
                "step": j,
                "time": 5.0 * j,
                "generator/window_s": busy + 0.3,
                "generator/idle_s": 0.3,
                "generator/steps": steps,
                "generator/tokens": steps * batch,
            }
        )
    # filter share 0.2 over versions 0–25, then 0.4 over 25–50
    for version, filtered, kept in ((0, 0, 0), (25, 20, 80), (50, 60, 140)):
        lines.append(
            {
                "process": "buffer",
                "step": version,
                "time": float(version),
                "buffer/version": float(version),
                "buffer/groups_filtered": float(filtered),
                "buffer/groups_consumed": float(kept),
                "buffer/groups_stale": 0.0,
            }
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / "summary.json").write_text(json.dumps({"steps": 40, "train_time_s": t}))
    (run_dir / "buffer_counters.json").write_text(
        json.dumps(
            {"buffer/samples_scored": 1000.0, "buffer/tokens_received": 1000.0 * k["completion"]}
        )
    )
    summary = {
        "update_steps": 20.0,
        "steady_step_ms_mean": 10.0,
        "weights_received": 10.0,
        "update_step_ms_mean": 10.0 + 1000 * k["flip_extra"] * 10 / 20,
        "weight_stage_s": k["stage"],
        "loop_s": 100.0,
        "idle_s": 10.0,
        "steps": 1000.0,
    }
    if by_batch is not None:
        summary["steady_step_by_batch"] = by_batch
    (run_dir / "generator_g0_summary.json").write_text(json.dumps(summary))


def test_calibration_recovers_the_parameters_of_a_synthetic_run(tmp_path):
    write_run(tmp_path / "run")
    p = calibrate(tmp_path / "run", cores=4)
    k = KNOWN
    assert p.train_per_token_s == pytest.approx(k["train_per_token"], rel=1e-6)
    assert p.train_fixed_s == pytest.approx(k["train_fixed"], rel=1e-6)
    assert p.publish_s == pytest.approx(k["publish"], rel=1e-6)
    assert p.eval_s == pytest.approx(k["eval_extra"], rel=1e-6)
    tokens = 8 * 4 * (k["prompt"] + k["completion"])
    assert p.prep_per_token_s * tokens + p.prep_fixed_s == pytest.approx(
        k["prep_per_token"] * tokens, rel=1e-6
    )
    assert p.decode_fixed_s == pytest.approx(k["decode_fixed"], rel=1e-6)
    assert p.decode_per_seq_s == pytest.approx(k["decode_per_seq"], rel=1e-6)
    assert p.weight_sync_s == pytest.approx(k["publish"] + k["stage"], rel=1e-6)
    assert [q for _, q in p.filter_schedule] == pytest.approx([0.2, 0.4])
    assert p.completion_lengths == {5: 1.0}
    assert sum(w * x for x, w in p.prompt_lengths.items()) == pytest.approx(k["prompt"], rel=1e-6)
    mean_batch = sum([8, 12, 16, 20, 24, 28, 32]) / 7
    cached = mean_batch * (k["prompt"] + (k["completion"] - 1) / 2)
    assert p.recompute_per_token_s * cached == pytest.approx(k["flip_extra"], rel=1e-6)


def test_calibration_from_the_step_table_by_batch_size(tmp_path):
    c0, c1, c2, loop = 0.003, 2e-4, 5e-5, 0.001
    table = {}
    for b, prefill in ((8, 50), (16, 20), (32, 90), (48, 10), (64, 40)):
        seconds = 100 * (c0 + c1 * b + c2 * prefill)
        table[str(b)] = {
            "steps": 100.0,
            "seconds": seconds,
            "sequences": 100.0 * b,
            "prefill_tokens": 100.0 * prefill,
        }
    write_run(tmp_path / "run", by_batch=table)
    summary_path = tmp_path / "run" / "generator_g0_summary.json"
    summary = json.loads(summary_path.read_text())
    steady_s = sum(r["seconds"] for r in table.values())
    update_s = summary["update_steps"] * summary["update_step_ms_mean"] / 1000
    summary.update(steps=500.0 + summary["update_steps"], idle_s=1.0)
    summary["loop_s"] = 1.0 + steady_s + update_s + loop * summary["steps"]
    summary_path.write_text(json.dumps(summary))
    p = calibrate(tmp_path / "run", cores=4)
    assert p.decode_per_seq_s == pytest.approx(c1, rel=1e-6)
    assert p.prefill_per_token_s == pytest.approx(c2, rel=1e-6)
    assert p.decode_fixed_s == pytest.approx(c0 + loop, rel=1e-6)


def test_generator_stats_record_steady_steps_by_batch_size():
    stats = GeneratorStats()
    stats.on_step(0.01, tokens=3, during_update=False, prefill_tokens=40)
    stats.on_step(0.03, tokens=3, during_update=False, prefill_tokens=0)
    stats.on_step(0.50, tokens=3, during_update=True)  # update steps stay out of the table
    stats.on_step(0.02, tokens=100, during_update=False, prefill_tokens=8)
    table = stats.summary(version=0)["steady_step_by_batch"]
    assert table["3"] == {
        "steps": 2,
        "seconds": pytest.approx(0.04),
        "sequences": 6,
        "prefill_tokens": 40,
    }
    assert table[str(batch_bucket(100))]["sequences"] == 100 and batch_bucket(100) == 96
    assert batch_bucket(64) == 64 and batch_bucket(300) == 256
    assert "prefill_tokens" not in GeneratorStats().summary(0)["steady_step_by_batch"].get("1", {})


# ---- the command line ------------------------------------------------------------------
def test_cli_predict_and_sweep_end_with_one_json_line(tmp_path):
    write_run(tmp_path / "run")
    proc = subprocess.run(
        [
            sys.executable,
            "tools/simulate.py",
            "predict",
            "--calibrate",
            str(tmp_path / "run"),
            "max_staleness=0",
            "num_generators=2",
            "--cores",
            "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["config"]["max_staleness"] == 0 and result["config"]["num_generators"] == 2
    assert result["prediction"]["steps"] > 0 and set(
        result["prediction"]["staleness_histogram"]
    ) == {"0"}
    out = tmp_path / "sweep.csv"
    proc = subprocess.run(
        [
            sys.executable,
            "tools/simulate.py",
            "sweep",
            "--gpus",
            "32",
            "--model-params",
            "1e9",
            "--response-mean",
            "64",
            "--response-max",
            "256",
            "--batch",
            "16",
            "--samples",
            "4",
            "--etas",
            "0,4",
            "--steps",
            "6",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = out.read_text().splitlines()
    assert len(rows) > 3 and rows[0].startswith("placement,")
    assert (
        result["best"]["trained_tokens_per_s"]
        >= result["best_per_eta"]["0"]["trained_tokens_per_s"]
    )
    assert result["colocated_trained_tokens_per_s"] > 0
