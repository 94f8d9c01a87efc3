"""The image reward model: a scorer of (picture, prompt), trained on preference pairs of
the policy's own pictures (``asyncrl.image.pairs``) with the Bradley–Terry loss.

A reader turns a picture and its prompt into features; an MLP over them gives the score.
Two readers:

- ``PolicyReader`` (``ScorerConfig.backbone`` names an image policy, as ``tiny_rm`` puts
  its head on the text policy): the policy's transformer reads the clean picture
  (``t = 0``) jointly with the prompt's words, and its patch tokens before the output
  layer, each narrowed to a few features and kept in their place (where an object lies is
  half of what the judge checks), are the features. The transformer is fine-tuned with
  the head: it already knows which words draw which pixels.
- ``ConvReader`` (no backbone): a few strided convolutions read the picture down to a
  4 × 4 grid, and a prompt encoder of its own reads the words whole; both from scratch.

A scorer is a directory: ``scorer.safetensors`` (every weight, the backbone's included)
and ``scorer.json`` (its sizes, the backbone's sizes, the vocabulary).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from asyncrl.image.model import VOCABULARY, ImageModelConfig, ImagePolicy, PromptEncoder
from asyncrl.image.render import SIZE


@dataclass
class ScorerConfig:
    """Sizes of the image reward model (the defaults: the convolutional reader, about
    0.4 M parameters)."""

    backbone: str = ""
    """An image policy directory (``ImagePolicy.save``) whose transformer reads the
    pictures, fine-tuned with the head (``PolicyReader``); empty: ``ConvReader``."""
    channels: int = 32
    """``ConvReader``: channels of the first convolution; each stride-2 one doubles them."""
    text_dim: int = 32
    """``ConvReader``: width of the prompt encoder's word vectors."""
    per_patch: int = 8
    """``PolicyReader``: features kept of each patch token."""
    hidden: int = 256
    """Width of the MLP that gives the score."""


class ConvReader(nn.Module):
    """Features [B, F] of pictures [B, 3, SIZE, SIZE] and their prompts, from scratch."""

    def __init__(self, cfg: ScorerConfig) -> None:
        super().__init__()
        c = cfg.channels
        self.prompt_encoder = PromptEncoder(ImageModelConfig(text_dim=cfg.text_dim))
        self.pictures = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),  # 16 × 16
            nn.SiLU(),
            nn.Conv2d(2 * c, 4 * c, 3, stride=2, padding=1),  # 8 × 8
            nn.SiLU(),
            nn.Conv2d(4 * c, 4 * c, 3, stride=2, padding=1),  # 4 × 4
            nn.SiLU(),
            nn.Flatten(),
        )
        self.width = 4 * c * (SIZE // 8) ** 2 + self.prompt_encoder.cfg.max_words * cfg.text_dim

    def forward(self, x: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        words, _ = self.prompt_encoder(prompts)
        return torch.cat([self.pictures(x), words.flatten(1)], dim=1)


class PolicyReader(nn.Module):
    """Features [B, F] of pictures [B, 3, SIZE, SIZE] and their prompts, read by an image
    policy's transformer at ``t = 0``: its patch tokens before the output layer."""

    def __init__(self, policy: ImagePolicy, per_patch: int) -> None:
        super().__init__()
        self.policy = policy
        transformer = policy.transformer
        self.narrow = nn.Linear(transformer.inner_dim, per_patch)
        self.width = (SIZE // policy.cfg.patch_size) ** 2 * per_patch

    def forward(self, x: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        hook = self.policy.transformer.norm_out.register_forward_pre_hook(
            lambda _module, args: seen.append(args[0])  # [B, patches, inner_dim]
        )
        try:
            self.policy.velocity(x, torch.zeros(len(x), device=x.device), prompts)
        finally:
            hook.remove()
        return nn.functional.silu(self.narrow(seen[0])).flatten(1)


class PictureScorer(nn.Module):
    """``score(x, prompts)``: one number per picture ``x`` [B, 3, SIZE, SIZE] in [-1, 1].
    ``backbone``: the policy to read with (default: loaded from ``cfg.backbone``)."""

    def __init__(self, cfg: ScorerConfig, backbone: ImagePolicy | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.backbone or backbone is not None:
            policy = backbone if backbone is not None else ImagePolicy.load(cfg.backbone)
            self.reader: nn.Module = PolicyReader(policy, cfg.per_patch)
        else:
            self.reader = ConvReader(cfg)
        self.head = nn.Sequential(
            nn.Linear(self.reader.width, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, 1)
        )

    def score(self, x: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return self.head(self.reader(x, prompts)).squeeze(1)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in self.state_dict().items()},
            path / "scorer.safetensors",
        )
        backbone = self.reader.policy.cfg if isinstance(self.reader, PolicyReader) else None
        meta = {
            "config": asdict(self.cfg),
            "backbone": None if backbone is None else asdict(backbone),
            "vocabulary": VOCABULARY,
        }
        (path / "scorer.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> PictureScorer:
        """A saved scorer, whole: its backbone's weights are its own, not re-read from
        the policy it started from."""
        path = Path(path)
        meta = json.loads((path / "scorer.json").read_text())
        if meta["vocabulary"] != VOCABULARY:
            raise ValueError(f"{path}: its prompt vocabulary is not this code's")
        sizes = meta.get("backbone")
        backbone = None if sizes is None else ImagePolicy(ImageModelConfig(**sizes))
        scorer = cls(ScorerConfig(**meta["config"]), backbone)
        scorer.load_state_dict(load_file(path / "scorer.safetensors"))
        return scorer
