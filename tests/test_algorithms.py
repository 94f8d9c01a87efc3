"""Losses and advantages against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms.advantages import (
    gae,
    grpo_advantages,
    kl_penalized_rewards,
    overlong_penalty,
    rloo_advantages,
)
from asyncrl.algorithms.losses import PPOLossConfig, kl_estimate, ppo_loss, token_entropy


def t(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


def test_decoupled_loss_hand_computed():
    """Token 0 is the prompt (masked); then one token per mechanism:
    1: clip-higher active (u = e^0.5 > 1.28, A = +1)       pg = −1.28
    2: low clip active (u = e^−0.5 < 0.8, A = −1)          pg = +0.8
    3: ratio far above the clip with A = −1 (unclipped side) pg = +e
    4: importance weight capped (e^3 > 5), u = 1, A = 0.5   pg = −5 · 0.5
    5: importance weight below 1 (e^−1), u = 1, A = 2        pg = −2/e
    """
    logp = t(0.0, 0.5, -0.5, 1.0, 0.0, 0.0)
    prox = t(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    behav = t(0.0, 0.0, 0.0, 0.0, -3.0, 1.0)
    adv = t(0.0, 1.0, -1.0, -1.0, 0.5, 2.0)
    mask = t(0, 1, 1, 1, 1, 1)
    cfg = PPOLossConfig(clip_low=0.2, clip_high=0.28, iw_cap=5.0)
    expected = [-1.28, 0.8, math.e, -2.5, -2.0 / math.e]
    loss_sum, metrics = ppo_loss(logp, prox, behav, adv, mask, cfg)
    assert loss_sum.item() == pytest.approx(sum(expected), rel=1e-9)
    assert loss_sum.item() / mask.sum().item() == pytest.approx(
        sum(expected) / 5
    )  # token-level mean
    assert metrics["train/clip_fraction"].item() == 2  # tokens 1 and 2
    assert metrics["train/importance_weight_capped"].item() == 1

    dual = PPOLossConfig(clip_low=0.2, clip_high=0.28, iw_cap=5.0, dual_clip=2.0)
    loss_dual, _ = ppo_loss(logp, prox, behav, adv, mask, dual)
    # Dual clip bounds token 3's loss at c·|A| = 2 instead of e.
    assert loss_dual.item() == pytest.approx(sum(expected) - math.e + 2.0, rel=1e-9)


def test_token_level_mean_weighs_every_token_equally():
    """Two sequences of 1 and 3 tokens: the global token mean is (sum of all) / 4, not the
    mean of per-sequence means."""
    cfg = PPOLossConfig()
    zeros = torch.zeros(2, 4, dtype=torch.float64)
    adv = torch.tensor([[0, 1.0, 0, 0], [0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.float64)
    loss_sum, _ = ppo_loss(zeros, zeros, zeros, adv, mask, cfg)
    assert (loss_sum / mask.sum()).item() == pytest.approx(-(1 + 6) / 4)


def test_decoupled_loss_reduces_to_ppo_when_behavior_is_proximal():
    torch.manual_seed(0)
    logp, prox = torch.randn(3, 7), torch.randn(3, 7)
    adv, mask = torch.randn(3, 7), (torch.rand(3, 7) > 0.3).float()
    decoupled, _ = ppo_loss(logp, prox, prox, adv, mask, PPOLossConfig())
    standard, _ = ppo_loss(
        logp, torch.randn(3, 7), prox, adv, mask, PPOLossConfig(use_decoupled_loss=False)
    )
    assert decoupled.item() == pytest.approx(standard.item(), rel=1e-6)
    ratio = torch.exp(logp - prox)
    by_hand = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum()
    assert decoupled.item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_gradient_flows_only_through_current_logprobs():
    logp = torch.zeros(1, 3, requires_grad=True)
    prox = torch.zeros(1, 3, requires_grad=True)
    loss, _ = ppo_loss(
        logp, prox, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3), PPOLossConfig()
    )
    loss.backward()
    assert prox.grad is None or torch.all(prox.grad == 0)
    assert torch.allclose(logp.grad, -torch.ones(1, 3))  # d(−u·A)/dlogp = −u·A = −1


def test_kl_estimators_and_kl_in_loss():
    logp, ref = t(-1.0), t(-1.5)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    cfg = PPOLossConfig(kl_coef=0.1, kl_estimator="k1")
    with_kl, _ = ppo_loss(logp, logp, logp, t(0.0), t(1), cfg, ref_logprobs=ref)
    assert with_kl.item() == pytest.approx(0.1 * 0.5)
    # With the penalty in the reward, the loss has no KL term (it is in the advantages).
    in_reward = PPOLossConfig(kl_coef=0.1, kl_estimator="k1", kl_in_reward=True)
    assert ppo_loss(logp, logp, logp, t(0.0), t(1), in_reward, ref_logprobs=ref)[0].item() == 0.0


def test_kl_in_the_reward_lowers_completion_token_rewards_before_gae():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])  # token 0 is the prompt
    behavior = torch.tensor([[0.0, -1.0, -0.5, -2.0]])
    reference = torch.tensor([[-3.0, -1.5, -0.5, -1.0]])
    kl = kl_estimate(behavior, reference, "k1")  # behavior − reference: 3, 0.5, 0, −1
    shaped = kl_penalized_rewards(rewards, kl, mask, coef=0.2)
    assert torch.allclose(shaped, torch.tensor([[0.0, -0.1, 0.0, 2.2]]))
    # GAE (γ = λ = 1, zero values) then sums them from each token to the end.
    adv, _ = gae(shaped, torch.zeros(1, 4), mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.0, 2.1, 2.2, 2.2]]))


def test_positive_nll_term_applies_to_positive_advantages_only():
    logp = torch.tensor([[-0.5, -2.0, -1.0]])
    adv, mask = torch.tensor([[1.0, -1.0, 0.0]]), torch.ones(1, 3)
    plain, _ = ppo_loss(logp, logp, logp, adv, mask, PPOLossConfig())
    with_nll, _ = ppo_loss(logp, logp, logp, adv, mask, PPOLossConfig(positive_nll_coef=0.3))
    assert with_nll.item() == pytest.approx(plain.item() + 0.3 * 0.5)  # only the first token


def test_grpo_and_dr_grpo_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert torch.allclose(
        grpo_advantages(rewards), torch.tensor([[1.0, -1, -1, 1], [0, 0, 0, 0]]), atol=1e-5
    )
    assert torch.allclose(
        grpo_advantages(rewards, scale_by_std=False),
        torch.tensor([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]]),
    )


def test_rloo_advantages():
    assert torch.allclose(
        rloo_advantages(torch.tensor([[1.0, 0.0, 0.0]])), torch.tensor([[1.0, -0.5, -0.5]])
    )
    with pytest.raises(ValueError):
        rloo_advantages(torch.tensor([[1.0]]))


def test_gae_hand_computed():
    rewards, values = t(0, 0, 0, 1), t(0, 0.5, 0.6, 0.7)
    mask = t(0, 1, 1, 1)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0, 0.225, 0.25, 0.3])
    assert ret.tolist()[0] == pytest.approx([0, 0.725, 0.85, 1.0])
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([0, 0.31, 0.3, 0.3])
    # Padding after the completion changes nothing.
    padded, _ = gae(
        t(0, 0, 0, 1, 0), t(0, 0.5, 0.6, 0.7, 9.0), t(0, 1, 1, 1, 0), gamma=0.9, lam=1.0
    )
    assert padded.tolist()[0] == pytest.approx([0, 0.31, 0.3, 0.3, 0])


def test_overlong_penalty():
    got = overlong_penalty(torch.tensor([10, 15, 17, 20]), max_new_tokens=20, cache=5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.4, -1.0])


def test_entropy_hand_computed_and_bonus_in_loss():
    logits = torch.zeros(1, 3, 4, dtype=torch.float64)
    logits[0, 1] = torch.tensor([10.0, -10.0, -10.0, -10.0], dtype=torch.float64)  # nearly certain
    h = token_entropy(logits)
    assert h[0, 0].item() == 0.0  # nothing precedes token 0
    assert h[0, 1].item() == pytest.approx(math.log(4))  # drawn from uniform logits at t=0
    assert h[0, 2].item() == pytest.approx(0.0, abs=1e-6)
    zeros, ones = torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    cfg = PPOLossConfig(entropy_coef=0.1)
    loss, metrics = ppo_loss(zeros, zeros, zeros, zeros, ones, cfg, entropy=h)
    assert loss.item() == pytest.approx(-0.1 * math.log(4))
    assert metrics["train/entropy"].item() == pytest.approx(math.log(4))
