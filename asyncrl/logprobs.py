"""Per-token log-probabilities from logits, the quantity every loss is built on."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each token given the tokens before it.

    Args:
        logits: ``[rows, T, V]`` logits of a forward pass over ``input_ids``.
        input_ids: ``[rows, T]``.
        temperature: logits are divided by it before the softmax, so the result is the
            logprob under the distribution a sampler at this temperature draws from.

    Returns:
        ``[rows, T]`` float32; entry ``t`` is ``log p(input_ids[t] | input_ids[:t])`` for
        ``t >= 1`` and 0 at ``t = 0`` (nothing precedes it; loss masks exclude it).
    """
    shifted = logits[:, :-1].float()
    if temperature != 1.0:
        shifted = shifted / temperature
    targets = input_ids[:, 1:]
    # cross_entropy fuses log_softmax and gather without a second [rows, T, V] buffer.
    nll = F.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), reduction="none"
    ).view_as(targets)
    return F.pad(-nll, (1, 0), value=0.0)
