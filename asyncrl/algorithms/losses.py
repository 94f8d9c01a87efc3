"""Losses of every stage, in one module, with tensor shapes in the signatures.

Each returns a *sum* over its tokens (or pairs) plus metric sums; the trainer core
divides by the global normalizer so packing and rank count do not change the result.
"""

from __future__ import annotations

import torch

from asyncrl.trainer.logprobs import token_logprobs


def sft_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked negative log-likelihood of the completion tokens.

    Args:
        logits: ``[rows, T, V]``.
        input_ids: ``[rows, T]``.
        loss_mask: ``[rows, T]``, 1 on target tokens (completion and EOS), else 0.

    Returns:
        ``(Σ_t mask_t · −log p_t, {"train/token_accuracy": Σ_t mask_t · [argmax = target]})``.
    """
    logprobs = token_logprobs(logits, input_ids)
    nll_sum = -(logprobs * loss_mask).sum()
    with torch.no_grad():
        predicted = logits[:, :-1].argmax(-1)
        correct = torch.nn.functional.pad((predicted == input_ids[:, 1:]).float(), (1, 0))
        accuracy_sum = (correct * loss_mask).sum()
    return nll_sum, {"train/token_accuracy": accuracy_sum}
