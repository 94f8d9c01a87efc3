"""Make preference pairs for the reward-model and DPO stages by sampling a policy on an
experiment's task and grading the samples with the task's verifier
(``asyncrl.stages.preference_data``).

    python tools/make_preference_data.py --policy runs/models/tiny-sft \\
        --experiment experiments/tiny_sft.py --out-dir runs/data/tiny-prefs \\
        [--samples-per-prompt 8 ...] [key=value overrides of the experiment, e.g. task.eval_size=50]

Writes OUT_DIR/train.jsonl, OUT_DIR/eval.jsonl and OUT_DIR/train.stats.json, and prints
the counts as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asyncrl.config import ConfigError, apply_overrides, load_experiment
from asyncrl.stages.preference_data import PreferenceDataConfig, make_preference_data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policy", required=True, help="HF directory of the policy to sample")
    parser.add_argument(
        "--experiment",
        default="experiments/tiny_sft.py",
        help="experiment file whose task gives the prompts and the verifier",
    )
    parser.add_argument("--out-dir", required=True)
    defaults = PreferenceDataConfig(train_path="", eval_path="")
    parser.add_argument(
        "--prompt-split", choices=["train", "unseen"], default=defaults.prompt_split
    )
    for name in (
        "train_prompts",
        "samples_per_prompt",
        "max_new_tokens",
        "max_pairs_per_prompt",
        "seed",
        "threads",
        "max_slots",
    ):
        parser.add_argument(
            "--" + name.replace("_", "-"), type=int, default=getattr(defaults, name)
        )
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--train-pairing", choices=["zip", "all"], default=defaults.train_pairing)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the experiment")
    args = parser.parse_args(argv)
    try:
        experiment = apply_overrides(load_experiment(args.experiment), args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    cfg = PreferenceDataConfig(
        train_path=str(out / "train.jsonl"),
        eval_path=str(out / "eval.jsonl"),
        prompt_split=args.prompt_split,
        train_prompts=args.train_prompts,
        samples_per_prompt=args.samples_per_prompt,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        max_pairs_per_prompt=args.max_pairs_per_prompt,
        seed=args.seed,
        threads=args.threads,
        max_slots=args.max_slots,
        train_pairing=args.train_pairing,
    )
    stats = make_preference_data(args.policy, experiment.task, cfg)
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
