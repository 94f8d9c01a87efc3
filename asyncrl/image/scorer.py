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
- ``ConvReader`` (no backbone, ``reader="conv"``): a few strided convolutions read the
  picture down to a 4 × 4 grid, and a prompt encoder of its own reads the words whole;
  both from scratch.
- ``WordReader`` (no backbone, ``reader="words"``): each word of the prompt is matched
  against every place of the picture, and how much, how strongly and where it matches
  are the features, in the words' order. A word's look is learned from every prompt it is
  in, so a scene never trained on is read through words that were.

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
    pictures, fine-tuned with the head (``PolicyReader``); empty: ``reader`` says."""
    reader: str = "conv"
    """Without a backbone, the reader from scratch: "conv" (``ConvReader``) or "words"
    (``WordReader``)."""
    channels: int = 32
    """``ConvReader``, ``WordReader``: channels of the first convolution; each stride-2 one doubles them."""
    text_dim: int = 32
    """``ConvReader``, ``WordReader``: width of the word vectors."""
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


class WordReader(nn.Module):
    """Features [B, F] of pictures [B, 3, SIZE, SIZE] and their prompts, from scratch:
    convolutions read the picture (with each pixel's coordinates) to a 16 × 16 grid of
    ``text_dim`` features; each word's vector, its position left out, scores every place
    (a scaled dot product), which gives the word a map of where it is seen. Per word slot,
    in the prompt's order: the map's largest and mean score, its area (the places it holds,
    softly), its centre and spread (the mean and the deviation of the places' coordinates
    weighted by it), and a small convolution's reading of the map (one for every word: how
    many separate places light up is what a count is); padding slots are zero. The grid's
    mean joins them."""

    def __init__(self, cfg: ScorerConfig) -> None:
        super().__init__()
        c, d = cfg.channels, cfg.text_dim
        self.prompt_encoder = PromptEncoder(ImageModelConfig(text_dim=d))
        self.pictures = nn.Sequential(
            nn.Conv2d(5, c, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),  # 16 × 16
            nn.SiLU(),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(2 * c, d, 1),
        )
        self.maps = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1),  # 8 × 8
            nn.SiLU(),
        )
        axis = torch.linspace(-1, 1, SIZE)
        self.register_buffer("pixel_xy", torch.stack(torch.meshgrid(axis, axis, indexing="ij")))
        grid = torch.linspace(-1, 1, SIZE // 2)
        places = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), dim=-1)
        self.register_buffer("place_xy", places.reshape(-1, 2))  # [P, 2] (row, column)
        self.width = self.prompt_encoder.cfg.max_words * (7 + 16) + d

    def forward(self, x: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        ids = self.prompt_encoder.tokens(prompts)  # [B, W]
        words = self.prompt_encoder.words(ids)  # [B, W, d]
        xy = self.pixel_xy.expand(len(x), -1, -1, -1)
        places = self.pictures(torch.cat([x, xy], dim=1)).flatten(2).transpose(1, 2)  # [B, P, d]
        match = words @ places.transpose(1, 2) / words.shape[-1] ** 0.5  # [B, W, P]
        side, weights = SIZE // 2, torch.softmax(match, dim=-1)
        centre = weights @ self.place_xy  # [B, W, 2]
        spread = (weights @ self.place_xy.square() - centre.square()).clamp(min=1e-6).sqrt()
        area = torch.sigmoid(match).mean(-1, keepdim=True)
        read = self.maps(match.reshape(-1, 1, side, side)).flatten(2)  # [B·W, 8, 64]
        read = torch.cat([read.amax(-1), read.mean(-1)], dim=-1).reshape(*match.shape[:2], 16)
        strength = [match.amax(-1, keepdim=True), match.mean(-1, keepdim=True), area]
        per_word = torch.cat([*strength, centre, spread, read], dim=-1) * (ids != 0).unsqueeze(-1)
        return torch.cat([per_word.flatten(1), places.mean(1)], dim=1)


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


READERS = {"conv": ConvReader, "words": WordReader}
"""The readers from scratch, by ``ScorerConfig.reader``."""


class PictureScorer(nn.Module):
    """``score(x, prompts)``: one number per picture ``x`` [B, 3, SIZE, SIZE] in [-1, 1].
    ``backbone``: the policy to read with (default: loaded from ``cfg.backbone``)."""

    def __init__(self, cfg: ScorerConfig, backbone: ImagePolicy | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.backbone or backbone is not None:
            policy = backbone if backbone is not None else ImagePolicy.load(cfg.backbone)
            self.reader: nn.Module = PolicyReader(policy, cfg.per_patch)
        elif cfg.reader in READERS:
            self.reader = READERS[cfg.reader](cfg)
        else:
            raise ValueError(
                f"scorer.reader={cfg.reader!r}: expected one of {sorted(READERS)} (or a backbone)"
            )
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
