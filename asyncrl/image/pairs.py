"""Preference pairs of the image policy's own pictures, ranked by the judge: what the
image reward model and Diffusion-DPO train on (as ``tiny_rm``'s pairs are the text
policy's own completions, ranked by the verifier).

For each prompt the policy draws ``per_prompt`` pictures (ODE from distinct seeds: the
policy's own distribution, deterministic given the seeds); the judge scores each by the
share of the scene's checks it passes (``asyncrl.image.check``), and the best and the
worst make a pair when their scores differ. Pairs of training scenes train; pairs of
held-out scenes measure.

``rejudged`` gives more pairs of the same pictures: two pictures of a scene, or of a
scene one word away from it ("two" for "three", "red" for "blue", "left" for "right"),
judged against that scene, ranked by the judge as any pair is. The scorer then sees the
same pictures preferred one way under one prompt and the other way under the next, which
is what reading the words takes; held-out scenes are never the prompt.

``mirrored`` gives more pairs of the same: a pair flipped left-right with "left" and
"right" swapped in its prompt (or top-bottom with "above" and "below") is judged as the
pair was, so a scorer can learn that where objects lie matters only against the words.

A pair file is one ``.npz``: ``prompts`` (str), ``chosen`` and ``rejected`` (uint8
pictures [P, H, W, 3]) and their scores.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asyncrl.image.check import blobs, judge, judge_blobs
from asyncrl.image.model import ImagePolicy
from asyncrl.image.sample import generate_batched
from asyncrl.image.scenes import Scene, held_out_prompt, split

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 60.0
"""How often drawing pictures for pairs says how far it has come (it takes minutes)."""

SWAPPED_WORDS = (
    {"left": "right", "right": "left"},  # flipped left-right
    {"above": "below", "below": "above"},  # flipped top-bottom
)
"""The relation words a flip turns into each other: left-right, then top-bottom."""


@dataclass
class PicturePairs:
    prompts: list[str]
    chosen: np.ndarray
    """[P, H, W, 3] uint8: the better-judged picture of each pair."""
    rejected: np.ndarray
    chosen_score: np.ndarray
    """[P]: the share of its scene's checks each picture passes."""
    rejected_score: np.ndarray

    def __len__(self) -> int:
        return len(self.prompts)

    def joined(self, other: PicturePairs) -> PicturePairs:
        """These pairs, then ``other``'s."""
        return PicturePairs(
            self.prompts + other.prompts,
            np.concatenate([self.chosen, other.chosen]),
            np.concatenate([self.rejected, other.rejected]),
            np.concatenate([self.chosen_score, other.chosen_score]),
            np.concatenate([self.rejected_score, other.rejected_score]),
        )

    def save(self, path: str | Path) -> None:
        """Write ``path`` (an ``.npz``) whole or not at all."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.stem + ".partial.npz")
        np.savez_compressed(
            partial,
            prompts=np.array(self.prompts),
            chosen=self.chosen,
            rejected=self.rejected,
            chosen_score=self.chosen_score,
            rejected_score=self.rejected_score,
        )
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | Path) -> PicturePairs:
        with np.load(path) as data:
            return cls(
                [str(p) for p in data["prompts"]],
                data["chosen"],
                data["rejected"],
                data["chosen_score"],
                data["rejected_score"],
            )


def make_pairs(
    policy: ImagePolicy,
    scenes: list[Scene],
    per_prompt: int,
    steps: int,
    shift: float,
    seed: int,
    batch: int = 64,
) -> PicturePairs:
    """One pair per scene whose ``per_prompt`` pictures the judge does not score all
    alike (scene ``i``'s pictures from seeds ``seed + i·per_prompt + k``)."""
    was_training = policy.training
    policy.eval()
    prompts = [s.prompt for s in scenes for _ in range(per_prompt)]
    seeds = [seed + i for i in range(len(prompts))]
    start = said = time.monotonic()

    def progress(done: int) -> None:
        nonlocal said
        if time.monotonic() - said >= PROGRESS_EVERY_S:
            said = time.monotonic()
            log.info("%d of %d pictures drawn for pairs (%.0f s)", done, len(prompts), said - start)

    pictures = generate_batched(policy, prompts, seeds, steps, shift, batch, progress).numpy()
    policy.train(was_training)
    out: dict[str, list] = {k: [] for k in ("prompts", "chosen", "rejected", "cs", "rs")}
    for i, scene in enumerate(scenes):
        group = pictures[i * per_prompt : (i + 1) * per_prompt]
        scores = np.array([judge(p, scene).reward for p in group])
        best, worst = int(scores.argmax()), int(scores.argmin())
        if scores[best] > scores[worst]:
            out["prompts"].append(scene.prompt)
            out["chosen"].append(group[best])
            out["rejected"].append(group[worst])
            out["cs"].append(scores[best])
            out["rs"].append(scores[worst])
    return _collected(out, pictures.shape[1:])


def rejudged(pairs: PicturePairs, count: int, seed: int) -> PicturePairs:
    """Up to ``count`` pairs of ``pairs``' pictures judged against a training scene: the
    scene its pictures were drawn for or one a word away, two pictures drawn for either,
    kept when the judge scores them apart. Stops after ``20 × count`` draws."""
    scenes = {s.prompt: s for s in split(held_out=False)}
    pictures = np.concatenate([pairs.chosen, pairs.rejected])
    drawn_for = pairs.prompts + pairs.prompts
    of_prompt: dict[str, list[int]] = {}
    for i, prompt in enumerate(drawn_for):
        of_prompt.setdefault(prompt, []).append(i)
    found = [blobs(p) for p in pictures]
    near = {p: _one_word_away(p, scenes) for p in of_prompt}
    rng = np.random.default_rng(seed)
    out: dict[str, list] = {k: [] for k in ("prompts", "chosen", "rejected", "cs", "rs")}
    for _ in range(20 * count):
        if len(out["prompts"]) == count:
            break
        origin = drawn_for[rng.integers(len(drawn_for))]
        prompt = near[origin][rng.integers(len(near[origin]))]
        candidates = of_prompt[origin] + of_prompt.get(prompt, []) * (prompt != origin)
        a, b = rng.choice(candidates, size=2, replace=False)
        sa, sb = (judge_blobs(found[i], scenes[prompt]).reward for i in (a, b))
        if sa == sb:
            continue
        (better, sbetter), (worse, sworse) = sorted(((a, sa), (b, sb)), key=lambda x: -x[1])
        out["prompts"].append(prompt)
        out["chosen"].append(pictures[better])
        out["rejected"].append(pictures[worse])
        out["cs"].append(sbetter)
        out["rs"].append(sworse)
    return _collected(out, pictures.shape[1:])


def _collected(out: dict[str, list], picture_shape: tuple[int, ...]) -> PicturePairs:
    """The pairs gathered in ``out`` (prompts, chosen, rejected, their scores ``cs``, ``rs``)."""
    empty = np.zeros((0, *picture_shape), dtype=np.uint8)
    return PicturePairs(
        out["prompts"],
        np.stack(out["chosen"]) if out["chosen"] else empty,
        np.stack(out["rejected"]) if out["rejected"] else empty,
        np.array(out["cs"], dtype=np.float32),
        np.array(out["rs"], dtype=np.float32),
    )


def _one_word_away(prompt: str, scenes: dict[str, Scene]) -> list[str]:
    """``prompt`` and the training scenes' prompts that differ from it in one word."""
    words = prompt.split()
    return [prompt] + [
        other
        for other in scenes
        if len(o := other.split()) == len(words) and sum(x != y for x, y in zip(o, words)) == 1
    ]


def mirrored(
    chosen: np.ndarray, rejected: np.ndarray, prompts: list[str], rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Pairs [P, H, W, 3] with each flipped left-right, top-bottom, both or neither (a fair
    coin per flip and pair), and its prompt's relation words swapped to match. A flip
    whose prompt would be a held-out scene's is not made: held-out scenes stay unseen."""
    chosen, rejected, out = chosen.copy(), rejected.copy(), []
    for i, prompt in enumerate(prompts):
        for axis, swaps in ((1, SWAPPED_WORDS[0]), (0, SWAPPED_WORDS[1])):  # of a picture
            flipped = " ".join(swaps.get(w, w) for w in prompt.split())
            if rng.random() < 0.5 and not held_out_prompt(flipped):
                chosen[i] = np.flip(chosen[i], axis=axis)
                rejected[i] = np.flip(rejected[i], axis=axis)
                prompt = flipped
        out.append(prompt)
    return chosen, rejected, out
