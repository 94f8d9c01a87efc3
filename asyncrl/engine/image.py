"""The image engine: continuous batching over denoising steps, the embedded engine's job
done for pictures.

Each request is one picture: a prompt, a seed, and the frames an earlier holder made, if
any (``asyncrl.image.frames``). Every ``step()`` runs the policy once over up to
``max_batch`` pictures, each at its own time on the grid, so pictures that started at
different moments share one batch (a new request joins at the next step, a finished one
leaves its place at once), and takes one SDE step for each (``asyncrl.image.flow``): the
new frame, its log-probability under this step's weights, and their version. Past
``sde_steps`` a step is the ODE's, with no log-probability (0).

Weights staged with ``stage_weights`` are swapped in at the start of the next step, never
within one: every step's version is exact, and a picture whose steps span a flip carries
both versions, as a text sample's tokens do.

It is driven as the generator drives a text engine (``asyncrl.interfaces.Engine``):
``status``, ``step``, ``abort``, ``stage_weights`` and ``close`` have that protocol's
shapes, so the generator's loop, its weight intake and its measurements serve it
unchanged. Only ``submit`` differs, taking an ``ImageRequest``; a step reports each
picture's step as a ``GeneratedToken`` (the step's index, its log-probability and
version) and its new frames beside it (``ImageStepOutput.frames``).

Noise: a picture's start noise comes from its seed alone (or its group's start seed), and
step ``k``'s noise from (seed, k). A picture continued elsewhere from its frames therefore draws the noise the
first holder would have drawn, and a picture does not depend on what it was batched with
beyond the model's own arithmetic.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncrl.engine.base import EngineStatus, Finished, GeneratedToken, StepOutput, Weights
from asyncrl.image.flow import ode_step, per_sample, sde_step, time_grid
from asyncrl.image.model import ImagePolicy
from asyncrl.image.render import SIZE
from asyncrl.seeds import derive_seed


@dataclass
class ImageSamplingConfig:
    """How a picture is sampled as a policy (Flow-GRPO's SDE)."""

    steps: int = 10
    """Denoising steps per picture: each is one action with its own log-probability."""
    shift: float = 3.0
    """SD3's time shift of the steps (more of them at high noise)."""
    noise_level: float = 0.7
    """``a`` of the SDE's ``sigma_t = a sqrt(t / (1 - t))`` (Flow-GRPO's 0.7): more noise
    explores more and makes each step's log-probability less peaked; 0 would be the ODE,
    which has no log-probability."""
    sde_steps: int = 0
    """How many of the first steps are the SDE's (0: every one); the rest are the ODE's,
    deterministic given their frame: their log-probability is recorded as 0 and they are
    not trained. Then only the stochastic steps make a group's pictures differ, so the
    rewards' differences are credited to the steps that caused them (MixGRPO's window)."""
    shared_start: bool = False
    """A group's pictures start from the same noise (DanceGRPO's choice), so they differ
    only by the SDE steps' noise: a group's rewards then compare actions from one start,
    not starts (the generator gives each request its group's ``start_seed``)."""

    @property
    def stochastic_steps(self) -> int:
        """The steps that are the SDE's: the first ``sde_steps``, or all."""
        return self.sde_steps or self.steps

    def check(self) -> None:
        if self.steps < 1:
            raise ValueError(f"sampling.steps must be at least 1, got {self.steps}")
        if not self.shift > 0:
            raise ValueError(f"sampling.shift must be positive, got {self.shift}")
        if not self.noise_level > 0:
            raise ValueError(f"sampling.noise_level must be positive, got {self.noise_level}")
        if not 0 <= self.sde_steps <= self.steps:
            raise ValueError(
                f"sampling.sde_steps must be 0 (all) to steps={self.steps}, got {self.sde_steps}"
            )


@dataclass
class ImageRequest:
    request_id: str
    """The lease it generates."""
    prompt: str
    """The scene's words."""
    seed: int
    """The picture's own: every step's noise derives from it, and the start noise too
    unless ``start_seed`` is given."""
    frames: torch.Tensor | None = None
    """[n, 3, SIZE, SIZE]: the start noise and the ``n - 1`` steps an earlier holder took;
    None: a new picture, from the seed's noise."""
    start_seed: int | None = None
    """The start noise's seed, when not ``seed`` (its group's, under ``shared_start``)."""


@dataclass
class _Picture:
    request: ImageRequest
    """What was asked."""
    x: torch.Tensor
    """[3, SIZE, SIZE]: the newest frame."""
    index: int
    """The next step to take."""
    fresh: bool
    """No step taken yet and no frame sent: the first step's frames start with the noise."""


@dataclass
class ImageStepOutput(StepOutput):
    frames: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per request stepped: ``[n, 3, SIZE, SIZE]``, the step's new frame, after the start
    noise (n = 2) at a new picture's first step: what its chunk carries."""


def start_noise(seed: int) -> torch.Tensor:
    """A picture's start noise [3, SIZE, SIZE], from its seed alone."""
    return torch.randn(3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def step_noise(seed: int, index: int) -> torch.Tensor:
    """The noise of a picture's step ``index`` [3, SIZE, SIZE], from (seed, index) alone."""
    generator = torch.Generator().manual_seed(derive_seed(seed, index))
    return torch.randn(3, SIZE, SIZE, generator=generator)


class ImageEngine:
    def __init__(
        self,
        policy: ImagePolicy,
        cfg: ImageSamplingConfig,
        version: int = 0,
        max_batch: int = 32,
    ) -> None:
        cfg.check()
        self.policy, self.cfg, self.version, self.max_batch = policy.eval(), cfg, version, max_batch
        self.grid = time_grid(cfg.steps, cfg.shift)
        self._pictures: dict[str, _Picture] = {}  # oldest first: they step first
        self._staged: tuple[Mapping[str, torch.Tensor], int] | None = None
        self._steps = 0  # denoising steps taken, over all pictures
        self._lock = threading.Lock()
        self._shapes = {name: t.shape for name, t in policy.state_dict().items()}

    def submit(self, request: ImageRequest) -> None:
        """Queue a picture; a prompt outside the vocabulary, or frames that are not whole
        frames of a picture still under way, are a ValueError naming the request."""
        self.policy.prompt_encoder.tokens([request.prompt])  # raises on unknown words
        frames = request.frames
        if frames is None or len(frames) == 0:
            seed = request.seed if request.start_seed is None else request.start_seed
            x, index = start_noise(seed), 0
        elif frames.shape[1:] != (3, SIZE, SIZE) or not 1 <= len(frames) <= self.cfg.steps:
            raise ValueError(
                f"request {request.request_id!r}: frames {tuple(frames.shape)} are not 1 to "
                f"{self.cfg.steps} frames of 3 × {SIZE} × {SIZE} (start noise and steps taken)"
            )
        else:
            x, index = frames[-1], len(frames) - 1
        self._pictures[request.request_id] = _Picture(request, x, index, index == 0)

    def abort(self, request_id: str) -> None:
        self._pictures.pop(request_id, None)

    def stage_weights(self, weights: Weights, version: int, *, wait: bool = False) -> None:
        """Weights to swap in before the next step (a newer staging replaces this one): a
        state dict, or a policy directory (``ImagePolicy.save``)."""
        if isinstance(weights, (str, Path)):
            weights = ImagePolicy.load(weights).state_dict()
        if not isinstance(weights, Mapping):
            raise TypeError(f"the image engine takes a state dict or a directory, not {weights!r}")
        unknown = sorted(set(weights) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(weights))
        wrong = sorted(
            n for n in self._shapes if n in weights and weights[n].shape != self._shapes[n]
        )
        if unknown or missing or wrong:
            raise ValueError(
                f"weights v{version} do not fit the image policy: unknown {unknown[:3]}, "
                f"missing {missing[:3]}, wrong shape {wrong[:3]}"
            )
        with self._lock:  # the intake thread stages while the loop steps
            self._staged = (weights, version)

    def status(self) -> EngineStatus:
        running = min(len(self._pictures), self.max_batch)
        waiting = len(self._pictures) - running
        staged_now = self._staged
        staged = -1 if staged_now is None else staged_now[1]
        free = self.max_batch - running
        metrics = {
            "engine/running": running,
            "engine/waiting": waiting,
            "engine/steps": self._steps,
        }
        return EngineStatus(
            running, waiting, free, self.version, staged, self._steps, None, metrics
        )

    def close(self) -> None:
        self._pictures.clear()

    @torch.no_grad()
    def step(self) -> ImageStepOutput:
        """One denoising step of the oldest ``max_batch`` pictures, each at its own time."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self.policy.load_state_dict(staged[0])
            self.version = staged[1]
        out = ImageStepOutput(tokens=[], finished=[], version=self.version)
        batch = list(self._pictures.values())[: self.max_batch]
        if not batch:
            return out
        x = torch.stack([p.x for p in batch])
        t = torch.tensor([self.grid[p.index] for p in batch])
        t_next = torch.tensor([self.grid[p.index + 1] for p in batch])
        v = self.policy.velocity(x, t, [p.request.prompt for p in batch])
        noise = torch.stack([step_noise(p.request.seed, p.index) for p in batch])
        x_next, logprobs = sde_step(
            x, v, t, t_next, self.cfg.noise_level, self.grid[1], noise=noise
        )
        index = torch.tensor([p.index for p in batch])
        if self.cfg.stochastic_steps < self.cfg.steps:  # past the window: the ODE's step
            ode = (index >= self.cfg.stochastic_steps).view(-1, 1, 1, 1)
            x_next = torch.where(
                ode, ode_step(x, v, per_sample(t, x), per_sample(t_next, x)), x_next
            )
            logprobs = logprobs.masked_fill(ode.flatten(), 0.0)
        for p, frame, logprob in zip(batch, x_next, logprobs.tolist()):
            rid = p.request.request_id
            out.tokens.append(GeneratedToken(rid, p.index, logprob, self.version))
            out.frames[rid] = torch.stack([p.x, frame]) if p.fresh else frame.unsqueeze(0)
            p.x, p.index, p.fresh = frame, p.index + 1, False
            if p.index == self.cfg.steps:
                out.finished.append(Finished(rid, "length", p.index))
                del self._pictures[rid]
        self._steps += len(batch)
        return out
