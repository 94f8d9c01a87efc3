"""Build a tiny random-init Qwen2 model and a character tokenizer over a task's alphabet,
saved with ``save_pretrained`` so it loads like any Hugging Face model.

    python tools/make_tiny_model.py --out runs/models/tiny-qwen2 [--experiment experiments/tiny_sft.py]
        [key=value overrides of that experiment, e.g. model.tiny.hidden_size=64]

The model's shape comes from the experiment's ``model.tiny`` and the alphabet from its
task (train and eval splits), so the tokenizer covers every character the run will see.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asyncrl.config import ConfigError, apply_overrides, load_experiment
from asyncrl.stages.sft import build_model_for_task
from asyncrl.tasks import build_task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output HF directory")
    parser.add_argument("--experiment", default="experiments/tiny_sft.py")
    parser.add_argument("--force", action="store_true", help="overwrite an existing directory")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"{out} exists; pass --force to rebuild it")
        return 0
    try:
        cfg = apply_overrides(load_experiment(args.experiment), args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    build_model_for_task(out, build_task(cfg.task), cfg.model)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
