"""The importance-sampling corrections of the policy loss (``PPOLossConfig.is_correction``),
each on a ``[2, 5]`` batch worked out by hand, and their config checks.

The batch: the current policy equals the proximal one (u = 1, no clipping), so each loss
token adds −w·A and its gradient is −w·A; the behavior ratios ρ = exp(prox − behav) are
row 0: [1, 1, 3, 0.25, 8] with A = 1, row 1: [1, 1.5, 0.8, 1, 100] with A = −2; position
0 of both rows and the last one of row 1 (ρ = 100) are no loss tokens. C = ``iw_cap`` = 5.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms.losses import PPOLossConfig, importance_weights, ppo_loss
from asyncrl.config import ConfigError
from asyncrl.stages.rl import RLConfig, RLExperiment

RATIOS = [[1.0, 1.0, 3.0, 0.25, 8.0], [1.0, 1.5, 0.8, 1.0, 100.0]]
MASK = [[0.0, 1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0, 0.0]]
ADVANTAGES = [[1.0] * 5, [-2.0] * 5]


def _batch():
    proximal = torch.full((2, 5), -1.0)
    behavior = proximal - torch.tensor(RATIOS).log()
    logprobs = proximal.clone().requires_grad_(True)
    return logprobs, proximal, behavior, torch.tensor(ADVANTAGES), torch.tensor(MASK)


def _loss(correction: str, **kw):
    logprobs, proximal, behavior, adv, mask = _batch()
    cfg = PPOLossConfig(is_correction=correction, iw_cap=5.0, **kw)
    loss, metrics = ppo_loss(logprobs, proximal, behavior, adv, mask, cfg)
    loss.backward()
    weight, kept = importance_weights(proximal, behavior, mask, cfg)
    return loss.item(), logprobs.grad, weight, kept, metrics


def _close(tensor: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(
        tensor, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6
    )


def test_truncate_is_the_previous_formula():
    loss, grad, weight, kept, metrics = _loss("truncate")
    _close(weight, [[1, 1, 3, 0.25, 5], [1, 1.5, 0.8, 1, 5]])  # min(ρ, 5)
    _close(kept, MASK)  # every loss token trains
    # −(1 + 3 + 0.25 + 5)·1 − (1.5 + 0.8 + 1)·(−2) = −9.25 + 6.6
    assert loss == pytest.approx(-2.65, rel=1e-5)
    _close(grad, [[0, -1, -3, -0.25, -5], [0, 3, 1.6, 2, 0]])
    # The formula before the option existed: w = min(exp(prox − behav), C), nothing masked.
    logprobs, proximal, behavior, adv, mask = _batch()
    before = -(torch.exp(proximal - behavior).clamp(max=5.0) * adv * mask).sum()
    assert loss == pytest.approx(before.item(), rel=1e-6)
    assert "train/is_masked_fraction" not in metrics


def test_token_mask_drops_the_tokens_above_the_cap():
    loss, grad, weight, kept, metrics = _loss("token_mask")
    # row 0's ρ = 8 > 5 is dropped, not clipped; ρ = 100 is no loss token anyway
    _close(kept, [[0, 1, 1, 1, 0], [0, 1, 1, 1, 0]])
    _close(weight, [[0, 1, 3, 0.25, 0], [0, 1.5, 0.8, 1, 0]])  # 0 off the mask
    # −(1 + 3 + 0.25)·1 + 6.6
    assert loss == pytest.approx(2.35, rel=1e-5)
    _close(grad, [[0, -1, -3, -0.25, 0], [0, 3, 1.6, 2, 0]])  # no gradient from ρ = 8
    assert metrics["train/is_masked_fraction"].item() == 1.0  # a sum: the core divides


def test_icepop_drops_the_tokens_outside_its_band():
    loss, grad, weight, kept, metrics = _loss("icepop", icepop_low=0.5, icepop_high=2.0)
    # row 0: 3, 0.25 and 8 leave [0.5, 2]; row 1's 1.5, 0.8, 1 stay, with their ratio
    _close(kept, [[0, 1, 0, 0, 0], [0, 1, 1, 1, 0]])
    _close(weight, [[0, 1, 0, 0, 0], [0, 1.5, 0.8, 1, 0]])
    # −1·1 + 6.6
    assert loss == pytest.approx(5.6, rel=1e-5)
    _close(grad, [[0, -1, 0, 0, 0], [0, 3, 1.6, 2, 0]])
    assert metrics["train/is_masked_fraction"].item() == 3.0


def test_sequence_mask_drops_a_whole_row_by_its_geometric_mean():
    loss, grad, weight, kept, metrics = _loss("sequence_mask", sequence_low=0.9, sequence_high=1.1)
    # row 0: (1·3·0.25·8)^(1/4) = 6^(1/4) ≈ 1.565 > 1.1, dropped whole; row 1: (1.5·0.8·1)^(1/3)
    # = 1.2^(1/3) ≈ 1.063, kept (its ρ = 100 is no loss token: counted, the mean would be
    # 120^(1/4) ≈ 3.3), its tokens with TIS's min(ρ, 5)
    assert 6**0.25 > 1.1 and 0.9 < 1.2 ** (1 / 3) < 1.1
    _close(kept, [[0, 0, 0, 0, 0], [0, 1, 1, 1, 0]])
    _close(weight, [[0, 0, 0, 0, 0], [0, 1.5, 0.8, 1, 0]])
    # row 1 alone: −(1.5 + 0.8 + 1)·(−2)
    assert loss == pytest.approx(6.6, rel=1e-5)
    _close(grad, [[0, 0, 0, 0, 0], [0, 3, 1.6, 2, 0]])
    assert metrics["train/is_masked_fraction"].item() == 4.0


def test_sequence_mask_reads_the_samples_of_a_packed_row():
    """One packed row: sample 0 (ρ = 1, 8, 0.125, 1), sample 1 (ρ = 1, 2, 2, 2) and a
    padding token (id -1) with an overflowing ratio. Sample 0's loss tokens have
    geometric mean (8·0.125·1)^(1/3) = 1: kept, its ρ = 8 clipped to 5; sample 1's is 2:
    dropped. Read as one sample, the row's mean is 8^(1/6) ≈ 1.41: all dropped."""
    ratios = torch.tensor([[1.0, 8.0, 0.125, 1.0, 1.0, 2.0, 2.0, 2.0, 1.0]])
    proximal = torch.zeros(1, 9)
    behavior = proximal - ratios.log()
    behavior[0, 8] = -1000.0  # the padding: ρ = e^1000 = inf in float32
    mask = torch.tensor([[0.0, 1, 1, 1, 0, 1, 1, 1, 0]])
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, -1]])
    cfg = PPOLossConfig(is_correction="sequence_mask", iw_cap=5.0)
    weight, kept = importance_weights(proximal, behavior, mask, cfg, ids)
    _close(kept, [[0, 1, 1, 1, 0, 0, 0, 0, 0]])
    _close(weight, [[0, 5, 0.125, 1, 0, 0, 0, 0, 0]])
    _, as_one_row = importance_weights(proximal, behavior, mask, cfg)
    assert not as_one_row.any()
    adv = torch.ones(1, 9)
    loss, _ = ppo_loss(proximal.clone(), proximal, behavior, adv, mask, cfg, sequence_ids=ids)
    assert loss.item() == pytest.approx(-(5 + 0.125 + 1), rel=1e-6)  # finite: no inf · 0


def test_masks_keep_an_overflowing_ratio_out_of_the_loss():
    proximal, behavior = torch.zeros(1, 3), torch.tensor([[0.0, -1000.0, -0.1]])  # ρ = inf
    mask, adv = torch.tensor([[0.0, 1.0, 1.0]]), torch.ones(1, 3)
    for correction in ("token_mask", "icepop"):
        cfg = PPOLossConfig(is_correction=correction)
        loss, _ = ppo_loss(proximal.clone(), proximal, behavior, adv, mask, cfg)
        assert loss.item() == pytest.approx(-math.exp(0.1), rel=1e-6)


@pytest.mark.parametrize(
    "loss, key",
    [
        (PPOLossConfig(is_correction="clip"), "rl.loss.is_correction"),  # type: ignore[arg-type]
        (PPOLossConfig(iw_cap=0.0), "rl.loss.iw_cap"),
        (PPOLossConfig(icepop_low=2.0, icepop_high=0.5), "rl.loss.icepop_low"),
        (PPOLossConfig(icepop_low=0.0), "rl.loss.icepop_low"),
        (PPOLossConfig(sequence_low=1.0, sequence_high=1.0), "rl.loss.sequence_low"),
        (PPOLossConfig(sequence_low=1.05, sequence_high=1.2), "rl.loss.sequence_low"),
    ],
)
def test_a_bad_correction_or_band_is_refused_by_name(loss, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RLExperiment(rl=RLConfig(loss=loss)).finalize()
