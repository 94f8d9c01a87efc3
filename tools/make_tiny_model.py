"""Build a tiny random-init Qwen2 model and a character tokenizer over a task's alphabet,
saved with ``save_pretrained`` so it loads like any Hugging Face model.

    python tools/make_tiny_model.py --out runs/models/tiny-qwen2 [--experiment experiments/tiny_sft.py]
        [--value-head] [key=value overrides of that experiment, e.g. model.tiny.hidden_size=64]

The model's shape comes from the experiment's ``model.tiny`` and the alphabet from its
task (train and eval splits), so the tokenizer covers every character the run will see.
``--value-head`` saves it with a scalar head instead of the LM head (random, as the rest):
a reward model of a chosen size over the policy's tokens, for measuring what scoring
costs (``tools/elastic_study.py --role rewards``), not for learning from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from asyncrl.config import ConfigError, apply_overrides, load_experiment
from asyncrl.models import ModelConfig, load_model
from asyncrl.stages.sft import build_model_for_task
from asyncrl.tasks import build_task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output HF directory")
    parser.add_argument("--experiment", default="experiments/tiny_sft.py")
    parser.add_argument("--force", action="store_true", help="overwrite an existing directory")
    parser.add_argument("--value-head", action="store_true", help="a scalar head (reward model)")
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
    if args.value_head:
        model = load_model(ModelConfig(path=str(out), head="value"))
        torch.manual_seed(cfg.model.tiny.seed)
        with torch.no_grad():
            model.score.weight.normal_(0.0, 1.0)  # a head that varies: scores spread
        model.save_pretrained(out)
    head = "value" if args.value_head else "lm"
    params = sum(p.numel() for p in load_model(ModelConfig(path=str(out), head=head)).parameters())
    print(f"wrote {out} ({params / 1e6:.1f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
