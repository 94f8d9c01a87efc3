"""Real model shapes as data, offline.

``SHAPES`` writes down the architecture of Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B and
SmolLM2-135M (tied LM heads), Qwen2.5-7B and Llama-3.1-8B (untied), from their config.json
files; ``hf_config`` turns one into a transformers config, optionally shallower or with a
shorter context, and ``miniature`` shrinks one to test size, keeping what weight paths
depend on (architecture, tying, head layout). ``asyncrl.random_models`` builds
random-init models in them.

The tokenizer's special tokens sit right after its trained vocabulary, so the config
takes its BOS/EOS ids from the tokenizer, while the embedding keeps the real shape's rows:
rows past ``len(tokenizer)`` exist but no text maps to them, as in real Qwen (151936
rows, 151665 tokens). A random-init model samples those rows too; they decode to nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from asyncrl.chat_tokenizers import FAMILIES, Family


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts of one released model (from its config.json)."""

    name: str
    """Name used by ``SHAPES`` and ``tools/make_model.py --shape``."""
    model_type: Literal["qwen2", "qwen3", "llama"]
    """transformers architecture."""
    family: Family
    """Tokenizer family (``FAMILIES``) the model ships with."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Per-head width; Qwen3 sets it apart from hidden_size / num_heads."""
    vocab_size: int
    """Embedding rows (and LM head rows); more than the real tokenizer's tokens."""
    rope_theta: float
    """RoPE base frequency."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    max_position_embeddings: int
    """Longest context the released config declares."""
    params: int
    """Total parameters, a tied embedding counted once (the test checks it)."""
    tie_word_embeddings: bool = True
    """The LM head reuses the input embedding (the small releases); the 7-8B ones have
    a head of their own, which every weight path must carry as a tensor apart."""
    rope_scaling: dict[str, Any] | None = None
    """Llama-3's long-context frequency scaling; None for plain RoPE."""


SHAPES: dict[str, ModelShape] = {
    # Qwen2 puts a bias on q/k/v (and none on o); Qwen2Config has no switch for it.
    "qwen2.5-0.5b": ModelShape(
        name="qwen2.5-0.5b",
        model_type="qwen2",
        family="qwen",
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=151936,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        params=494_032_768,
    ),
    # Qwen3 drops the q/k/v bias and normalises q and k per head (Qwen3Config does both).
    "qwen3-0.6b": ModelShape(
        name="qwen3-0.6b",
        model_type="qwen3",
        family="qwen",
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        params=596_049_920,
    ),
    "llama3.2-1b": ModelShape(
        name="llama3.2-1b",
        model_type="llama",
        family="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        vocab_size=128256,
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        params=1_235_814_400,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # The ~100M benchmark model: its embedding is a fifth of its parameters (the Qwen
    # shapes cut to a few layers are mostly embedding, which sharding barely divides).
    # SmolLM2 ships its own ChatML tokenizer (specials at ids 0-2); the Qwen family's,
    # ChatML too, stands in for it.
    "smollm2-135m": ModelShape(
        name="smollm2-135m",
        model_type="llama",
        family="qwen",
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100_000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        params=134_515_008,
    ),
    # The two untied shapes: their LM head is a tensor of its own on every weight path.
    "qwen2.5-7b": ModelShape(
        name="qwen2.5-7b",
        model_type="qwen2",
        family="qwen",
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=152064,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        params=7_615_616_512,
        tie_word_embeddings=False,
    ),
    "llama3.1-8b": ModelShape(
        name="llama3.1-8b",
        model_type="llama",
        family="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        params=8_030_261_248,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def miniature(shape: ModelShape, hidden_size: int = 64, head_dim: int = 32) -> ModelShape:
    """``shape`` at test size: its architecture, tokenizer family, tying and head layout
    (query heads per key/value head) kept; two heads of ``head_dim`` per group at most,
    two layers. ``head_dim`` 32 is the smallest vLLM's CPU attention serves."""
    group = min(shape.num_heads // shape.num_kv_heads, 2)
    return dataclasses.replace(
        shape,
        name=f"{shape.name}-mini",
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=2,
        num_heads=group,
        num_kv_heads=1,
        head_dim=head_dim,
        max_position_embeddings=512,
        params=0,
        rope_scaling=shape.rope_scaling
        and {
            **shape.rope_scaling,
            "original_max_position_embeddings": 256,
        },
    )


def hf_config(
    shape: ModelShape,
    tokenizer: PreTrainedTokenizerFast,
    num_layers: int | None = None,
    max_position_embeddings: int | None = None,
    vocab_rows: int | None = None,
) -> PretrainedConfig:
    """The transformers config of ``shape``, with special ids taken from ``tokenizer``.

    ``num_layers`` makes it shallower (or deeper), ``max_position_embeddings`` shortens
    the declared context, ``vocab_rows`` shrinks the embedding (tests); None keeps the
    real value. pad_token_id stays unset, as in the real configs: transformers would
    make that row the embedding's padding_idx, which never gets a gradient.
    """
    if vocab_rows is not None and vocab_rows < len(tokenizer):
        raise ValueError(f"vocab_rows={vocab_rows} is less than the {len(tokenizer)} tokens")
    spec = FAMILIES[shape.family]
    layers = num_layers or shape.num_layers
    common: dict[str, Any] = dict(
        vocab_size=vocab_rows or shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        max_position_embeddings=max_position_embeddings or shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids(spec.config_bos_token),
        eos_token_id=tokenizer.eos_token_id,
    )
    if shape.model_type == "qwen2":
        # Both Qwen families ship with sliding-window attention switched off.
        return Qwen2Config(**common, use_sliding_window=False, max_window_layers=layers)
    if shape.model_type == "qwen3":
        return Qwen3Config(
            **common,
            head_dim=shape.head_dim,
            attention_bias=False,
            use_sliding_window=False,
            max_window_layers=layers,
        )
    return LlamaConfig(
        **common,
        head_dim=shape.head_dim,
        attention_bias=False,
        mlp_bias=False,
        rope_scaling=shape.rope_scaling,
    )


def meta_param_count(config: PretrainedConfig) -> int:
    """Parameters of the causal LM of ``config``, tied ones once; allocates nothing."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
