"""Models and tokenizers: one loading path for tiny and real Hugging Face causal LMs.

The trainer, the evaluator and the embedded engine all call ``load_model`` and
``load_tokenizer`` on an HF directory. ``ModelConfig.head`` picks what sits on the
backbone: the LM head, or a scalar value head (``AutoModelForTokenClassification`` with
one label, one value per token) for PPO's critic and the reward model; a value model
loaded from a causal-LM directory keeps its backbone and starts with a zero head.

Tiny models for CPU work are built by ``build_tiny_model``: a Qwen2-architecture config with random init and a character-level
tokenizer made with the ``tokenizers`` library over the task's alphabet, both written
with ``save_pretrained`` so they load exactly like a downloaded model. Nothing here
touches the network.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


@dataclass
class TinyModelConfig:
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of decoder layers."""
    num_heads: int = 4
    """Attention heads (query)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    intermediate_size: int = 512
    """Width of the MLP."""
    max_positions: int = 512
    """Longest sequence (prompt + completion) the model supports."""
    seed: int = 0
    """Seed of the random initialisation."""
    tokenizer: Literal["char", "qwen", "llama"] = "char"
    """``char``: one token per character of the task's text (the smallest embedding);
    ``qwen`` / ``llama``: a byte-level BPE of that family trained on the task's text,
    with its special tokens and chat template (``asyncrl.chat_tokenizers``), for
    ``task.prompt_format="chat"`` and for servers that need a real tokenizer. The BPE
    model is the family's architecture (``asyncrl.random_models.build_tiny_bpe_model``)."""
    bpe_vocab: int = 512
    """Tokens a BPE tokenizer trains (256 bytes and the merges; ``qwen``/``llama``)."""
    tie_embeddings: bool = False
    """The LM head is the input embedding (as in the small Qwen and Llama releases)."""


@dataclass
class ModelConfig:
    path: str = "runs/models/tiny-qwen2"
    """Hugging Face model directory (config, weights, tokenizer). Loaded offline."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the parameters are kept in; GPU runs compute in bf16 through FSDP's policy."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel passed to transformers."""
    head: Literal["lm", "value"] = "lm"
    """``lm``: the causal LM (logits ``[rows, T, vocab]``). ``value``: the same backbone with
    a scalar head (``[rows, T, 1]``), the critic and reward model."""
    make_if_missing: bool = False
    """Build a tiny random-init model at ``path`` (see ``tiny``) when it does not exist."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the tiny model built when ``make_if_missing`` applies."""


def build_char_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over the characters of ``texts``.

    A BPE model with an alphabet and no merges splits text into single characters, and
    the Fuse decoder joins them back without inserting spaces.
    """
    alphabet = sorted(set("".join(texts)) | set("0123456789"))
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *alphabet])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
    )


def build_tiny_model(out_dir: str | Path, texts: Iterable[str], spec: TinyModelConfig) -> Path:
    """Write a random-init Qwen2 model and its char tokenizer to ``out_dir``; returns it."""
    out_dir = Path(out_dir)
    tokenizer = build_char_tokenizer(texts)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_sliding_window=False,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # Write to a temporary name and rename, so a crash never leaves a half model behind.
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    return out_dir


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The transformers config of ``cfg.path`` with the settings its head needs."""
    config = AutoConfig.from_pretrained(str(cfg.path))
    if cfg.head == "value":
        config.num_labels = 1
        # GenericForTokenClassification otherwise puts a 0.1 dropout before the head,
        # which would make values differ between the no-grad pass and the training pass.
        config.classifier_dropout = 0.0
    return config


def model_class(cfg: ModelConfig) -> type:
    """The auto class that builds ``cfg.head`` on the backbone."""
    return AutoModelForTokenClassification if cfg.head == "value" else AutoModelForCausalLM


def model_dir(cfg: ModelConfig) -> Path:
    """``cfg.path``, checked to hold a Hugging Face model."""
    path = Path(cfg.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no Hugging Face model at '{path}' (model.path); build one with "
            f"tools/make_tiny_model.py or set model.make_if_missing=true"
        )
    return path


def load_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> PreTrainedModel:
    """Load the model at ``cfg.path`` with ``cfg.head`` (no network).

    A value model read from a directory without a value head (e.g. the policy's) gets a
    zero head, so every value starts at 0 and the first updates move only the head.
    """
    model, info = model_class(cfg).from_pretrained(
        str(model_dir(cfg)),
        config=hf_config(cfg),
        dtype=getattr(torch, cfg.dtype),
        attn_implementation=cfg.attn_implementation,
        output_loading_info=True,
    )
    if cfg.head == "value" and "score.weight" in info["missing_keys"]:
        with torch.no_grad():
            model.score.weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
    return model.to(device)


def empty_model(cfg: ModelConfig) -> PreTrainedModel:
    """The model ``load_model`` gives, built on the meta device: its modules, parameter
    shapes and ties (the LM head shares the embedding's parameter when the config ties
    them), and no storage. The trainer shards it, allocates each rank's shards with
    ``to_empty`` and loads them; ``restore_buffers`` then recomputes what ``to_empty``
    left uninitialised. In eval mode, as ``from_pretrained`` leaves a model."""
    path = model_dir(cfg)
    with torch.device("meta"):
        model = model_class(cfg).from_config(
            hf_config(cfg),
            dtype=getattr(torch, cfg.dtype),
            attn_implementation=cfg.attn_implementation,
        )
    if (path / "generation_config.json").is_file():
        # Its EOS ids, as from_pretrained reads them (an instruct model lists several).
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model.eval()


def restore_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Compute the non-persistent buffers of a model built on the meta device (the rotary
    embedding's inverse frequencies) on ``device``: no checkpoint holds them, and
    ``to_empty`` allocates them without values. Each module that owns one is built again
    from its config on ``device``, as the model's constructor built it, and its
    non-persistent buffers replace the old ones."""
    for owner, module in model.named_modules():
        # torch's own record of the buffers a state dict leaves out
        lost = module._non_persistent_buffers_set & set(module._buffers)
        if not lost:
            continue
        if not hasattr(module, "config"):
            raise ValueError(
                f"cannot rebuild the non-persistent buffers of {owner} "
                f"({type(module).__name__}): it has no config to rebuild from"
            )
        with torch.device(device):
            fresh = type(module)(module.config)
        for name in sorted(lost):
            module.register_buffer(name, fresh.get_buffer(name), persistent=False)


def weightless_model(cfg: ModelConfig, device: torch.device) -> PreTrainedModel:
    """``cfg``'s model on ``device`` with every parameter empty (a tied one stays shared)
    and its buffers computed: a released engine's copy, filled by staging weights."""
    model = empty_model(cfg)
    fresh: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in fresh:
                empty = torch.empty(0, dtype=param.dtype, device=device)
                fresh[id(param)] = torch.nn.Parameter(empty, requires_grad=False)
            setattr(module, name, fresh[id(param)])
    restore_buffers(model, device)
    return model


def model_config(path: str | Path) -> AutoConfig:
    return AutoConfig.from_pretrained(str(path))


def forward_padded(
    model: PreTrainedModel, sequences: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [rows, T_max, V], input_ids [rows, T_max])`` of right-padded sequences
    with an attention mask and position ids ``0 … len_i − 1``, so each row is computed
    exactly as it would be alone (causal attention never reads the padding to its right).
    The plain batched forward of the reward-model scorer and DPO's reference."""
    device = next(model.parameters()).device
    rows, longest = len(sequences), max(len(ids) for ids in sequences)
    input_ids = torch.full((rows, longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, longest), dtype=torch.long)
    for i, ids in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, : len(ids)] = 1
    position_ids = torch.arange(longest).expand(rows, longest)
    input_ids = input_ids.to(device)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        use_cache=False,
    ).logits
    return logits, input_ids
