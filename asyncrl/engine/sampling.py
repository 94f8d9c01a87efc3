"""Token sampling for the embedded engine: greedy, temperature, top-k, top-p, per-request
seeds, and the behavior logprob of each sampled token.

A seeded request's token at sequence position t is drawn by inverting its distribution's
CDF at one uniform number that is a pure function of (seed, t) (``uniform_at``, a
counter-based hash): no generator state, so a request's tokens depend on neither which
other requests share its batch nor the engine it runs on, and a sample resumed on
another generator (its prompt plus its earlier tokens) draws what it would have drawn.
Unseeded rows take the Gumbel-max trick over one batch draw (argmax of logits plus
Gumbel noise is an exact categorical sample).
"""

from __future__ import annotations

import torch

from asyncrl.engine.base import SamplingParams
from asyncrl.seeds import derive_seed


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` logits with tokens outside each row's top-k and top-p nucleus at -inf.

    ``top_k[b] = 0`` keeps all tokens; ``top_p[b] = 1`` disables the nucleus.
    """
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None]
    k = torch.where(top_k > 0, top_k, scaled.shape[-1])[:, None]
    probs = sorted_logits.softmax(-1)
    # Drop a token once the tokens ranked before it already reach top_p (the first stays).
    drop = (rank >= k) | ((probs.cumsum(-1) - probs) >= top_p[:, None])
    return scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` ``[B, V]``; returns tokens and logprobs.
    ``positions[b]``: where row b's token goes in its sequence (prompt included), the
    counter of a seeded row's draw.

    The logprob is ``log_softmax(logits / T)[token]`` (T = 1 for greedy rows) before any
    truncation, matching what the trainer recomputes.
    """
    logits = logits.float()
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    greedy = temperature <= 0.0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logprobs = torch.log_softmax(scaled, -1)
    tokens = logits.argmax(-1)
    if not bool(greedy.all()):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        if bool((top_k > 0).any() or (top_p < 1.0).any()):
            scaled = _truncate(scaled, top_k, top_p)
        seeded = [b for b, p in enumerate(params) if p.seed is not None]
        drawn = tokens.clone()
        if len(seeded) < len(params):  # Gumbel-max over one draw for the unseeded rows
            uniform = torch.rand(logits.shape, device=device)
            gumbel = -torch.log(-torch.log(uniform.clamp_(1e-20, 1.0 - 1e-7)))
            drawn = (scaled + gumbel).argmax(-1)
        if seeded:
            u = uniform_at([params[b].seed for b in seeded], [positions[b] for b in seeded])
            drawn[seeded] = _invert_cdf(scaled[seeded], u.to(device))
        tokens = torch.where(greedy, tokens, drawn)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()


def _invert_cdf(scaled: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token at quantile ``u [B]`` of softmax(``scaled [B, V]``): the first whose
    cumulative probability exceeds it. A token of probability 0 (truncated) is never the
    first to exceed it, and the float64 sum keeps the tail's tokens reachable."""
    cdf = torch.softmax(scaled.double(), -1).cumsum(-1)
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return index.clamp_(max=scaled.shape[-1] - 1)


def uniform_at(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """``[B]`` float64 numbers in [0, 1), entry b a pure function of (seeds[b], positions[b])."""
    return torch.tensor(
        [(derive_seed(s, t) >> 10) * 2.0**-53 for s, t in zip(seeds, positions)],
        dtype=torch.float64,
    )
