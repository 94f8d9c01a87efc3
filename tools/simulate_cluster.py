"""``tools/simulate.py``'s cluster commands, on the GPU cost model (``asyncrl/sim/gpu.py``:
assumed figures, not measurements).

    python tools/simulate.py sweep --gpus 1024 --model-params 7e9 [...]
        Trainer/generator splits × η, plus the colocated placement, as CSV; the best split
        and η.
    python tools/simulate.py elastic --gpus 64 --slot-gpus 8 [--steps 120 ...]
        A run whose workload changes (responses grow ``--length-growth`` times, dynamic
        sampling drops ``--drop-start`` to ``--drop-end`` of the groups) on every fixed
        split of the cluster's slots, and under the elastic placement's controller
        (``asyncrl.elastic``, the launcher's own code) started from an even split: time
        to finish and trained tokens/s of each, the controller's moves, and a run that
        moves to the best fixed split at the first look (what any controller that must
        see the run before it moves could at best do from that start). With
        ``--verdict-tokens N``, a judge of the policy's size writing N tokens per sample
        scores every sample on slots of its own (``--judge-start`` at first; the fixed
        splits at each of ``--judge-slots``), and the controller moves slots between it
        and generation too.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
from pathlib import Path
from typing import Any

from asyncrl.elastic import ElasticConfig
from asyncrl.sim.elastic import MoveCosts, Phases
from asyncrl.sim.elastic_study import study
from asyncrl.sim.gpu import GpuSpec, Workload, sweep
from asyncrl.sim.scoring import Judge


def fmt_or_dash(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    for name in ("sweep", "elastic"):
        s = sub.add_parser(name)
        s.add_argument("--gpus", type=int, default=1024 if name == "sweep" else 64)
        s.add_argument("--model-params", type=float, default=7e9)
        s.add_argument("--prompt-tokens", type=int, default=256)
        s.add_argument("--response-mean", type=float, default=1024)
        s.add_argument("--response-max", type=int, default=8192)
        s.add_argument("--batch", type=int, default=512, help="prompts per batch (B)")
        s.add_argument("--samples", type=int, default=16, help="samples per prompt (n)")
        s.add_argument("--filter-probability", type=float, default=0.3)
        s.add_argument("--weight-sync", choices=["nccl", "disk"], default="nccl")
        s.add_argument(
            "--gpu", action="append", default=[], metavar="FIELD=VALUE", help="GpuSpec override"
        )
    s = sub.choices["sweep"]
    s.add_argument("--etas", default="0,1,2,4,8,16", help="comma-separated η; 'none' is unbounded")
    s.add_argument("--steps", type=int, default=12, help="least trainer steps simulated per point")
    s.add_argument("--out", default="runs/sim/sweep.csv")
    e = sub.choices["elastic"]
    e.add_argument("--slot-gpus", type=int, default=8, help="GPUs per slot (a move's unit)")
    e.add_argument("--eta", type=int, default=4, help="max_staleness")
    e.add_argument("--seed", type=int, default=0)
    for f in dataclasses.fields(Phases) + dataclasses.fields(MoveCosts):
        e.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    # A step of a 7B policy takes tens of seconds on 512 GPUs and minutes on 64, and grows
    # as responses lengthen: the window and dwell are counted in steps (--window-steps,
    # --dwell-steps), and these seconds are only their floor, where the launcher's
    # defaults suit steps of a second.
    e.add_argument("--dwell-s", type=float, default=180.0)
    e.add_argument("--window-s", type=float, default=60.0)
    # A window of three steps and a dwell of eight: a move on a cluster is judged on
    # the trained tokens/s of a few large steps, and two steps swing too much for that.
    e.add_argument("--window-steps", type=int, default=3)
    e.add_argument("--dwell-steps", type=int, default=8)
    e.add_argument("--max-step", type=int, default=8, help="most slots one move adds")
    e.add_argument(
        "--splits",
        type=splits_arg,
        default=(),
        help="fixed splits to compare (generating slots, e.g. 10-13 or 8,12); default: all",
    )
    e.add_argument(
        "--verdict-tokens", type=int, default=0, help="a judge's tokens per sample (0: no judge)"
    )
    e.add_argument("--judge-start", type=int, default=1, help="judge slots at the start")
    e.add_argument(
        "--judge-slots", type=splits_arg, default=(), help="judge slots of the fixed splits"
    )


def run_cluster_command(args: argparse.Namespace) -> dict[str, Any]:
    return run_sweep(args) if args.command == "sweep" else run_elastic(args)


def run_elastic(args: argparse.Namespace) -> dict[str, Any]:
    if args.gpus % args.slot_gpus:
        raise SystemExit(
            f"--gpus {args.gpus} is not a whole number of --slot-gpus {args.slot_gpus}"
        )
    phases = Phases(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Phases)})
    costs = MoveCosts(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MoveCosts)})
    control = ElasticConfig(
        dwell_s=args.dwell_s,
        window_s=args.window_s,
        window_steps=args.window_steps,
        dwell_steps=args.dwell_steps,
        max_step=args.max_step,
    )
    try:
        control.check(control.min_generators)
    except ValueError as e:  # a setting of the command line that cannot work
        raise SystemExit(str(e).replace("elastic.", "--").replace("_", "-")) from None
    w, gpu = workload_from_args(args), gpu_from_args(args.gpu)
    slots = (args.gpus // args.slot_gpus, args.slot_gpus)
    judge = Judge(args.verdict_tokens, args.judge_start) if args.verdict_tokens > 0 else None
    result = study(
        w,
        gpu,
        slots,
        phases,
        costs,
        control,
        args.eta,
        args.seed,
        args.splits,
        judge,
        args.judge_slots,
    )
    head = "generating/judging" if judge else "generating slots"
    print(f"{head:>16} {'time s':>9} {'trained tok/s':>14}")
    for g, r in result["fixed"].items():
        print(f"{g:>16} {r['time_s']:>9} {r['trained_tokens_per_s']:>14}")
    el = result["elastic"]
    print(f"{'elastic':>16} {el['time_s']:>9} {el['trained_tokens_per_s']:>14}")
    one = result["one_move_to_best"]
    print(f"{'one move to best':>16} {one['time_s']:>9}  (at the first look: the bound)")
    for m in el["moves"]:
        to = m["generator_slots"]
        to = f"{to}/{m['judge_slots']}" if "judge_slots" in m else to
        print(f"  {m['time_s']:>8.0f} s step {m['step']:>4}: -> {to} ({m['reason']})")
    return {
        "command": "elastic",
        **result,
        "phases": dataclasses.asdict(phases),
        "move_costs": dataclasses.asdict(costs),
        "workload": dataclasses.asdict(w),
        "note": "GPU figures and move costs are assumptions (asyncrl/sim), not measurements",
    }


def splits_arg(text: str) -> tuple[int, ...]:
    """``--splits``: "A-B" (inclusive) or "A,B,C"."""
    try:
        if "-" in text:
            low, high = (int(x) for x in text.split("-", 1))
            return tuple(range(low, high + 1))
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected A-B or A,B,C (whole numbers)"
        ) from None


def gpu_from_args(overrides: list[str]) -> GpuSpec:
    """The assumed GPU with ``FIELD=VALUE`` overrides."""
    gpu = GpuSpec()
    for item in overrides:
        key, value = item.split("=", 1)
        setattr(gpu, key, type(getattr(gpu, key))(float(value)) if key != "name" else value)
    return gpu


def workload_from_args(args: argparse.Namespace) -> Workload:
    return Workload(
        model_params=args.model_params,
        prompt_tokens=args.prompt_tokens,
        response_mean=args.response_mean,
        response_max=args.response_max,
        prompts_per_batch=args.batch,
        samples_per_prompt=args.samples,
        filter_probability=args.filter_probability,
        weight_sync=args.weight_sync,
    )


def write_csv(rows: list[dict[str, Any]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def print_sweep(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'placement':<10} {'eta':>4} {'trainer':>8} {'gens':>6} {'tok/s':>12} {'tok/s/gpu':>10} "
        f"{'step s':>8} {'gen idle':>9} {'slot fill':>9} {'trn idle':>9} {'stale':>6}"
    )
    for r in rows:
        print(
            f"{r['placement']:<10} {str(r['max_staleness']):>4} {r['trainer_gpus']:>8} {r['generator_gpus']:>6} "
            f"{r['trained_tokens_per_s']:>12.0f} {r['trained_tokens_per_s_per_gpu']:>10.1f} "
            f"{fmt_or_dash(r['step_s'], '8.1f')} {r['generator_idle_fraction']:>9.3f} {r['generator_slot_fill']:>9.3f} "
            f"{r['trainer_idle_fraction']:>9.3f} {r['mean_staleness']:>6.2f}"
        )


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    gpu = gpu_from_args(args.gpu)
    w = workload_from_args(args)
    etas = [None if e.strip().lower() == "none" else int(e) for e in args.etas.split(",")]
    rows = sweep(w, gpu, args.gpus, etas, steps=args.steps)
    out = Path(args.out)
    write_csv(rows, out)
    print_sweep(rows)
    async_rows = [r for r in rows if r["placement"] == "async"]
    best = max(async_rows, key=lambda r: r["trained_tokens_per_s"])
    per_eta = {
        str(e): max(
            (r for r in async_rows if r["max_staleness"] == e),
            key=lambda r: r["trained_tokens_per_s"],
        )
        for e in etas
    }
    coloc = next(r for r in rows if r["placement"] == "colocated")
    brief = (
        "trainer_gpus",
        "generator_gpus",
        "max_staleness",
        "trained_tokens_per_s",
        "mean_staleness",
    )
    return {
        "command": "sweep",
        "csv": str(out),
        "gpus": args.gpus,
        "model_params": args.model_params,
        "best": {k: best[k] for k in brief},
        "best_generator_to_trainer": best["generator_gpus"] / best["trainer_gpus"],
        "best_per_eta": {e: {k: r[k] for k in brief} for e, r in per_eta.items()},
        "colocated_trained_tokens_per_s": coloc["trained_tokens_per_s"],
        "workload": dataclasses.asdict(w),
        "gpu_assumed": dataclasses.asdict(gpu),
        "note": "GPU figures are assumptions (asyncrl/sim/gpu.py), not measurements",
    }
