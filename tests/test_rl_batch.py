"""The RL step's shortcuts: proximal logprobs taken, detached, from the step's own forward
give the same loss and gradients as the separate no-grad pass (a batch gets one optimizer
step, so both forwards see the same weights); a group's prompt computed once
(``trainer.share_prefix``) gives the same as the flat layout."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncrl.algorithms.losses import PPOLossConfig
from asyncrl.config import ConfigError
from asyncrl.engine.leases import SamplingConfig
from asyncrl.loop.batch import (
    add_reference_logprobs,
    length_scalars,
    penalize_kl_in_rewards,
    policy_loss,
    policy_updates,
    proximal_logprobs,
    to_sequences,
)
from asyncrl.models import ModelConfig, load_model
from asyncrl.stages.rl import RLConfig, RLExperiment
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.packing import TokenSequence, make_micro_batches
from asyncrl.wire import Sample

from .conftest import full_grads, full_tensor

TEMPERATURE = 0.7


def _batch(vocab: int, seed: int = 0) -> list[TokenSequence]:
    """Sequences whose behavior logprobs are off the policy's (so importance weights are
    not 1) and whose advantages have both signs."""
    rng = random.Random(seed)
    out = []
    for _ in range(12):
        length, prompt = rng.randint(6, 30), rng.randint(2, 5)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        mask = [0] * prompt + [1] * (length - prompt)
        behavior = [rng.uniform(-4.0, -0.5) * m for m in mask]
        adv = rng.uniform(-1.5, 1.5)
        out.append(
            TokenSequence(ids, mask, {"behavior": behavior, "advantages": [adv * m for m in mask]})
        )
    return out


def _grouped_batch(
    vocab: int, sizes: list[int], seed: int = 0, episodes: bool = False
) -> list[TokenSequence]:
    """Groups of samples of one prompt each, as ``to_sequences`` makes them; ``episodes``:
    each completion is a model turn, an observation (loss mask 0) and a second turn."""
    rng = random.Random(seed)
    out = []
    for n in sizes:
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))]
        adv = [rng.uniform(-1.5, 1.5) for _ in range(n)]
        for a in adv:
            completion = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
            turns = [1] * len(completion)
            if episodes:
                observed, second = rng.randint(1, 5), rng.randint(1, 6)
                completion += [rng.randrange(3, vocab) for _ in range(observed + second)]
                turns += [0] * observed + [1] * second
            mask = [0] * len(prompt) + turns
            behavior = [rng.uniform(-4.0, -0.5) * m for m in mask]
            fields = {"behavior": behavior, "advantages": [a * m for m in mask]}
            out.append(TokenSequence(prompt + completion, mask, fields))
    return out


def _loss_and_grads(
    core: TrainerCore,
    seqs,
    cfg,
    separate_pass: bool,
    reference=None,
    sizes: int | list[int] = 1,
    share: bool = False,
    row: int = 256,
):
    micro = make_micro_batches(seqs, row, "packed", 0, row, sizes, share)  # several micro-batches
    assert len(micro) > 1
    proximal = [None] * len(micro)
    if separate_pass:
        proximal = proximal_logprobs(core, micro, TEMPERATURE)
    if reference is not None:
        add_reference_logprobs(reference, micro, core.info.device, TEMPERATURE)
    assert "proximal" not in micro[0].fields  # passed to the loss, never stored
    loss_fn = policy_loss(cfg.rl, TEMPERATURE)
    core.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for mb, prox in zip(micro, proximal, strict=True):
        loss_sum, _, used = loss_fn(core.forward(mb), mb, prox)
        assert used is not None and (prox is None or torch.equal(used.cpu(), prox))
        loss_sum.backward()
        total += loss_sum.detach()
    return total, full_grads(core.model), micro


@pytest.mark.parametrize("positive_nll_coef", [0.0, 2.0])
def test_proximal_from_the_steps_own_forward_equals_the_separate_pass(
    dist_info, tiny_model_dir, positive_nll_coef
):
    loss = PPOLossConfig(
        clip_low=0.2, clip_high=0.28, dual_clip=3.0, iw_cap=2.0, positive_nll_coef=positive_nll_coef
    )
    cfg = RLExperiment(rl=RLConfig(loss=loss))
    core = TrainerCore(
        ModelConfig(path=tiny_model_dir), TrainerConfig(), OptimConfig(), dist_info, 0
    )
    seqs = _batch(core.model.config.vocab_size)
    loss_sep, grads_sep, micro = _loss_and_grads(core, seqs, cfg, separate_pass=True)
    loss_own, grads_own, _ = _loss_and_grads(core, seqs, cfg, separate_pass=False)
    assert torch.isfinite(loss_sep) and loss_sep != 0
    torch.testing.assert_close(loss_own, loss_sep, rtol=1e-6, atol=1e-7)
    for name in grads_sep:
        torch.testing.assert_close(grads_own[name], grads_sep[name], rtol=1e-5, atol=1e-7)
    # The shortcut is only right for the step's starting weights: another proximal policy
    # (the behavior policy's logprobs here) gives another loss.
    first = micro[0]
    with torch.no_grad():
        own = policy_loss(cfg.rl, TEMPERATURE)(core.forward(first), first, None)[0]
        other = first.fields["behavior"]
        assert not torch.allclose(
            policy_loss(cfg.rl, TEMPERATURE)(core.forward(first), first, other)[0], own
        )


@pytest.mark.parametrize("separate_pass", [False, True])
@pytest.mark.parametrize("episodes", [False, True])
def test_a_shared_prompt_gives_the_flat_layouts_loss_and_gradients(
    dist_info, tiny_model_dir, separate_pass, episodes
):
    """Each group laid out as a tree over its prompt: the same loss and gradients as every
    sample on its own, with a KL term to a reference model and an entropy bonus (every
    quantity read from the realigned logits), in fewer forward positions; likewise for
    episodes, whose observations inside the completion are out of the loss."""
    loss = PPOLossConfig(
        clip_low=0.2,
        clip_high=0.28,
        iw_cap=2.0,
        positive_nll_coef=2.0,
        kl_coef=0.1,
        kl_estimator="k3",
        entropy_coef=0.01,
    )
    cfg = RLExperiment(rl=RLConfig(loss=loss))
    model_cfg = ModelConfig(path=tiny_model_dir)
    core = TrainerCore(model_cfg, TrainerConfig(), OptimConfig(), dist_info, 0)
    reference = load_model(model_cfg, dist_info.device).eval()
    with torch.no_grad():  # a reference unlike the policy, so the KL term is not 0
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sizes = [4, 4, 1, 3, 4, 2, 4, 4]
    seqs = _grouped_batch(core.model.config.vocab_size, sizes, episodes=episodes)
    args = (core, seqs, cfg, separate_pass, reference, sizes)
    loss_flat, grads_flat, flat = _loss_and_grads(*args, share=False, row=64)
    loss_tree, grads_tree, tree = _loss_and_grads(*args, share=True, row=64)
    assert torch.isfinite(loss_flat) and loss_flat != 0
    torch.testing.assert_close(loss_tree, loss_flat, rtol=1e-5, atol=1e-6)
    for name in grads_flat:
        torch.testing.assert_close(grads_tree[name], grads_flat[name], rtol=1e-4, atol=1e-5)
    assert sum(mb.num_tokens for mb in tree) == sum(mb.num_tokens for mb in flat)
    # each group's prompt is computed once instead of n times
    firsts = [sum(sizes[:i]) for i in range(len(sizes))]
    saved = sum((n - 1) * seqs[i].loss_mask.index(1) for n, i in zip(sizes, firsts))
    forward = [sum(mb.forward_tokens for mb in layout) for layout in (flat, tree)]
    assert forward[0] == sum(len(s) for s in seqs) and forward[0] - forward[1] == saved


def test_several_updates_on_a_batch_keep_the_proximal_policy_of_the_steps_start(
    dist_info, tiny_model_dir
):
    """``rl.update_epochs = 2``: two optimizer updates over the whole batch, the second
    against the proximal logprobs of the step's start (not its own weights), one step
    (one version). Keeping the first update's own logprobs gives the weights of a
    separate no-grad pass before the step, and of two updates by hand."""
    cfg = RLExperiment(rl=RLConfig(loss=PPOLossConfig(clip_low=0.2, clip_high=0.28)))
    optim = OptimConfig(lr=3e-2, warmup_steps=0, schedule="cosine", total_steps=4)
    model_cfg = ModelConfig(path=tiny_model_dir)
    kept, passed, by_hand = (
        TrainerCore(model_cfg, TrainerConfig(), optim, dist_info, 0) for _ in range(3)
    )
    seqs = _batch(kept.model.config.vocab_size)
    micro = [make_micro_batches(seqs, 128, "packed", 0, 128) for _ in range(3)]
    assert len(micro[0]) > 1
    loss_fn = policy_loss(cfg.rl, TEMPERATURE)
    stats = policy_updates(kept, micro[0], loss_fn, epochs=2)
    assert len(stats.outputs) == len(micro[0])  # the proximal logprobs of every micro-batch
    assert all(p is not None for p in stats.outputs)
    assert not any("proximal" in mb.fields for mb in micro[0])  # passed, never stored
    # Two updates, one step: the loop advances the version, policy_updates does not.
    assert kept.step == 0 and kept.scheduler.last_epoch == 2 and not stats.skipped
    policy_updates(passed, micro[1], loss_fn, 2, proximal_logprobs(passed, micro[1], TEMPERATURE))
    proximal = proximal_logprobs(by_hand, micro[2], TEMPERATURE)
    first = [by_hand.train_step(micro[2], loss_fn, loss_inputs=proximal) for _ in range(2)][0]
    assert stats.loss == pytest.approx(first.loss, rel=1e-6)
    for name, p in kept.model.named_parameters():
        for other in (passed, by_hand):
            q = other.model.get_parameter(name)
            torch.testing.assert_close(full_tensor(p), full_tensor(q), rtol=1e-5, atol=1e-6)
    # The first update's weights are the proximal ones; the second's have moved off them,
    # so its ratio is not 1 (a proximal taken from its own forward would give exactly 0).
    assert stats.metrics["train/approx_kl_proximal"] == pytest.approx(0.0, abs=1e-6)
    assert abs(stats.metrics["train/last_update_approx_kl_proximal"]) > 1e-4
    assert stats.metrics["train/last_update_clip_fraction"] > 0
    run = RLExperiment(rl=RLConfig(max_steps=30, update_epochs=3))
    run.finalize()  # the schedule spans every update of the run
    assert run.optim.total_steps == 90
    with pytest.raises(ConfigError, match="update_epochs"):
        RLExperiment(rl=RLConfig(update_epochs=0)).finalize()


def test_share_prefix_lays_out_whole_groups_only():
    seqs = _grouped_batch(20, [3, 2])
    with pytest.raises(ValueError, match="do not split into groups"):
        make_micro_batches(seqs, 256, "packed", 0, 128, [3, 3], True)
    with pytest.raises(ValueError, match="packed layout"):
        make_micro_batches(seqs, 256, "padded", 0, 128, [3, 2], True)
    cfg = RLExperiment(rl=RLConfig(algorithm="ppo"), trainer=TrainerConfig(share_prefix=True))
    with pytest.raises(ConfigError, match="share_prefix"):
        cfg.finalize()


def test_kl_in_reward_penalizes_the_packed_token_rewards():
    """``penalize_kl_in_rewards`` on packed micro-batches: every completion token's reward
    loses β·(behavior − reference) (k1), prompt tokens and padding keep theirs."""
    rng = random.Random(1)
    seqs = []
    for _ in range(6):
        length, prompt = rng.randint(4, 9), 2
        mask = [0] * prompt + [1] * (length - prompt)
        fields = {
            "behavior": [rng.uniform(-3, 0) * m for m in mask],
            "rewards": [0.0] * (length - 1) + [rng.uniform(-1, 1)],
        }
        seqs.append(TokenSequence(list(range(3, 3 + length)), mask, fields))
    micro = make_micro_batches(seqs, 16, "packed", 0, row_tokens=16)
    assert len(micro) > 1
    before = [mb.fields["rewards"].clone() for mb in micro]
    for mb in micro:
        mb.fields["reference"] = torch.full_like(mb.fields["behavior"], -1.0)
    penalize_kl_in_rewards(micro, PPOLossConfig(kl_coef=0.5, kl_estimator="k1", kl_in_reward=True))
    for mb, old in zip(micro, before):
        expected = old - 0.5 * (mb.fields["behavior"] + 1.0) * mb.loss_mask
        assert torch.allclose(mb.fields["rewards"], expected)
        assert not torch.equal(mb.fields["rewards"], old)


def test_kl_in_reward_needs_a_critic():
    cfg = RLExperiment(
        rl=RLConfig(algorithm="grpo", loss=PPOLossConfig(kl_coef=0.1, kl_in_reward=True))
    )
    with pytest.raises(ConfigError, match="kl_in_reward"):
        cfg.finalize()


def _sample(group: int, index: int, length: int, reward: float, reason: str, vocab: int = 20):
    """A trajectory of a 3-token prompt and ``length`` generated tokens, as the buffer
    sends it."""
    rng = random.Random(group * 100 + index)
    prompt, completion = [5, 6, 7], [rng.randrange(3, vocab) for _ in range(length)]
    return Sample(
        prompt_id=group,
        group_id=group,
        sample_index=index,
        token_ids=prompt + completion,
        logprobs=[0.0] * 3 + [rng.uniform(-3.0, -0.5) for _ in completion],
        versions=[-1] * 3 + [0] * length,
        loss_mask=[0] * 3 + [1] * length,
        reward=reward,
        finish_reason=reason,
    )


def _summed_loss_grads(core: TrainerCore, seqs: list[TokenSequence], cfg):
    """The policy loss summed over ``seqs`` and its gradients, one backward per
    micro-batch (the core divides by the batch's loss tokens; this sum is before it)."""
    loss_fn = policy_loss(cfg.rl, TEMPERATURE)
    core.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for mb in make_micro_batches(seqs, 256, "packed", 0, 256):
        loss_sum, _, _ = loss_fn(core.forward(mb), mb, None)
        loss_sum.backward()
        total += loss_sum.item()
    return total, full_grads(core.model)


def test_overlong_filter_takes_truncated_samples_out_of_the_loss_only(dist_info, tiny_model_dir):
    """``rl.overlong_filter``: the truncated sample (finish reason ``length``) gets loss
    mask 0 and adds no gradient; its reward still sets its group's baseline, so the other
    samples' advantages are those without the filter. Off, it is trained on."""
    core = TrainerCore(
        ModelConfig(path=tiny_model_dir), TrainerConfig(), OptimConfig(), dist_info, 0
    )
    vocab = core.model.config.vocab_size
    rewards, reasons = [1.0, 0.0, 0.0, 1.0], ["eos", "length", "eos", "eos"]
    samples = [
        _sample(0, i, 8 if r == "length" else 3 + i, w, r, vocab)
        for i, (w, r) in enumerate(zip(rewards, reasons))
    ]
    on, off = (
        RLExperiment(rl=RLConfig(overlong_filter=f), sampling=SamplingConfig(max_new_tokens=8))
        for f in (True, False)
    )
    seqs_on, seqs_off = to_sequences(samples, on.rl, 8), to_sequences(samples, off.rl, 8)
    assert sum(seqs_off[1].loss_mask) == 8 and seqs_off[1].fields["advantages"][-1] < 0
    assert sum(seqs_on[1].loss_mask) == 0 and not any(seqs_on[1].fields["advantages"])
    for i in (0, 2, 3):  # same advantages: the filtered sample's 0 reward is in the baseline
        assert seqs_on[i].loss_mask == seqs_off[i].loss_mask
        assert seqs_on[i].fields["advantages"] == seqs_off[i].fields["advantages"]
    truncated_on = _summed_loss_grads(core, [seqs_on[1]], on)[1]
    truncated_off = _summed_loss_grads(core, [seqs_off[1]], off)[1]
    assert all(not g.any() for g in truncated_on.values())
    assert any(g.abs().sum() > 0 for g in truncated_off.values())
    # The whole group with the filter = the group without the truncated sample.
    loss_on, grads_on = _summed_loss_grads(core, seqs_on, on)
    loss_rest, grads_rest = _summed_loss_grads(core, [seqs_on[i] for i in (0, 2, 3)], on)
    loss_off, grads_off = _summed_loss_grads(core, seqs_off, off)
    assert loss_on == pytest.approx(loss_rest, rel=1e-6) and loss_off != pytest.approx(loss_on)
    for name in grads_on:
        torch.testing.assert_close(grads_on[name], grads_rest[name], rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(grads_off[n], grads_on[n]) for n in grads_on)


def test_length_scalars_of_a_batch():
    """Completion lengths 1 … 90 (eos) and ten of 100 (truncated at max_new_tokens):
    percentiles as numpy's, the truncated share, and what the overlong filter dropped."""
    lengths = list(range(1, 91)) + [100] * 10
    samples = [
        _sample(i // 4, i % 4, n, 0.0, "length" if n == 100 else "eos")
        for i, n in enumerate(lengths)
    ]
    cfg = RLExperiment(
        rl=RLConfig(overlong_filter=True), sampling=SamplingConfig(max_new_tokens=100)
    )
    got = length_scalars(samples, cfg.rl, 100, torch.device("cpu"))
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    assert got["length/p50"] == pytest.approx(p50) and got["length/p90"] == pytest.approx(p90)
    assert got["length/p99"] == pytest.approx(p99) and got["length/max"] == 100
    assert got["length/mean"] == pytest.approx(np.mean(lengths)) and got["length/samples"] == 100
    assert got["length/truncated_frac"] == pytest.approx(0.1)
    assert got["train/overlong_filtered_samples"] == 10
    assert got["train/overlong_filtered_tokens"] == 1000
    cfg.rl.overlong_filter = False
    got = length_scalars(samples, cfg.rl, 100, torch.device("cpu"))
    assert got["length/truncated_frac"] == pytest.approx(0.1)
    assert not any(k.startswith("train/overlong") for k in got)
    assert length_scalars([], cfg.rl, 100, torch.device("cpu")) == {}
