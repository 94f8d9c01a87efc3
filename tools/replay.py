"""Replay a finished asynchronous RL run: its trainer on exactly the batches it trained on,
and its samples from their versions' weights.

    python tools/replay.py RUN_DIR [--out DIR] [--from-step N] [--regenerate K] [key=value ...]

The batches are rebuilt from the buffer's write-ahead log (``asyncrl.loop.recorded``);
the trainer ranks run as in the run (same config, ranks and threads), publishing to
nobody, into ``--out`` (default ``RUN_DIR/replay``). Then:

- the replay's last checkpoint is compared with the run's, tensor by tensor
  (``bitwise_equal``, ``max_abs_weight_diff``; null when the run kept no checkpoint of
  its last step);
- up to K recorded samples whose tokens one version sampled (the starting model, or a
  kept checkpoint's step) are decoded again with their seeds and compared token by token.

To debug, replay from a checkpoint of the run with one setting changed, e.g.
``--from-step 50 rl.loss.clip_high=0.2``: the replay starts from that checkpoint and
trains on the steps after it. Ends with one JSON line: ``{"steps", "bitwise_equal",
"max_abs_weight_diff", "samples_regenerated", "samples_equal"}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import ConfigError, apply_overrides, load_json, save_json  # noqa: E402
from asyncrl.launcher.prepare import Prepared, clear_rendezvous  # noqa: E402
from asyncrl.launcher.supervise import supervise  # noqa: E402
from asyncrl.loop.recorded import (  # noqa: E402
    ReplayError,
    checkpoint_weights,
    weight_difference,
)
from asyncrl.stages.common import trainer_ranks  # noqa: E402
from asyncrl.stages.replay import recorded_run, regenerate  # noqa: E402
from launch.local import local_processes  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="a finished RL run's directory")
    parser.add_argument("overrides", nargs="*", help="key.sub=value settings to change")
    parser.add_argument("--out", type=Path, help="the replay's directory (RUN_DIR/replay)")
    parser.add_argument(
        "--from-step", type=int, help="start from the run's checkpoint of this step"
    )
    parser.add_argument("--regenerate", type=int, default=200, help="samples to decode again")
    return parser.parse_intermixed_args(argv)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def replay_config(args: argparse.Namespace, steps: int):
    """The run's config, pointed at the replay's directory, stopping where the run did."""
    cfg = load_json(args.run_dir / "config.json")
    cfg.run_dir = str(args.out)
    cfg.time_limit_s, cfg.stop_at_accuracy = 0.0, 0.0
    cfg.rl.max_steps, cfg.rl.export_dir = steps, ""
    cfg.trainer.resume = args.from_step is not None
    return apply_overrides(cfg, args.overrides)


def run_trainer(args: argparse.Namespace, cfg) -> int:
    """Start the replay's trainer ranks and wait for them."""
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    if args.from_step is not None:
        start = step_dir(args.run_dir, args.from_step)
        if not start.is_dir():
            raise ReplayError(f"{start} does not exist: the run kept no checkpoint of that step")
        shutil.copytree(start, step_dir(args.out, args.from_step))
    config_path = args.out / "config.json"
    save_json(cfg, config_path)
    source = ["--source", str(args.run_dir)]
    specs = [
        replace(spec, module="asyncrl.stages.replay", args=[*spec.args, *source])
        for spec in trainer_ranks(cfg, str(config_path))
    ]
    clear_rendezvous(args.out)
    return supervise(local_processes(Prepared(cfg, config_path, specs)))


def compare(args: argparse.Namespace, steps: int) -> tuple[bool | None, float | None]:
    ours, theirs = step_dir(args.out, steps), step_dir(args.run_dir, steps)
    if not theirs.is_dir():
        print(f"[replay] the run kept no checkpoint of step {steps}: no weights to compare")
        return None, None
    diff = weight_difference(checkpoint_weights(ours), checkpoint_weights(theirs))
    return diff == 0.0, diff


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out or args.run_dir / "replay"
    try:
        recorded = recorded_run(args.run_dir)
        cfg = replay_config(args, recorded.steps)
        print(f"[replay] {recorded.steps} steps rebuilt from {args.run_dir}/buffer_wal")
        code = run_trainer(args, cfg)
    except (ReplayError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if code != 0:
        return code
    equal, diff = compare(args, recorded.steps)

    kept = sorted((args.run_dir / "checkpoints").glob("step_*[0-9]"))
    weights = {0: None} | {int(p.name.removeprefix("step_")): p for p in kept}
    samples = [s for _, s in recorded.samples()]
    regenerated = regenerate(args.run_dir, samples, weights, args.regenerate)
    print(f"[replay] samples decoded again, by version: {regenerated.versions}")
    for which in regenerated.mismatches:
        print(f"[replay] tokens differ: {which}")
    figures = {
        "steps": recorded.steps,
        "bitwise_equal": equal,
        "max_abs_weight_diff": diff,
        "samples_regenerated": regenerated.checked,
        "samples_equal": regenerated.equal,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
