"""From a buffer batch to training inputs, for the RL step (DESIGN §6): group rewards to
per-token advantages (or token rewards, for the critic), the logprobs recomputed with the
step's starting weights (proximal, and the frozen reference's for a KL term), and the
decoupled-PPO loss over a micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from asyncrl.algorithms.advantages import (
    grpo_advantages,
    kl_penalized_rewards,
    overlong_penalty,
    rloo_advantages,
)
from asyncrl.algorithms.losses import PPOLossConfig, kl_estimate, ppo_loss, token_entropy
from asyncrl.stages.critic import reward_on_last_token
from asyncrl.trainer.core import StepStats, TrainerCore
from asyncrl.trainer.logprobs import token_logprobs
from asyncrl.trainer.packing import MicroBatch, TokenSequence
from asyncrl.wire import Sample


def to_sequences(samples: list[Sample], cfg) -> list[TokenSequence]:
    """Trajectories to training sequences with per-token behavior logprobs and advantages
    (for PPO, token rewards: the critic computes the advantages).

    Samples arrive as whole groups (the buffer keeps a group on one rank), in group order.
    """
    out = []
    for members in by_group(samples):
        rewards = torch.tensor([[s.reward for s in members]], dtype=torch.float32)
        if cfg.rl.overlong_cache:
            lengths = torch.tensor([sum(s.loss_mask) for s in members])
            penalty = overlong_penalty(lengths, cfg.sampling.max_new_tokens, cfg.rl.overlong_cache)
            rewards = rewards + penalty  # [1, n] + [n]
        if cfg.rl.algorithm == "ppo":  # the critic turns token rewards into advantages later
            adv = rewards[0]
        elif cfg.rl.algorithm == "rloo":
            adv = rloo_advantages(rewards)[0]
        else:
            adv = grpo_advantages(rewards, scale_by_std=cfg.rl.algorithm == "grpo")[0]
        for s, a in zip(members, adv.tolist()):
            per_token = (
                {"rewards": reward_on_last_token(s.loss_mask, a)}
                if cfg.rl.algorithm == "ppo"
                else {"advantages": [a * m for m in s.loss_mask]}
            )
            out.append(
                TokenSequence(s.token_ids, s.loss_mask, {"behavior": s.logprobs, **per_token})
            )
    return out


def by_group(samples: list[Sample]) -> list[list[Sample]]:
    """``samples`` by group, groups in order of first appearance: ``to_sequences``' order."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return list(groups.values())


def group_sizes(samples: list[Sample]) -> list[int]:
    """Sizes of the consecutive groups ``to_sequences`` makes of ``samples``, in its order."""
    return [len(members) for members in by_group(samples)]


def recompute_logprobs(
    core: TrainerCore,
    micro: list[MicroBatch],
    reference: torch.nn.Module | None,
    temperature: float,
    proximal: bool = True,
) -> None:
    """Store ``proximal`` (the policy at the start of this step; when ``proximal``) and,
    with a frozen ``reference``, ``reference`` logprobs ``[rows, T]`` in each micro-batch;
    no grad."""
    if not proximal and reference is None:
        return
    with torch.no_grad():
        for mb in core.align(micro):
            moved = mb.to(core.info.device)
            if proximal:
                mb.fields["proximal"] = token_logprobs(
                    core.forward(moved), moved.input_ids, temperature
                ).cpu()
            if reference is not None:
                logits = reference(
                    input_ids=moved.input_ids,
                    position_ids=moved.position_ids,
                    attention_mask=moved.attention_mask,
                    use_cache=False,
                ).logits
                logits = moved.align_logits(logits)
                mb.fields["reference"] = token_logprobs(logits, moved.input_ids, temperature).cpu()


def penalize_kl_in_rewards(micro: list[MicroBatch], cfg: PPOLossConfig) -> None:
    """``kl_in_reward``: take β·KL(behavior ‖ reference) off each completion token's
    ``rewards`` (PPO's token rewards, before the critic's GAE). The behavior logprobs are
    the policy that sampled the tokens, as InstructGPT's rollout policy."""
    for mb in micro:
        f = mb.fields
        if "rewards" not in f or "reference" not in f:  # a padding micro-batch
            continue
        kl = kl_estimate(f["behavior"], f["reference"], cfg.kl_estimator)
        f["rewards"] = kl_penalized_rewards(f["rewards"], kl, mb.loss_mask, cfg.kl_coef)


def policy_loss(cfg, temperature: float) -> Callable:
    """The trainer core's ``loss_fn`` for the policy: decoupled PPO on a micro-batch.

    Without a stored ``proximal`` field the proximal logprobs are this forward's own,
    detached: with one update per batch, the weights of the step's forward are the
    weights at the start of the step, the proximal policy's (``RLConfig.proximal_pass``).
    They are left in the micro-batch's fields, where ``policy_updates`` picks them up for
    its later updates.
    """

    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        f = mb.fields
        if "behavior" not in f:  # padding micro-batch of a rank that got no samples
            return logits.sum() * 0.0, {}
        logp = token_logprobs(logits, mb.input_ids, temperature)
        if "proximal" not in f:  # this forward's own
            f["proximal"] = logp.detach()
        proximal = f["proximal"]
        entropy = token_entropy(logits, temperature) if cfg.rl.loss.entropy_coef else None
        return ppo_loss(
            logp,
            proximal,
            f["behavior"],
            f["advantages"],
            mb.loss_mask,
            cfg.rl.loss,
            ref_logprobs=f.get("reference"),
            entropy=entropy,
        )

    return loss_fn


def policy_updates(
    core: TrainerCore, micro: list[MicroBatch], loss_fn: Callable, epochs: int
) -> StepStats:
    """``epochs`` optimizer updates of the policy, each over the whole batch (PPO's
    epochs, GRPO's μ); the step, which is the version, advances once, also when an update
    was non-finite and skipped (a batch, a step and a version stay one to one).

    Every update is against the proximal policy of the step's start. Without stored
    ``proximal`` logprobs the first update's forward, detached, gives them (its weights
    are the starting ones) and they are kept in ``micro`` for the later updates: the
    same as a separate no-grad pass, a forward cheaper (a test checks both).
    Returns the first update's loss, gradient norm and metrics (the quantities of a
    single update); with more, the last update's clip fraction and proximal KL as
    ``train/last_update_*`` (how far the later updates moved); the time of all.
    """
    step, kept = core.step, []

    def keep_proximal(logits: torch.Tensor, mb: MicroBatch):
        out = loss_fn(logits, mb)  # sets mb.fields["proximal"] on a real micro-batch
        if "proximal" in mb.fields:
            kept.append(mb.fields["proximal"].cpu())
        return out

    stats = [core.train_step(micro, keep_proximal if epochs > 1 else loss_fn)]
    if epochs > 1:  # the core calls the loss once per micro-batch, in order
        assert len(kept) == len(micro), "a micro-batch without its proximal logprobs"
        for mb, proximal in zip(micro, kept):
            mb.fields["proximal"] = proximal
    stats += [core.train_step(micro, loss_fn) for _ in range(epochs - 1)]
    core.step = step + 1
    first, last = stats[0], stats[-1]
    metrics = dict(first.metrics)
    if epochs > 1:
        for key in ("clip_fraction", "approx_kl_proximal"):
            if f"train/{key}" in last.metrics:
                metrics[f"train/last_update_{key}"] = last.metrics[f"train/{key}"]
    seconds = sum(s.seconds for s in stats)
    skipped = all(s.skipped for s in stats)
    return replace(first, seconds=seconds, skipped=skipped, metrics=metrics)
