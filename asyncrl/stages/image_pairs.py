"""The preference pairs the image reward model and Diffusion-DPO train on, made once from
the SFT policy and kept (``asyncrl.image.pairs``): one file of training scenes' pairs,
one of held-out scenes' pairs, both beside each other under ``pairs.dir``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.image.model import ImagePolicy
from asyncrl.image.pairs import PicturePairs, make_pairs, rejudged
from asyncrl.image.scenes import sample_scenes

log = logging.getLogger(__name__)


@dataclass
class ImagePairsConfig:
    dir: str = "runs/data/image-pairs"
    """Where the pair files are kept (``train.npz``, ``held_out.npz``); made when missing,
    from the policy at ``policy``."""
    policy: str = "runs/models/image-sft"
    """The policy whose pictures are paired."""
    train_prompts: int = 2048
    """Training scenes drawn (categories in turn; a scene may come again), each one pair at
    most (none when its pictures are all judged alike)."""
    held_out_prompts: int = 256
    """Held-out scenes drawn, likewise, for measuring."""
    per_prompt: int = 4
    """Pictures drawn per prompt; its best- and worst-judged make the pair."""
    steps: int = 10
    """ODE steps of each picture."""
    shift: float = 3.0
    """SD3's time shift of those steps."""
    seed: int = 0
    """Seed of the scenes drawn and of every picture's noise."""
    rejudged: int = 0
    """Training pairs added by judging the kept pictures again against their scene or one a
    word away (``asyncrl.image.pairs.rejudged``), drawn afresh by each run from its seed;
    0: the judge's pairs only. Held-out pairs are never added to."""


def training_pairs(cfg: ImagePairsConfig, seed: int) -> PicturePairs:
    """The training scenes' pairs, with ``cfg.rejudged`` more drawn from ``seed``."""
    pairs = load_or_make(cfg, held_out=False)
    return pairs.joined(rejudged(pairs, cfg.rejudged, seed)) if cfg.rejudged else pairs


def load_or_make(cfg: ImagePairsConfig, held_out: bool) -> PicturePairs:
    """The pairs of the training or the held-out scenes; made and saved when missing."""
    path = Path(cfg.dir) / ("held_out.npz" if held_out else "train.npz")
    if path.exists():
        return PicturePairs.load(path)
    start = time.time()
    policy = ImagePolicy.load(cfg.policy)
    n = cfg.held_out_prompts if held_out else cfg.train_prompts
    log.info(
        "no %s: drawing %d pictures from %s to pair (minutes on a CPU; kept for later runs)",
        path,
        n * cfg.per_prompt,
        cfg.policy,
    )
    scenes = sample_scenes(n, held_out=held_out, seed=cfg.seed + int(held_out))
    seed = cfg.seed * 1_000_003 + (10**7 if held_out else 0)
    pairs = make_pairs(policy, scenes, cfg.per_prompt, cfg.steps, cfg.shift, seed)
    if not len(pairs):
        raise RuntimeError(
            f"no pairs from {cfg.policy}: the judge scored all {cfg.per_prompt} pictures of each "
            f"of {n} prompts alike; pair a stronger policy, or draw more (pairs.per_prompt)"
        )
    pairs.save(path)
    log.info("%d pairs of %d scenes in %.0f s: %s", len(pairs), n, time.time() - start, path)
    return pairs
