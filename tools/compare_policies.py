"""Greedy held-out accuracy of two policies on the same problems, paired: how many problems
the second gets right that the first gets wrong and the reverse, with a two-sided sign
test. One evaluation of 200 problems moves by ±3.5 points; the paired counts on a larger
split say whether a difference between two checkpoints is more than that.

python tools/compare_policies.py EXPERIMENT.py POLICY_A POLICY_B [--eval-size 1000]

The task is the experiment's; ``--eval-size`` draws a larger eval split, and problems that
are also in the RL prompt split are left out (RL trained on them). Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.config import load_experiment  # noqa: E402
from asyncrl.evaluation import greedy_completions, make_eval_engine, tokenize_prompts  # noqa: E402
from asyncrl.models import load_tokenizer  # noqa: E402
from asyncrl.tasks import build_task  # noqa: E402


def greedy_correct(policy: str, task, examples, cfg) -> list[bool]:
    """Whether each example's greedy completion by ``policy`` gets full marks, as the
    stages' held-out evaluation counts it (the embedded engine, ``greedy_completions``)."""
    tokenizer = load_tokenizer(policy)
    prompts = tokenize_prompts(tokenizer, task.config, examples)
    engine = make_eval_engine(
        replace(cfg.model, path=policy), cfg.eval, max(len(p) for p in prompts), torch.device("cpu")
    )
    completions = greedy_completions(engine, prompts, cfg.eval.max_new_tokens)
    return [
        task.score(ex, tokenizer.decode(ids, skip_special_tokens=True)) >= 1.0 - 1e-6
        for ex, ids in zip(examples, completions)
    ]


def sign_test(up: int, down: int) -> float:
    """Two-sided exact sign test of ``up`` against ``down`` discordant problems."""
    n, k = up + down, min(up, down)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment")
    parser.add_argument("policy_a")
    parser.add_argument("policy_b")
    parser.add_argument("--eval-size", type=int, default=0, help="0: the experiment's own")
    args = parser.parse_args(argv)
    cfg = load_experiment(args.experiment)
    task_cfg = replace(cfg.task, eval_size=args.eval_size or cfg.task.eval_size)
    rl_prompts = {ex.prompt for ex in build_task(cfg.task).examples(cfg.task.rl_split)}
    task = build_task(task_cfg)
    examples = [ex for ex in task.examples("eval") if ex.prompt not in rl_prompts]
    a = greedy_correct(args.policy_a, task, examples, cfg)
    b = greedy_correct(args.policy_b, task, examples, cfg)
    up = sum(y and not x for x, y in zip(a, b))
    down = sum(x and not y for x, y in zip(a, b))
    n = max(len(examples), 1)
    print(
        json.dumps(
            {
                "problems": len(examples),
                "accuracy_a": round(sum(a) / n, 4),
                "accuracy_b": round(sum(b) / n, 4),
                "b_right_a_wrong": up,
                "a_right_b_wrong": down,
                "sign_test_p": round(sign_test(up, down), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
