"""The embedded engine's forward pass: a Hugging Face Llama-family causal LM run over a
preallocated slot KV cache.

Supported: architectures whose decoder layers have the Llama layout — ``input_layernorm``,
``self_attn.{q,k,v,o}_proj`` (with or without bias, optional ``q_norm``/``k_norm``),
``post_attention_layernorm``, ``mlp`` — with rotary embeddings: Llama, Qwen2, Qwen3,
Mistral (without sliding window). The layers' own modules (norms, projections, MLP,
rotary embedding) do the math, so numerics follow transformers; only attention and the
cache are ours. The cache is owned by ``KVCache``, apart from the weights, so the two
weight buffers of a flip share one cache.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


@dataclass
class KVCache:
    """Keys and values of every slot: ``[layers, slots, kv_heads, max_len, head_dim]`` each."""

    k: torch.Tensor
    v: torch.Tensor

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @classmethod
    def allocate(cls, model: PreTrainedModel, slots: int, max_len: int) -> KVCache:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, head_dim)
        param = next(model.parameters())
        return cls(
            torch.zeros(shape, dtype=param.dtype, device=param.device),
            torch.zeros(shape, dtype=param.dtype, device=param.device),
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def check_supported(model: PreTrainedModel) -> None:
    layer = model.model.layers[0]
    needed = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]
    missing = [n for n in needed if not hasattr(layer, n)]
    if missing or not hasattr(model.model, "rotary_emb"):
        raise NotImplementedError(
            f"{type(model).__name__} does not have the Llama decoder layout the embedded "
            f"engine runs (missing {missing or ['rotary_emb']})"
        )
    if getattr(model.config, "sliding_window", None) and getattr(
        model.config, "use_sliding_window", False
    ):
        raise NotImplementedError(
            "sliding-window attention is not supported by the embedded engine"
        )


class CachedDecoder:
    """Prefill and decode over a ``KVCache`` with the weights of one HF model."""

    def __init__(self, model: PreTrainedModel) -> None:
        check_supported(model)
        self.model = model
        self.apply_rope = importlib.import_module(type(model).__module__).apply_rotary_pos_emb

    def adopt(self, state_dict) -> None:
        """Take the offered tensors as the weights instead of copying them (the caller hands
        them over): a pointer swap per parameter, plus a conversion only where dtype or
        device differ. Staging then holds the GIL for microseconds, never long enough to
        stall the decode thread."""
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                tensor = state_dict[name]
                if tensor.dtype != param.dtype or tensor.device != param.device:
                    tensor = tensor.to(device=param.device, dtype=param.dtype, non_blocking=True)
                param.data = tensor.contiguous()

    def release(self) -> None:
        """Free the weights: each parameter keeps its dtype and device, with no elements
        (a tied one once); new weights are adopted by reference, as when staged."""
        with torch.no_grad():
            for param in self.model.parameters():
                param.data = param.new_empty(0)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.model.parameters())

    def _attention_inputs(self, layer, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        attn = layer.self_attn
        n, length, _ = h.shape
        head_dim = attn.head_dim
        q = attn.q_proj(h).view(n, length, -1, head_dim)
        k = attn.k_proj(h).view(n, length, -1, head_dim)
        v = attn.v_proj(h).view(n, length, -1, head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalizes q and k per head before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.apply_rope(q, k, *rope)
        return q, k, v

    def _finish_layer(self, layer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        n, _, length, _ = attn_out.shape
        x = x + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(n, length, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(x)).float()

    @torch.no_grad()
    def prefill(
        self, cache: KVCache, start: int, sequences: list[list[int]], all_logits: bool = False
    ) -> torch.Tensor:
        """Write K/V of ``sequences`` (positions from 0) into slots ``start, start + 1, …``.

        Sequences are right-padded to the longest, so causal attention alone keeps real
        tokens clear of the padding. Returns logits ``[n, V]`` at each sequence's last
        token, or ``[n, L, V]`` for every position when ``all_logits``.
        """
        device = cache.k.device
        lengths = torch.tensor([len(s) for s in sequences], device=device)
        width = int(lengths.max())
        ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s, device=device)
        positions = torch.arange(width, device=device)[None].expand(len(sequences), width)
        end = start + len(sequences)
        x = self.model.model.embed_tokens(ids)
        rope = self.model.model.rotary_emb(x, positions)  # cos, sin: the same for every layer
        for i, layer in enumerate(self.model.model.layers):
            q, k, v = self._attention_inputs(layer, layer.input_layernorm(x), rope)
            # Padding K/V land past each sequence's length, where decode masks them out
            # and later overwrites them.
            cache.k[i, start:end, :, :width] = k
            cache.v[i, start:end, :, :width] = v
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=layer.self_attn.scaling, enable_gqa=True
            )
            x = self._finish_layer(layer, x, out)
        if all_logits:
            return self._logits(x)
        last = x[torch.arange(len(sequences), device=device), lengths - 1]
        return self._logits(last)

    @torch.no_grad()
    def score(self, tokens: list[int]) -> list[float]:
        """Logprobs (temperature 1) of ``tokens[1:]``, each given those before it: one
        prefill into a cache of its own, so no running sequence is touched."""
        cache = KVCache.allocate(self.model, 1, len(tokens))
        logits = self.prefill(cache, 0, [tokens], all_logits=True)[0, :-1]
        following = torch.tensor(tokens[1:], device=logits.device)[:, None]
        return torch.log_softmax(logits, dim=-1).gather(-1, following)[:, 0].tolist()

    @torch.no_grad()
    def decode(
        self, cache: KVCache, start: int, tokens: list[int], positions: list[int]
    ) -> torch.Tensor:
        """One token for each of the slots ``start, start + 1, …`` at the given positions;
        returns logits ``[n, V]``. The slots are a contiguous range, so attention reads
        the cache through a view instead of gathering it."""
        device = cache.k.device
        end = start + len(tokens)
        slot_index = torch.arange(start, end, device=device)
        pos = torch.tensor(positions, device=device)
        span = int(pos.max()) + 1
        # [n, 1, 1, span]: each slot sees its own cached tokens and the new one.
        mask = (torch.arange(span, device=device)[None] <= pos[:, None])[:, None, None, :]
        x = self.model.model.embed_tokens(torch.tensor(tokens, device=device)[:, None])
        rope = self.model.model.rotary_emb(x, pos[:, None])  # cos, sin: the same for every layer
        for i, layer in enumerate(self.model.model.layers):
            q, k, v = self._attention_inputs(layer, layer.input_layernorm(x), rope)
            cache.k[i, slot_index, :, pos] = k[:, :, 0]
            cache.v[i, slot_index, :, pos] = v[:, :, 0]
            keys = cache.k[i, start:end, :, :span]
            values = cache.v[i, start:end, :, :span]
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=layer.self_attn.scaling, enable_gqa=True
            )
            x = self._finish_layer(layer, x, out)
        return self._logits(x[:, 0])
