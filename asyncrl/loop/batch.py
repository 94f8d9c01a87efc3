"""From a buffer batch to training inputs, and the policy's update, for the RL step
(docs/design.md, The loss): group rewards to per-token advantages (or token rewards, for the
critic), micro-batches, the logprobs of the step's starting weights (proximal) and of the
frozen reference (for a KL term), the decoupled-PPO loss over a micro-batch, and the
optimizer update(s) of a batch; DAPO's overlong filtering (``trained_mask``), the batch's
completion-length figures (``length_scalars``) and the train–inference mismatch of its
tokens (``mismatch_scalars``).

The proximal logprobs are a value the step passes around, ``[rows, T]`` per micro-batch:
computed by a separate no-grad pass (``proximal_logprobs``), or returned by the first
update's loss from its own forward and handed to the later updates (``policy_updates``).
Nothing here writes into a micro-batch but the preparation steps named for it
(``add_reference_logprobs``, ``penalize_kl_in_rewards``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from asyncrl.algorithms.advantages import (
    grpo_advantages,
    kl_penalized_rewards,
    overlong_penalty,
    rloo_advantages,
)
from asyncrl.algorithms.losses import PPOLossConfig, kl_estimate, ppo_loss, token_entropy
from asyncrl.logprobs import token_logprobs
from asyncrl.loop.config import RLConfig
from asyncrl.loop.critic import reward_on_last_token
from asyncrl.loop.monitor import entropy_for_the_guard
from asyncrl.trainer.config import TrainerConfig
from asyncrl.trainer.core import StepStats, TrainerCore, micro_batch_logits
from asyncrl.trainer.dist import all_reduce_max, all_reduce_sum
from asyncrl.trainer.packing import (
    MicroBatch,
    TokenSequence,
    dummy_micro_batch,
    make_micro_batches,
)
from asyncrl.wire import Sample


def to_sequences(samples: list[Sample], rl: RLConfig, cap: int) -> list[TokenSequence]:
    """Trajectories to training sequences with per-token behavior logprobs and advantages
    (for PPO, token rewards: the critic computes the advantages). ``cap``: the most tokens
    a completion can have (``RLExperiment.completion_cap``), where overlong shaping ends.

    Samples arrive as whole groups (the buffer keeps a group on one rank), in group order.
    Under ``rl.overlong_filter`` a truncated sample trains with loss mask 0 (``trained_mask``).
    ``versions`` (the weights version of each generated token, -1 elsewhere) is for
    ``mismatch_scalars``; the padding of a micro-batch reads version 0, loss mask 0.
    """
    out = []
    for members in by_group(samples):
        rewards = torch.tensor([[s.reward for s in members]], dtype=torch.float32)
        if rl.overlong_cache:
            lengths = torch.tensor([completion_length(s) for s in members])
            penalty = overlong_penalty(lengths, cap, rl.overlong_cache)
            rewards = rewards + penalty  # [1, n] + [n]
        if rl.algorithm == "ppo":  # the critic turns token rewards into advantages later
            adv = rewards[0]
        elif rl.algorithm == "rloo":
            adv = rloo_advantages(rewards)[0]
        else:
            adv = grpo_advantages(rewards, scale_by_std=rl.algorithm == "grpo")[0]
        for s, a in zip(members, adv.tolist()):
            mask = trained_mask(s, rl)
            per_token = (
                {"rewards": reward_on_last_token(s.loss_mask, a)}
                if rl.algorithm == "ppo"
                else {"advantages": [a * m for m in mask]}
            )
            fields = {"behavior": s.logprobs, "versions": s.versions, **per_token}
            out.append(TokenSequence(s.token_ids, mask, fields))
    return out


def overlong_filtered(sample: Sample, rl: RLConfig) -> bool:
    """Whether ``rl.overlong_filter`` takes ``sample`` out of the loss: it was truncated."""
    return rl.overlong_filter and sample.finish_reason == "length"


def trained_mask(sample: Sample, rl: RLConfig) -> list[int]:
    """The loss mask the step trains ``sample`` with: its own, or all 0 when overlong
    filtering drops it. Only the mask: its reward has already counted in its group's
    baseline, as DAPO masks the loss of truncated samples and nothing else."""
    return [0] * len(sample.loss_mask) if overlong_filtered(sample, rl) else sample.loss_mask


def completion_length(sample: Sample) -> int:
    """Generated tokens of ``sample`` (its loss mask is 1 on exactly those)."""
    return sum(sample.loss_mask)


def length_scalars(
    samples: list[Sample], rl: RLConfig, cap: int, device: torch.device
) -> dict[str, float]:
    """The whole step batch's completion lengths, every rank's share (every rank calls it:
    one collective over a histogram of lengths 0 … ``cap``, the most a completion can
    have): ``length/p50``, ``/p90``, ``/p99``, ``/max``, ``/mean``, ``/truncated_frac``
    (finish reason ``length``) and ``/samples``; with ``rl.overlong_filter``, the samples
    and completion tokens it took out of the loss."""
    counts = [0.0] * (cap + 1)
    truncated = filtered_tokens = 0.0
    for s in samples:
        n = completion_length(s)
        counts[min(n, cap)] += 1  # an engine stops at max_new_tokens: the clamp never bites
        truncated += s.finish_reason == "length"
        filtered_tokens += n if overlong_filtered(s, rl) else 0
    *counts, truncated, filtered_tokens = all_reduce_sum(
        counts + [truncated, filtered_tokens], device
    )
    out = length_figures(counts)
    if out:
        out["length/truncated_frac"] = truncated / out["length/samples"]
    if out and rl.overlong_filter:
        out["train/overlong_filtered_samples"] = truncated
        out["train/overlong_filtered_tokens"] = filtered_tokens
    return out


def length_figures(counts: list[float]) -> dict[str, float]:
    """Percentiles (linear interpolation, as ``numpy.percentile``), max, mean and count of
    the lengths whose histogram is ``counts`` (``counts[n]``: samples of length n); {} for
    none."""
    lengths = torch.repeat_interleave(
        torch.arange(len(counts), dtype=torch.float64), torch.tensor(counts).round().long()
    )
    if not len(lengths):
        return {}
    p50, p90, p99 = torch.quantile(lengths, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {
        "length/p50": p50.item(),
        "length/p90": p90.item(),
        "length/p99": p99.item(),
        "length/max": lengths.max().item(),
        "length/mean": lengths.mean().item(),
        "length/samples": float(len(lengths)),
    }


def by_group(samples: list[Sample]) -> list[list[Sample]]:
    """``samples`` by group, groups in order of first appearance: ``to_sequences``' order."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return list(groups.values())


def group_sizes(samples: list[Sample]) -> list[int]:
    """Sizes of the consecutive groups ``to_sequences`` makes of ``samples``, in its order."""
    return [len(members) for members in by_group(samples)]


def rl_micro_batches(
    samples: list[Sample], rl: RLConfig, cap: int, trainer: TrainerConfig, pad_id: int
) -> list[MicroBatch]:
    """This rank's samples (``to_sequences``) as micro-batches under
    ``trainer.micro_batch_tokens``; with ``trainer.share_prefix`` each group is a tree over
    its prompt."""
    return make_micro_batches(
        to_sequences(samples, rl, cap),
        trainer.micro_batch_tokens,
        trainer.packing,
        pad_id,
        trainer.row_tokens,
        group_sizes(samples),
        trainer.share_prefix,
    )


def proximal_logprobs(
    core: TrainerCore, micro: list[MicroBatch], temperature: float
) -> list[torch.Tensor]:
    """The policy's logprobs ``[rows, T]`` (on the CPU) for each micro-batch, with the
    weights at the start of this step: a separate no-grad pass (``rl.proximal_pass``).
    Every rank calls it (FSDP gathers weights)."""
    out = []
    with torch.no_grad():
        for mb in core.align(micro):
            moved = mb.to(core.info.device)
            out.append(token_logprobs(core.forward(moved), moved.input_ids, temperature).cpu())
    return out[: len(micro)]


def add_reference_logprobs(
    reference: torch.nn.Module, micro: list[MicroBatch], device: torch.device, temperature: float
) -> None:
    """Store the frozen reference's logprobs ``[rows, T]`` as each micro-batch's
    ``reference`` field (the KL term's, in the loss or in the rewards); no grad. The
    reference is sharded like the policy (``frozen_model``), so every rank calls this and
    runs as many forwards as the rank with the most micro-batches, on empty ones past its
    own (FSDP gathers each layer from all ranks); an unsharded module works as well."""
    count = all_reduce_max(len(micro), device)
    # Token 0 of the padding is any id: its logits are thrown away.
    padding = [dummy_micro_batch(0, []) for _ in range(count - len(micro))]
    with torch.no_grad():
        for i, mb in enumerate(micro + padding):
            moved = mb.to(device)
            logits = micro_batch_logits(reference, moved)
            if i < len(micro):
                logprobs = token_logprobs(logits, moved.input_ids, temperature)
                mb.fields["reference"] = logprobs.cpu()
    if isinstance(reference, FSDPModule):
        # FSDP keeps the root's parameters gathered after a forward for the backward, which
        # a reference never runs: without this it would hold its whole root unit (the
        # embedding and LM head) through the policy's update.
        reference.reshard()


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


PolicyLoss = Callable[
    [torch.Tensor, MicroBatch, torch.Tensor | None],
    tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None],
]
"""``loss_fn(logits [rows, T, V], mb, proximal [rows, T] | None) -> (loss_sum [],
metric_sums, proximal [rows, T] | None)``: the trainer core's ``LossFn`` for the policy,
with the proximal logprobs as its input and its output."""


def policy_loss(rl: RLConfig, temperature: float) -> PolicyLoss:
    """Decoupled PPO on a micro-batch, with ``rl.loss``.

    ``proximal`` None: the proximal logprobs are this forward's own, detached. With the
    step's first update, the weights of this forward are the weights at the start of the
    step, the proximal policy's (``RLConfig.proximal_pass``). The loss returns the
    proximal logprobs it used, for the later updates of the same batch.
    """

    def loss_fn(logits: torch.Tensor, mb: MicroBatch, proximal: torch.Tensor | None):
        f = mb.fields
        if "behavior" not in f:  # padding micro-batch of a rank that got no samples
            return logits.sum() * 0.0, {}, None
        logp = token_logprobs(logits, mb.input_ids, temperature)
        proximal = logp.detach() if proximal is None else proximal.to(logp.device)
        entropy = token_entropy(logits, temperature) if rl.loss.entropy_coef else None
        if entropy is None and rl.guard.watches_entropy:  # the metric alone: no grad
            entropy = entropy_for_the_guard(logits, mb.loss_mask, temperature)
        loss_sum, metrics = ppo_loss(
            logp,
            proximal,
            f["behavior"],
            f["advantages"],
            mb.loss_mask,
            rl.loss,
            ref_logprobs=f.get("reference"),
            entropy=entropy,
            sequence_ids=mb.sequence_ids,
        )
        return loss_sum, metrics, proximal

    return loss_fn


def policy_updates(
    core: TrainerCore,
    micro: list[MicroBatch],
    loss_fn: PolicyLoss,
    epochs: int,
    proximal: list[torch.Tensor] | None = None,
) -> StepStats:
    """``epochs`` optimizer updates of the policy, each over the whole batch (PPO's
    epochs, GRPO's μ), every one against the proximal policy of the step's start. The
    caller advances the step (the version), once per batch.

    ``proximal``: one ``[rows, T]`` per micro-batch, from a separate pass; None: the first
    update's forward, detached, gives them (its weights are the starting ones) and the
    later updates get those: the same as a separate pass, a forward cheaper (a test
    checks both). Returns the first update's loss, gradient norm and metrics (the
    quantities of a single update) and, as ``outputs``, the proximal logprobs used; with
    more updates, the last one's clip fraction and proximal KL as
    ``train/last_update_*`` (how far the later updates moved); the time of all.
    """
    inputs: list[Any] = [None] * len(micro) if proximal is None else proximal
    first = core.train_step(micro, loss_fn, loss_inputs=inputs)
    assert len(first.outputs) == len(micro), "a micro-batch without its proximal logprobs"
    stats = [first]
    stats += [core.train_step(micro, loss_fn, loss_inputs=first.outputs) for _ in range(epochs - 1)]
    last = stats[-1]
    metrics = dict(first.metrics)
    if epochs > 1:
        for key in ("clip_fraction", "approx_kl_proximal"):
            if f"train/{key}" in last.metrics:
                metrics[f"train/last_update_{key}"] = last.metrics[f"train/{key}"]
    seconds = sum(s.seconds for s in stats)
    skipped = all(s.skipped for s in stats)
    return replace(first, seconds=seconds, skipped=skipped, metrics=metrics)


def frozen_policy_stats(core: TrainerCore, micro: list[MicroBatch]) -> StepStats:
    """The stats of a step in which the policy keeps its weights (the critic's warmup):
    no forward, no optimizer step; the batch's tokens still count."""
    tokens = all_reduce_sum([float(sum(mb.num_tokens for mb in micro))], core.info.device)[0]
    lr = core.scheduler.get_last_lr()[0]
    return StepStats(
        loss=0.0, grad_norm=0.0, lr=lr, tokens=int(tokens), seconds=0.0, skipped=False, metrics={}
    )


def mismatch_scalars(
    micro: list[MicroBatch], proximal: list[torch.Tensor], version: int, device: torch.device
) -> dict[str, float]:
    """The train–inference mismatch of the step's batch, every rank's share: over the loss
    tokens sampled with weights ``version`` (the proximal policy's, the step's start),
    whose behavior and proximal logprobs differ only by how the engine and the trainer
    compute them. ``mismatch/abs_logprob_diff_mean`` and ``_max`` (|behavior − proximal|),
    ``mismatch/kl`` (KL(behavior ‖ proximal), k3 over the sampled tokens, ≥ 0) and
    ``mismatch/tokens``; with no such token, ``mismatch/tokens`` 0 alone.

    ``proximal``: one ``[rows, T]`` per micro-batch (``StepStats.outputs``). Every rank
    calls it, also one with no micro-batch: a sum and a max collective.
    """
    abs_sum = kl_sum = count = top = 0.0
    for mb, prox in zip(micro, proximal, strict=True):
        if "versions" not in mb.fields:  # sequences built without versions: nothing to match
            continue
        counted = (mb.loss_mask > 0) & (mb.fields["versions"] == version)
        behavior = mb.fields["behavior"][counted].double()
        prox = prox.detach().cpu()[counted].double()
        diff = (behavior - prox).abs()
        abs_sum += diff.sum().item()
        kl_sum += kl_estimate(behavior, prox, "k3").sum().item()
        count += diff.numel()
        top = max(top, diff.max().item()) if diff.numel() else top
    abs_sum, kl_sum, count = all_reduce_sum([abs_sum, kl_sum, count], device)
    top = all_reduce_max(top, device)
    if not count:
        return {"mismatch/tokens": 0.0}
    return {
        "mismatch/abs_logprob_diff_mean": abs_sum / count,
        "mismatch/abs_logprob_diff_max": top,
        "mismatch/kl": kl_sum / count,
        "mismatch/tokens": count,
    }
