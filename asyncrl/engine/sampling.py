"""Token sampling for the embedded engine: greedy, temperature, top-k, top-p, per-request
seeds, and the behavior logprob of each sampled token.

The batch is sampled in one vectorized pass with the Gumbel-max trick (argmax of
logits plus Gumbel noise is an exact categorical sample); only the uniform noise is drawn
row by row, from each request's own generator, so a request's samples do not depend on
which other requests share its batch.
"""

from __future__ import annotations

import torch

from asyncrl.engine.base import SamplingParams


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
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` ``[B, V]``; returns tokens and logprobs.

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
        if any(g is not None for g in generators):
            uniform = torch.stack(
                [
                    torch.rand(logits.shape[-1], generator=g, device=device)
                    if g is not None
                    else torch.rand(logits.shape[-1], device=device)
                    for g in generators
                ]
            )
        else:  # no seeded row: one draw for the batch (a row per request costs a call each)
            uniform = torch.rand(logits.shape, device=device)
        gumbel = -torch.log(-torch.log(uniform.clamp_(1e-20, 1.0 - 1e-7)))
        tokens = torch.where(greedy, tokens, (scaled + gumbel).argmax(-1))
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()
