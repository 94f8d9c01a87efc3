"""The image policy: a small text-conditioned flow-matching transformer on 32 × 32 RGB.

The denoiser is diffusers' ``SD3Transformer2DModel`` (MMDiT: picture patches and prompt
tokens attend jointly), sized by ``ImageModelConfig`` to a few million parameters, on
pixels in [-1, 1] (no autoencoder: a 32 × 32 picture is small enough). The prompt encoder
is ours and small: a scene's words (``asyncrl.image.scenes``) are a closed vocabulary, so
each word has an embedding, each position another, and their mean is the pooled vector
SD3 conditions its timestep embedding on.

A model is a directory: ``transformer/`` as diffusers writes it (``from_pretrained``
reads it), ``prompt_encoder.safetensors`` and ``image_model.json`` (the vocabulary and
sizes).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from diffusers import SD3Transformer2DModel
from safetensors.torch import load_file, save_file
from torch import nn

from asyncrl.image.render import SIZE
from asyncrl.image.scenes import COLOURS, NUMBERS, RELATIONS, SHAPES

VOCABULARY = (
    ["<pad>", "and"]
    + list(NUMBERS.values())
    + list(COLOURS)
    + list(SHAPES)
    + [s + "s" for s in SHAPES]
    + sorted({w for r in RELATIONS for w in r.split()})
)
"""Every word a scene's prompt can have; index 0 pads."""


@dataclass
class ImageModelConfig:
    """Sizes of the image policy (the defaults: about 2.3 M parameters)."""

    layers: int = 4
    """MMDiT blocks."""
    heads: int = 4
    head_dim: int = 32
    patch_size: int = 2
    """Pixels per patch side: a 32 × 32 picture is 16 × 16 patches."""
    text_dim: int = 64
    """Width of the prompt encoder's word vectors."""
    max_words: int = 12
    """Prompt length in words, padded (the longest scene has 9)."""


class PromptEncoder(nn.Module):
    def __init__(self, cfg: ImageModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.words = nn.Embedding(len(VOCABULARY), cfg.text_dim)
        self.positions = nn.Parameter(torch.zeros(cfg.max_words, cfg.text_dim))
        nn.init.normal_(self.positions, std=0.02)

    def tokens(self, prompts: list[str]) -> torch.Tensor:
        """Word ids, padded: [B, max_words]. A word outside the vocabulary is an error."""
        index = {w: i for i, w in enumerate(VOCABULARY)}
        rows = []
        for prompt in prompts:
            words = prompt.split()
            unknown = [w for w in words if w not in index]
            if unknown or len(words) > self.cfg.max_words:
                raise ValueError(
                    f"prompt {prompt!r}: words outside the vocabulary {unknown} or more "
                    f"than {self.cfg.max_words} words"
                )
            ids = [index[w] for w in words]
            rows.append(ids + [0] * (self.cfg.max_words - len(ids)))
        return torch.tensor(rows, dtype=torch.long, device=self.positions.device)

    def forward(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-word vectors [B, max_words, text_dim], pooled [B, text_dim])."""
        ids = self.tokens(prompts)
        hidden = self.words(ids) + self.positions
        mask = (ids != 0).unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return hidden, pooled


class ImagePolicy(nn.Module):
    """``velocity(x, t, prompts)``: the flow's velocity ``v = eps - x0`` at pictures ``x``
    [B, 3, 32, 32] and times ``t`` [B] in [0, 1] (1: noise)."""

    def __init__(self, cfg: ImageModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.prompt_encoder = PromptEncoder(cfg)
        self.transformer = SD3Transformer2DModel(
            sample_size=SIZE,
            patch_size=cfg.patch_size,
            in_channels=3,
            out_channels=3,
            num_layers=cfg.layers,
            attention_head_dim=cfg.head_dim,
            num_attention_heads=cfg.heads,
            joint_attention_dim=cfg.text_dim,
            caption_projection_dim=cfg.heads * cfg.head_dim,
            pooled_projection_dim=cfg.text_dim,
            pos_embed_max_size=SIZE // cfg.patch_size,
        )

    def velocity(self, x: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        hidden, pooled = self.prompt_encoder(prompts)
        out = self.transformer(
            hidden_states=x,
            encoder_hidden_states=hidden,
            pooled_projections=pooled,
            timestep=t * 1000,  # SD3's timesteps are t scaled to the scheduler's 1000
        )
        return out.sample

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.transformer.save_pretrained(path / "transformer")
        save_file(self.prompt_encoder.state_dict(), path / "prompt_encoder.safetensors")
        meta = {"config": asdict(self.cfg), "vocabulary": VOCABULARY}
        (path / "image_model.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> ImagePolicy:
        path = Path(path)
        meta = json.loads((path / "image_model.json").read_text())
        if meta["vocabulary"] != VOCABULARY:
            raise ValueError(f"{path}: its prompt vocabulary is not this code's")
        policy = cls(ImageModelConfig(**meta["config"]))
        # A few MB: loaded whole, which needs no ``accelerate`` (and no warning about it).
        policy.transformer = SD3Transformer2DModel.from_pretrained(
            path / "transformer", low_cpu_mem_usage=False
        )
        policy.prompt_encoder.load_state_dict(load_file(path / "prompt_encoder.safetensors"))
        return policy


def flow_matching_loss(
    policy: ImagePolicy, x0: torch.Tensor, prompts: list[str], generator: torch.Generator
) -> torch.Tensor:
    """Pretraining's loss: the velocity's mean squared error at ``x_t = (1 - t) x0 + t
    eps``, ``t`` drawn logit-normal (SD3's choice: most weight at middle noise). ``x0``:
    pictures [B, 3, 32, 32] in [-1, 1]."""
    b = x0.shape[0]
    t = torch.sigmoid(torch.randn(b, generator=generator)).to(x0)
    eps = torch.randn(x0.shape, generator=generator).to(x0)
    x_t = (1 - t.view(b, 1, 1, 1)) * x0 + t.view(b, 1, 1, 1) * eps
    return (policy.velocity(x_t, t, prompts) - (eps - x0)).pow(2).mean()


def to_pixels(images) -> torch.Tensor:
    """uint8 pictures [B, H, W, 3] (numpy or torch) as the model's [B, 3, H, W] in [-1, 1]."""
    x = torch.as_tensor(images).permute(0, 3, 1, 2).float()
    return x / 127.5 - 1.0


def to_images(x: torch.Tensor) -> torch.Tensor:
    """The model's pictures back to uint8 [B, H, W, 3]."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
