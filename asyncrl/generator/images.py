"""The image generator: the generator process (``asyncrl.generator.worker``) with the
image engine (``asyncrl.engine.image``) in place of a text engine.

The loop is the generator's own: leases in as the engine has room, weights staged by the
intake thread and flipped between denoising steps, heartbeats, revocations, drain. What
differs is what a lease becomes and what a finished one carries:

- a lease is a picture: its prompt's words (``prompt_ids``), its sample's seed (and,
  under ``image.shared_start``, its group's start seed, from the run's seed and the
  group), and the frames an earlier holder sent (``prefix_frames``), which it continues
  from;
- each step goes out as a token does (its index, log-probability and version), its frames
  beside it in the same chunk (``Chunk.frames``), every ``chunk_tokens`` steps or
  ``chunk_ms``;
- a finished picture is judged here (``asyncrl.image.check``) and the share of the scene's
  checks it passes (each group's count, colour and shape, nothing else there, the
  relation) goes with its last chunk as the sample's reward, as an environment's does
  for an episode. Partial credit, because from a weak start whole successes are rare
  and a group whose pictures all score 0 teaches nothing; evaluation counts only whole
  successes.

    python -m asyncrl.generator.images --config RUN_DIR/rollout.json --worker-id g0
"""

from __future__ import annotations

import argparse
import random
import signal
import time

import torch

from asyncrl.buffer.image_rollout import ImageRolloutConfig
from asyncrl.config import load_json
from asyncrl.engine.base import StepOutput
from asyncrl.engine.image import ImageEngine, ImageRequest, ImageStepOutput
from asyncrl.engine.leases import record_tokens
from asyncrl.generator.worker import GeneratorWorker
from asyncrl.image.check import judge
from asyncrl.image.frames import from_bytes, prompt_text, to_bytes
from asyncrl.image.model import ImagePolicy, to_images
from asyncrl.image.scenes import all_scenes
from asyncrl.liveness import EXIT_DRAINED
from asyncrl.seeds import derive_seed
from asyncrl.wire import Lease


class ImageGeneratorWorker(GeneratorWorker):
    def __init__(self, cfg: ImageRolloutConfig, worker_id: str, engine: ImageEngine) -> None:
        super().__init__(cfg, worker_id, engine)
        self.scenes = {scene.prompt: scene for scene in all_scenes()}
        self.rewarded = 0  # pictures judged here

    def request_of(self, lease: Lease) -> ImageRequest:
        prompt = prompt_text(lease.prompt_ids)
        if prompt not in self.scenes:
            raise ValueError(f"lease {lease.lease_id}: {prompt!r} is no scene of the image task")
        frames = None
        if lease.prefix_frames:
            frames = from_bytes(lease.prefix_frames, f"lease {lease.lease_id}'s prefix frames")
            if len(frames) != len(lease.prefix_ids) + 1:
                raise ValueError(
                    f"lease {lease.lease_id}: {len(frames)} prefix frames for "
                    f"{len(lease.prefix_ids)} steps (the start noise and one per step)"
                )
        seed = lease.sampling.seed
        if seed is None:  # unseeded sampling: a picture continued elsewhere draws afresh
            seed = random.getrandbits(63)
        start = derive_seed(self.cfg.seed, lease.group_id) if self.cfg.image.shared_start else None
        return ImageRequest(lease.lease_id, prompt, seed, frames, start)

    def _record(self, out: StepOutput, now: float) -> None:
        """Each step's frames join its lease's pending chunk; a finished picture is judged
        and sent at once with its verdict."""
        assert isinstance(out, ImageStepOutput)
        for request_id, frames in out.frames.items():
            p = self.pending.get(request_id)
            if p is not None:  # else aborted: its lease was taken back
                p.frames += to_bytes(frames)
        for p, reason in record_tokens(self.pending, out):
            picture = to_images(out.frames[p.lease.lease_id][-1:])[0].numpy()
            scene = self.scenes[prompt_text(p.lease.prompt_ids)]
            p.reward = judge(picture, scene).reward
            self.rewarded += 1
            self.outbox.chunk(p, now, finished=True, reason=reason)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run one image generator process.")
    parser.add_argument("--config", required=True, help="ImageRolloutConfig JSON")
    parser.add_argument("--worker-id", required=True)
    args = parser.parse_args(argv)
    cfg: ImageRolloutConfig = load_json(args.config)
    torch.manual_seed(time.time_ns())  # nothing here should draw from it: seeds are per picture
    engine = ImageEngine(ImagePolicy.load(cfg.model.path), cfg.image, max_batch=cfg.max_batch)
    worker = ImageGeneratorWorker(cfg, args.worker_id, engine)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    signal.signal(signal.SIGUSR1, lambda *_: worker.drain())
    try:
        worker.run()
    finally:
        engine.close()
    if worker.drain_event.is_set():
        raise SystemExit(EXIT_DRAINED)  # it left on purpose: the launcher lets it go


if __name__ == "__main__":
    main()
