"""Held-out success of two image policies on the same pictures, paired: every held-out
scene, each from ``--noises`` starting noises, both policies from the same noises, judged
on their pixels as the image stages judge (``asyncrl.image.check``). The stages' own
evaluation draws 64 pictures of the 56 held-out scenes and moves by about ±5 points from
one draw to another; pairing the same pictures' starts and judging each scene several
times says whether a difference between two policies is more than that.

python tools/compare_image_policies.py POLICY_A POLICY_B [--noises 8]

Per category and over all (the categories' mean, as GenEval reports), the success of each
and how many pictures the second gets right that the first gets wrong and the reverse,
with a two-sided sign test. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compare_policies import sign_test  # noqa: E402

from asyncrl.image.check import judge  # noqa: E402
from asyncrl.image.model import ImagePolicy  # noqa: E402
from asyncrl.image.sample import generate_batched  # noqa: E402
from asyncrl.image.scenes import CATEGORIES, Scene, split  # noqa: E402


def successes(
    path: str, scenes: list[Scene], seeds: list[int], steps: int, shift: float
) -> list[bool]:
    """Whether each ODE picture of ``scenes[i]`` from ``seeds[i]`` passes every check."""
    policy = ImagePolicy.load(path)
    policy.eval()
    images = generate_batched(policy, [s.prompt for s in scenes], seeds, steps, shift)
    return [judge(img.numpy(), s).success for s, img in zip(scenes, images)]


def paired(cats: list[str], a: list[bool], b: list[bool]) -> dict[str, dict[str, float]]:
    """Per category and over all (success as the categories' mean): success of each, the
    discordant pictures, and the sign test."""
    rows = {cat: _row([i for i, c in enumerate(cats) if c == cat], a, b) for cat in CATEGORIES}
    rows["overall"] = _row(range(len(cats)), a, b)
    for key in ("success_a", "success_b"):
        rows["overall"][key] = sum(rows[c][key] for c in CATEGORIES) / len(CATEGORIES)
    return rows


def _row(idx: Sequence[int], a: list[bool], b: list[bool]) -> dict[str, float]:
    up = sum(b[i] and not a[i] for i in idx)
    down = sum(a[i] and not b[i] for i in idx)
    return {
        "pictures": len(idx),
        "success_a": sum(a[i] for i in idx) / len(idx),
        "success_b": sum(b[i] for i in idx) / len(idx),
        "b_right_a_wrong": up,
        "a_right_b_wrong": down,
        "sign_test_p": sign_test(up, down),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("policy_a")
    parser.add_argument("policy_b")
    parser.add_argument("--noises", type=int, default=8, help="pictures of each scene")
    parser.add_argument("--steps", type=int, default=10, help="ODE steps, as the stages judge")
    parser.add_argument("--shift", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.noises < 1:
        parser.error(f"--noises {args.noises}: at least 1")
    for path in (args.policy_a, args.policy_b):
        if not Path(path, "image_model.json").is_file():
            parser.error(f"{path}: not an image policy directory (no image_model.json)")
    torch.set_num_threads(args.threads)
    scenes = [s for s in split(held_out=True) for _ in range(args.noises)]
    seeds = [10_000 * k + i for i in range(len(scenes) // args.noises) for k in range(args.noises)]
    began = time.monotonic()
    a = successes(args.policy_a, scenes, seeds, args.steps, args.shift)
    b = successes(args.policy_b, scenes, seeds, args.steps, args.shift)
    rows = paired([s.category for s in scenes], a, b)
    for cat, r in rows.items():
        print(
            f"{cat:>12} {r['pictures']:>5} pictures  {r['success_a']:6.1%} -> {r['success_b']:6.1%}"
            f"  +{r['b_right_a_wrong']} -{r['a_right_b_wrong']}  p={r['sign_test_p']:.3f}"
        )
    rounded = {c: {k: round(v, 4) for k, v in r.items()} for c, r in rows.items()}
    out = {"scenes": len(scenes) // args.noises, "noises": args.noises, "by_category": rounded}
    print(json.dumps({**out, "seconds": round(time.monotonic() - began, 1)}))


if __name__ == "__main__":
    main()
