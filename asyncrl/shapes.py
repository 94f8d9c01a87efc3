"""Real model shapes as data, and random-init models built in them, offline.

``SHAPES`` writes down the architecture of Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B and
SmolLM2-135M (tied LM heads), Qwen2.5-7B and Llama-3.1-8B (untied), from their config.json
files; ``hf_config`` turns one into a transformers config, optionally shallower or with a
shorter context, and ``miniature`` shrinks one to test size, keeping what weight paths
depend on (architecture, tying, head layout). ``build_shaped_model`` writes a
random-init Hugging Face directory of a shape with its family's tokenizer
(``asyncrl.chat_tokenizers``), which ``asyncrl.models.load_model`` and ``load_tokenizer``
read like a downloaded checkpoint.

Used by ``tools/make_model.py`` (real-size models for GPU runs without the hub) and tests.

The tokenizer's special tokens sit right after its trained vocabulary, so the config
takes its BOS/EOS ids from the tokenizer, while the embedding keeps the real shape's rows:
rows past ``len(tokenizer)`` exist but no text maps to them, as in real Qwen (151936
rows, 151665 tokens). A random-init model samples those rows too; they decode to nothing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from asyncrl.chat_tokenizers import FAMILIES, Family, build_bpe_tokenizer, save_tokenizer
from asyncrl.models import TinyModelConfig


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


def generation_config(tokenizer: PreTrainedTokenizerFast, family: Family) -> GenerationConfig:
    """Every stop token of ``family`` as EOS, its pad and BOS; no sampling defaults, so
    the engine's sampling settings are the only ones."""
    spec = FAMILIES[family]
    return GenerationConfig(
        bos_token_id=tokenizer.convert_tokens_to_ids(spec.config_bos_token),
        eos_token_id=tokenizer.convert_tokens_to_ids(list(spec.stop_tokens)),
        pad_token_id=tokenizer.pad_token_id,
    )


def random_init_model(config: PretrainedConfig, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    """A causal LM of ``config`` with weights ~ N(0, initializer_range), norms at one and
    biases at zero (transformers' scheme).

    Built on the meta device and filled in place: 2.5× faster than transformers' own
    init, which first runs torch's default init of every layer (0.5B: ~6 s against ~14 s
    on two cores). The rotary frequencies, buffers that meta leaves empty, are rebuilt.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device="cpu")
    model.tie_weights()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, config.initializer_range, generator=generator)
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.zero_()
    for name, module in list(model.named_modules()):
        if hasattr(module, "inv_freq"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, type(module)(config=config))
    return model


def build_tiny_bpe_model(out_dir: str | Path, texts: Iterable[str], spec: TinyModelConfig) -> Path:
    """A random-init model of ``spec``'s size in its tokenizer family's architecture (Qwen2
    for ``qwen``, Llama for ``llama``) with a BPE tokenizer of that family trained on
    ``texts``, written to ``out_dir`` whole or not at all; returns it."""
    family: Family = spec.tokenizer
    tokenizer = build_bpe_tokenizer(family, texts, spec.bpe_vocab)
    shape = ModelShape(
        name="tiny",
        model_type="qwen2" if family == "qwen" else "llama",
        family=family,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        vocab_size=-(-len(tokenizer) // 64) * 64,  # rows rounded up, as releases do
        # transformers' default base (the char model's): the releases' 1e6 suits long
        # contexts, and on 30-token prompts this model learned addition 6x slower with it.
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=spec.max_positions,
        params=0,
        tie_word_embeddings=spec.tie_embeddings,
    )
    model = random_init_model(hf_config(shape, tokenizer), spec.seed, torch.float32)
    model.generation_config = generation_config(tokenizer, family)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    save_tokenizer(tokenizer, tmp)
    os.replace(tmp, out_dir)
    return out_dir


def meta_param_count(config: PretrainedConfig) -> int:
    """Parameters of the causal LM of ``config``, tied ones once; allocates nothing."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_shaped_model(
    out_dir: str | Path,
    shape: str | ModelShape,
    texts: Iterable[str],
    vocab_size: int,
    num_layers: int | None = None,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16"] = "bfloat16",
    max_position_embeddings: int | None = None,
    vocab_rows: int | None = None,
) -> Path:
    """Write a random-init model of ``shape`` and its family's BPE tokenizer (trained on
    ``texts``, ``vocab_size`` trained tokens) to ``out_dir``; returns it.

    ``dtype`` is the stored dtype (the released checkpoints are bf16); the other options
    are ``hf_config``'s. The directory appears whole or not at all.
    """
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    tokenizer = build_bpe_tokenizer(shape.family, texts, vocab_size)
    config = hf_config(shape, tokenizer, num_layers, max_position_embeddings, vocab_rows)
    model = random_init_model(config, seed, getattr(torch, dtype))
    model.generation_config = generation_config(tokenizer, shape.family)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary name and rename, so a crash never leaves a half model behind.
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    save_tokenizer(tokenizer, tmp)
    os.replace(tmp, out_dir)
    return out_dir
