"""``simulate(params, config)``: run the event simulation and report what a run report
would (``tools/run_report.py``'s names), so predictions and measurements line up."""

from __future__ import annotations

import random
from typing import Any

from asyncrl.sim.buffer import SimBuffer
from asyncrl.sim.model import SimConfig, SimParams
from asyncrl.sim.processes import Simulation


def run_simulation(params: SimParams, cfg: SimConfig) -> Simulation:
    """The finished ``Simulation``, for callers that inspect its processes."""
    if cfg.placement == "colocated" and cfg.max_staleness != 0:
        raise ValueError("the colocated placement is on-policy: max_staleness must be 0")
    sim = Simulation(cfg, params, SimBuffer(cfg, params, random.Random(cfg.seed)))
    sim.start()
    sim.loop.run(cfg.duration_s, stop=lambda: sim.done)
    return sim


def simulate(params: SimParams, cfg: SimConfig) -> dict[str, Any]:
    """Predicted figures of ``cfg`` with costs ``params`` over ``cfg.duration_s`` (or up to
    ``cfg.max_steps``): throughput, idle fractions, staleness histogram, counters."""
    return summarize(run_simulation(params, cfg))


def summarize(sim: Simulation) -> dict[str, Any]:
    t = sim.loop.now
    trainer, buffer, gens = sim.trainer, sim.buffer, sim.generators
    steps = [(end, tokens) for end, tokens in trainer.step_ends if end <= t]
    wait_s = trainer.wait_s + (t - trainer.wait_start if trainer.waiting else 0.0)
    gen_steps = sum(g.steps for g in gens)
    counts = dict(buffer.counts)
    per_step = {k: v / len(steps) for k, v in trainer.phase_s.items()} if steps else {}
    return {
        "sim_time_s": t,
        "steps": len(steps),
        "steps_per_s": len(steps) / t if t else 0.0,
        "trained_tokens_per_s": sum(k for _, k in steps) / t if t else 0.0,
        "generated_tokens_per_s": sum(g.tokens for g in gens) / t if t else 0.0,
        "generator_idle_fraction": 1.0 - sum(g.busy_s for g in gens) / (len(gens) * t)
        if t
        else 0.0,
        "trainer_idle_fraction": wait_s / t if t else 0.0,
        "staleness_histogram": {str(k): v for k, v in sorted(buffer.staleness.items())},
        "mean_active_batch": sum(g.tokens for g in gens) / gen_steps if gen_steps else 0.0,
        # occupied slots over time: a generator "busy" with a few long sequences is mostly empty
        "generator_slot_fill": sum(g.batch_s for g in gens) / (sum(g.slots for g in gens) * t)
        if t
        else 0.0,
        "weight_flips": sum(g.flips for g in gens),
        "trainer_phase_s_per_step": per_step,
        "counts": {**counts, "samples_in_flight": buffer.in_flight()},
    }
