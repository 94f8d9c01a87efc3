"""The collapse guard (``asyncrl.loop.guard``) and the running reward normalization:
the monitor alone flags the metric that left its running level and nothing during
warmup or on healthy steps; warn trains on, skip refuses the update before the
optimizer step, rollback brings back the good checkpoint's weights with the step counter
kept and the learning rate lowered; the policy loss computes the entropy the guard
watches, with no effect on the gradients."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncrl.algorithms.advantages import grpo_advantages
from asyncrl.algorithms.losses import token_entropy
from asyncrl.loop.batch import policy_loss
from asyncrl.loop.guard import Guard, GuardError
from asyncrl.loop.monitor import ENTROPY, GuardConfig, Monitor, entropy_for_the_guard
from asyncrl.loop.reward_norm import RewardNormalizer
from asyncrl.models import ModelConfig
from asyncrl.stages.rl import RLConfig, RLExperiment
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.packing import TokenSequence, make_micro_batches
from asyncrl.wire import Sample

from .conftest import full_grads, full_tensor
from .fsdp_worker import loss_fn, synthetic_sequences


def healthy(rng: random.Random) -> dict[str, float]:
    """One step's watched scalars of a healthy run, with batch noise."""
    return {
        ENTROPY: rng.gauss(0.30, 0.02),
        "rollout/reward": rng.gauss(0.50, 0.03),
        "train/grad_norm": rng.gauss(1.0, 0.1),
        "train/clip_fraction": rng.uniform(0.0, 0.02),
        "train/importance_weight": rng.gauss(1.0, 0.01),
    }


def fed_monitor(steps: int = 30) -> Monitor:
    rng = random.Random(0)
    monitor = Monitor(GuardConfig(warmup_steps=10))
    for _ in range(steps):
        values = healthy(rng)
        assert monitor.judge(values) == []  # healthy noise is never flagged
        monitor.observe(values)
    return monitor


@pytest.mark.parametrize(
    ("metric", "value"),
    [
        (ENTROPY, 0.02),  # collapse: below a quarter of its level
        (ENTROPY, 3.0),  # blow-up
        ("rollout/reward", 0.05),
        ("train/grad_norm", 20.0),
        ("train/clip_fraction", 0.4),
        ("train/importance_weight", 2.5),
        ("train/importance_weight", 0.2),
    ],
)
def test_the_monitor_flags_the_metric_that_left_its_level(metric, value):
    monitor = fed_monitor()
    values = healthy(random.Random(1)) | {metric: value}
    (flag,) = monitor.judge(values)
    assert flag.metric == metric and flag.value == value
    assert flag.level == pytest.approx(monitor.mean[metric])
    assert metric in str(flag) and "running level" in str(flag)


def test_the_monitor_judges_nothing_in_warmup_and_only_its_direction():
    monitor = fed_monitor(steps=9)
    assert monitor.judge(healthy(random.Random(1)) | {ENTROPY: 0.0}) == []  # warmup: 9 < 10
    monitor = fed_monitor()
    # Good news is not a collapse: a reward jump, a gradient norm that falls.
    assert monitor.judge({"rollout/reward": 0.95, "train/grad_norm": 0.05}) == []
    # A slow slide follows the level; the floor catches it where the level would not.
    floored = Monitor(GuardConfig(warmup_steps=10, entropy_floor=0.05))
    for step in range(60):
        entropy = 0.3 * 0.93**step
        flags = floored.judge({ENTROPY: entropy})
        assert bool(flags) == (step >= 10 and entropy < 0.05), (step, entropy)
        floored.observe({ENTROPY: entropy})


def experiment(tmp_path, **guard) -> RLExperiment:
    cfg = RLExperiment(run_dir=str(tmp_path), rl=RLConfig(guard=GuardConfig(**guard)))
    cfg.buffer.max_staleness = 1
    return cfg


def make_core(model_dir: str, info) -> TrainerCore:
    optim = OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", total_steps=40)
    return TrainerCore(ModelConfig(path=model_dir), TrainerConfig(), optim, info, 0)


def batch(core: TrainerCore, seed: int):
    seqs = synthetic_sequences(8, core.model.config.vocab_size, seed=seed)
    return make_micro_batches(seqs, budget=160, row_tokens=80)


def params(core: TrainerCore) -> dict[str, torch.Tensor]:
    return {name: full_tensor(p) for name, p in core.model.named_parameters()}


def exploding_loss(logits, mb):
    """The SFT loss × 1000: a gradient norm far above the running level."""
    loss, metrics = loss_fn(logits, mb)
    return loss * 1000.0, metrics


def guarded_step(guard: Guard, core: TrainerCore, loss, seed: int) -> dict[str, float]:
    """One RL-loop step through the guard: start, update (judged inside), end, version."""
    guard.start_step([])
    stats = core.train_step(batch(core, seed), loss)
    scalars = guard.end_step() | {"skipped": float(stats.skipped)}
    core.step += 1
    return scalars


def guard_of(cfg: RLExperiment, core: TrainerCore) -> Guard:
    return Guard(cfg.rl.guard, cfg.run_dir, cfg.buffer.max_staleness, core, {})


def test_warn_trains_on_and_skip_refuses_the_update(dist_info, tiny_model_dir, tmp_path):
    for action in ("warn", "skip"):
        core = make_core(tiny_model_dir, dist_info)
        cfg = experiment(
            tmp_path / action,
            action=action,
            metrics=["train/grad_norm"],
            warmup_steps=3,
            max_actions=2,
        )
        guard = guard_of(cfg, core)
        for seed in range(4):
            assert guarded_step(guard, core, loss_fn, seed)["guard/events"] == 0
        before = params(core)
        scalars = guarded_step(guard, core, exploding_loss, 9)
        assert scalars["guard/events"] == 1 and scalars["guard/flag/train/grad_norm"] == 1
        changed = any(not torch.equal(before[k], v) for k, v in params(core).items())
        assert changed == (action == "warn") and scalars["skipped"] == (action == "skip")
        assert scalars[f"guard/{'warnings' if action == 'warn' else 'skips'}"] == 1
        assert scalars["guard/rollbacks"] == 0 and scalars["guard/lr_scale"] == 1.0
    with pytest.raises(GuardError, match="in a row skipped"):  # max_actions=2 skips in a row
        guarded_step(guard, core, exploding_loss, 10)


def test_rollback_restores_good_weights_keeps_the_step_and_lowers_the_lr(
    dist_info, tiny_model_dir, tmp_path
):
    core = make_core(tiny_model_dir, dist_info)
    cfg = experiment(
        tmp_path,
        action="rollback",
        metrics=["train/grad_norm"],
        warmup_steps=3,
        checkpoint_every=4,
        lr_factor=0.25,
    )
    guard = guard_of(cfg, core)
    for seed in range(6):
        if core.step == 4:
            good = params(core)  # the weights step 4 starts from: judged healthy, saved
        guarded_step(guard, core, loss_fn, seed)  # saved at step 0, then 4 healthy steps later
    assert [p.name for p in (tmp_path / "guard").glob("step_*")] == ["step_00000004"]
    step, epoch, base = core.step, core.scheduler.last_epoch, core.scheduler.base_lrs[0]
    scalars = guarded_step(guard, core, exploding_loss, 9)
    assert scalars["guard/rollbacks"] == 1 and scalars["guard/lr_scale"] == 0.25
    after = params(core)
    assert all(torch.equal(good[k], after[k]) for k in after)  # the good checkpoint's
    assert core.step == step + 1  # the version goes on: the restored weights publish as it
    # The schedule keeps its position (the flagged update counted), 4× lower.
    factor = core.scheduler.lr_lambdas[0]
    assert core.scheduler.last_epoch == epoch + 1
    assert core.scheduler.base_lrs[0] == pytest.approx(0.25 * base)
    assert core.scheduler.get_last_lr()[0] == pytest.approx(0.25 * base * factor(epoch + 1))
    assert core.optimizer.param_groups[0]["lr"] == pytest.approx(0.25 * base * factor(epoch + 1))
    core.train_step(batch(core, 11), loss_fn)  # and goes on at the lower level
    assert core.scheduler.get_last_lr()[0] == pytest.approx(0.25 * base * factor(epoch + 2))
    state = guard.state_dict()
    assert state["counts"]["rollbacks"] == 1 and state["lr"] == 0.25


def test_a_rollback_before_any_good_checkpoint_restores_the_start(
    dist_info, tiny_model_dir, tmp_path
):
    """Before the first update the optimizer has no state to save: the good weights are
    the run's start, ``model.path``, restored with a fresh optimizer state."""
    core = make_core(tiny_model_dir, dist_info)
    start = params(core)
    cfg = experiment(tmp_path, action="rollback", metrics=["train/grad_norm"], warmup_steps=2)
    guard = guard_of(cfg, core)
    for seed in range(2):
        guarded_step(guard, core, loss_fn, seed)
    assert not list((tmp_path / "guard").glob("step_*"))
    assert guarded_step(guard, core, exploding_loss, 9)["guard/rollbacks"] == 1
    assert all(torch.equal(start[k], v) for k, v in params(core).items())
    assert not core.optimizer.state and core.step == 3


def test_the_policy_loss_computes_the_watched_entropy_without_changing_gradients(
    dist_info, tiny_model_dir
):
    rng, vocab = random.Random(0), make_core(tiny_model_dir, dist_info).model.config.vocab_size
    seqs = []
    for _ in range(6):
        ids = [rng.randrange(3, vocab) for _ in range(12)]
        mask = [0] * 4 + [1] * 8
        fields = {"behavior": [-1.0 * m for m in mask], "advantages": [rng.uniform(-1, 1)] * 12}
        seqs.append(TokenSequence(ids, mask, fields))
    (mb,) = make_micro_batches(seqs, 1024, "packed", 0, 1024)
    grads, metrics = {}, {}
    for action in ("off", "warn"):
        core = make_core(tiny_model_dir, dist_info)
        cfg = RLExperiment(rl=RLConfig(guard=GuardConfig(action=action)))
        loss, metrics[action], _ = policy_loss(cfg.rl, 0.7)(core.forward(mb), mb, None)
        loss.backward()
        grads[action] = full_grads(core.model)
    assert ENTROPY not in metrics["off"] and metrics["warn"][ENTROPY] > 0
    assert all(torch.equal(grads["off"][k], grads["warn"][k]) for k in grads["off"])


def test_the_guards_entropy_is_token_entropy_a_chunk_at_a_time():
    logits = torch.randn(2, 37, 11) * 3
    mask = (torch.rand(2, 37) > 0.3).float()
    mask[:, 0] = 0
    for chunk in (1, 8, 36, 512):
        chunked = entropy_for_the_guard(logits, mask, 0.7, chunk)
        assert torch.allclose(chunked, token_entropy(logits, 0.7) * mask, atol=1e-6)
    assert entropy_for_the_guard(logits[:, :1], mask[:, :1], 0.7).shape == (2, 1)


def samples(rewards: list[float], group: int = 4) -> list[Sample]:
    return [
        Sample(
            prompt_id=i // group,
            group_id=i // group,
            sample_index=i % group,
            token_ids=[1],
            logprobs=[0.0],
            versions=[0],
            loss_mask=[0],
            reward=r,
        )
        for i, r in enumerate(rewards)
    ]


def test_running_reward_norm_follows_a_drifting_scale():
    rng = random.Random(0)
    norm = RewardNormalizer("running", 0.9, torch.device("cpu"))
    first = [rng.gauss(5.0, 2.0) for _ in range(64)]
    out = [s.reward for s in norm.normalize(samples(first))]
    assert sum(out) / 64 == pytest.approx(0.0, abs=1e-9)  # the first batch sets the moments
    assert math.sqrt(sum(x * x for x in out) / 64) == pytest.approx(1.0, rel=1e-4)
    for step in range(60):  # the scale drifts tenfold
        scale = 1.0 + 9.0 * step / 59
        out = [
            s.reward
            for s in norm.normalize(samples([rng.gauss(5 * scale, 2 * scale) for _ in range(64)]))
        ]
    assert abs(sum(out) / 64) < 0.5 and 0.6 < math.sqrt(sum(x * x for x in out) / 64) < 1.5
    again = RewardNormalizer("running", 0.9, torch.device("cpu"))
    again.load_state_dict(norm.state_dict())  # what a checkpoint keeps: the same next batch
    nxt = samples([rng.gauss(50, 20) for _ in range(8)])
    assert [s.reward for s in norm.normalize(nxt)] == [s.reward for s in again.normalize(nxt)]
    # GRPO's per-group z-score is blind to it: the same advantages, up to the epsilons.
    raw = torch.tensor([[s.reward for s in nxt[:4]]])
    normed = torch.tensor(
        [
            [
                s.reward
                for s in RewardNormalizer("running", 0.9, torch.device("cpu")).normalize(nxt[:4])
            ]
        ]
    )
    assert torch.allclose(grpo_advantages(raw), grpo_advantages(normed), atol=1e-3)
    plain = RewardNormalizer("none", 0.9, torch.device("cpu"))
    assert plain.normalize(nxt) is nxt
