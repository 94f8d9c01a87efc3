"""The image reward model: a small scorer of (picture, prompt), trained on preference pairs
of the policy's own pictures (``asyncrl.image.pairs``) with the Bradley–Terry loss.

A few strided convolutions read the picture down to a 4 × 4 grid of features; the
prompt's word vectors (a ``PromptEncoder`` of its own) are read whole, since which
colour, shape, count and relation to look for depends on each word and its place; an
MLP over both gives the score. A scorer is a directory: ``scorer.safetensors`` and
``scorer.json`` (its sizes and the vocabulary).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from asyncrl.image.model import VOCABULARY, ImageModelConfig, PromptEncoder
from asyncrl.image.render import SIZE


@dataclass
class ScorerConfig:
    """Sizes of the image reward model (the defaults: about 0.4 M parameters)."""

    channels: int = 32
    """Channels of the first convolution; each stride-2 one doubles them."""
    text_dim: int = 32
    """Width of the prompt encoder's word vectors."""
    hidden: int = 256
    """Width of the MLP that gives the score."""


class PictureScorer(nn.Module):
    """``score(x, prompts)``: one number per picture ``x`` [B, 3, SIZE, SIZE] in [-1, 1]."""

    def __init__(self, cfg: ScorerConfig) -> None:
        super().__init__()
        self.cfg = cfg
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
        words = self.prompt_encoder.cfg.max_words * cfg.text_dim
        self.head = nn.Sequential(
            nn.Linear(4 * c * (SIZE // 8) ** 2 + words, cfg.hidden),
            nn.SiLU(),
            nn.Linear(cfg.hidden, 1),
        )

    def score(self, x: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        hidden, _ = self.prompt_encoder(prompts)
        return self.head(torch.cat([self.pictures(x), hidden.flatten(1)], dim=1)).squeeze(1)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.state_dict(), path / "scorer.safetensors")
        meta = {"config": asdict(self.cfg), "vocabulary": VOCABULARY}
        (path / "scorer.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> PictureScorer:
        path = Path(path)
        meta = json.loads((path / "scorer.json").read_text())
        if meta["vocabulary"] != VOCABULARY:
            raise ValueError(f"{path}: its prompt vocabulary is not this code's")
        scorer = cls(ScorerConfig(**meta["config"]))
        scorer.load_state_dict(load_file(path / "scorer.safetensors"))
        return scorer
