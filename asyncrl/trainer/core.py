"""The trainer core: an FSDP2-sharded model, AdamW, a schedule, and one optimizer step.

Every stage (SFT, reward model, DPO, RL) drives a ``TrainerCore``: it hands over
its rank's micro-batches and a loss function, and the core runs forward/backward with
gradient accumulation, normalizes by the *global* normalizer (summed over ranks) so the
update does not depend on packing or rank count, clips, and steps. ``fully_shard`` wraps
each decoder layer and then the root, on every run including a single rank. The model
is the causal LM, or with ``ModelConfig.head="value"`` the same backbone under a scalar
value head: PPO's critic is a second core on the same ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from transformers import PreTrainedModel

from asyncrl.interfaces import FullParameters
from asyncrl.models import ModelConfig, empty_model, load_model, restore_buffers
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.dist import DistInfo, all_reduce_max, all_reduce_sum
from asyncrl.trainer.finite import FiniteSteps
from asyncrl.trainer.packing import MicroBatch, dummy_micro_batch
from asyncrl.trainer.readout import ParameterReadout

LossFn = Callable[..., tuple]
"""``loss_fn(logits [rows, T, V], mb[, loss_input]) -> (loss_sum [], metric_sums[, output])``.

``loss_sum`` is the *sum* of per-token (or per-sequence) losses in this micro-batch; the
core divides by the global normalizer. Metric values are sums too, reduced the same way.
The core calls it once per micro-batch, in the order given, then on any empty ones that
even out the count over ranks. ``loss_input`` is passed only when ``train_step`` gets
``loss_inputs`` (this micro-batch's entry; None on the empty ones). ``output``, an
optional third return value (the proximal logprobs the policy loss used), comes back in
``StepStats.outputs``.
"""


def lr_lambda(cfg: OptimConfig) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine (or constant) down to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or cfg.total_steps <= cfg.warmup_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine

    return factor


def adamw(params, cfg: OptimConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` (parameters or parameter groups) as ``cfg`` sets it, and its
    schedule (``lr_lambda``)."""
    opt = torch.optim.AdamW(
        params, cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    """Tokens (all ranks) in this step's sequences."""
    seconds: float
    skipped: bool
    """The loss or gradient norm was NaN/inf, or ``TrainerCore.step_check`` refused the
    update: no optimizer or scheduler step was taken and the gradients were dropped."""
    metrics: dict[str, float]
    """Global metric sums divided by the normalizer."""
    outputs: list[Any] = field(default_factory=list)
    """The loss's third return value for each of this rank's micro-batches, in order
    (empty when the loss returns two)."""


def shard_model(
    model: PreTrainedModel, info: DistInfo, cfg: TrainerConfig | None = None
) -> PreTrainedModel:
    """``fully_shard`` each decoder layer, then the root; bf16 compute on CUDA. With
    ``cfg.activation_checkpointing`` each layer recomputes its forward in the backward
    (torch's composable ``checkpoint``: hooks, so parameter names do not change); with
    ``cfg.cpu_offload`` the shards live on the CPU."""
    cfg = cfg or TrainerConfig()
    kwargs: dict[str, Any] = {"mesh": info.mesh, "mp_policy": MixedPrecisionPolicy()}
    if info.device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if cfg.cpu_offload:
        if info.device.type != "cuda":
            raise ValueError(
                "trainer.cpu_offload keeps the shards in CPU memory between uses on an "
                "accelerator; the trainer runs on the CPU here, where it would change nothing"
            )
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layer_types = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_types:
            if cfg.activation_checkpointing:
                checkpoint(module)
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def sharded_model(
    model_cfg: ModelConfig, info: DistInfo, cfg: TrainerConfig | None = None
) -> PreTrainedModel:
    """``model_cfg``'s model, sharded, with only this rank's shards ever allocated: rank
    0 reads the weights (``load_model``, so a value head missing from the directory starts
    at zero as there) and sends each rank its shards; every rank builds the model on the
    meta device, shards it and allocates its shards. Its values equal ``load_model``'s."""
    full = load_model(model_cfg).state_dict() if info.is_main else {}
    model = shard_model(empty_model(model_cfg), info, cfg)
    # Offloaded shards live on the CPU: FSDP2 moves each layer's to the GPU for compute.
    model.to_empty(device="cpu" if cfg is not None and cfg.cpu_offload else info.device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    del full
    restore_buffers(model, info.device)
    return model


def micro_batch_logits(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """``model``'s logits ``[rows, T, V]`` of one micro-batch (packed, padded or with
    shared prefixes, realigned by ``MicroBatch.align_logits``); V = 1 for a value head."""
    out = model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        attention_mask=mb.attention_mask,
        use_cache=False,  # with no cache, packed position ids give a block-diagonal mask
    )
    return mb.align_logits(out.logits)


def frozen_model(model_cfg: ModelConfig, info: DistInfo) -> PreTrainedModel:
    """A sharded model without gradients (RL's KL reference): every rank holds its shards
    only, and every rank must run each forward together (FSDP gathers each layer)."""
    return sharded_model(model_cfg, info).requires_grad_(False)


def param_groups(
    model: torch.nn.Module,
    cfg: OptimConfig,
    is_head: Callable[[str], bool] = lambda name: name.startswith("score."),
) -> list[dict]:
    """AdamW's parameter groups: the head (by default the scalar head ``score``; the
    parameters whose names ``is_head`` picks) at ``head_lr`` when set, the rest at ``lr``."""
    if not cfg.head_lr:
        return [{"params": list(model.parameters())}]
    named = list(model.named_parameters())
    head = [p for name, p in named if is_head(name)]
    rest = [p for name, p in named if not is_head(name)]
    return [{"params": rest}, {"params": head, "lr": cfg.head_lr}] if head else [{"params": rest}]


class TrainerCore:
    def __init__(
        self,
        model_cfg: ModelConfig,
        trainer_cfg: TrainerConfig,
        optim_cfg: OptimConfig,
        info: DistInfo,
        pad_id: int,
    ) -> None:
        self.cfg, self.optim_cfg, self.info, self.pad_id = trainer_cfg, optim_cfg, info, pad_id
        self.model = sharded_model(model_cfg, info, trainer_cfg)
        self.model_cfg = model_cfg
        self.readout = ParameterReadout(self.model)
        self.optimizer, self.scheduler = adamw(param_groups(self.model, optim_cfg), optim_cfg)
        # The stage's step (in RL, the policy version): its loop advances it, a checkpoint
        # saves it; train_step leaves it alone.
        self.step = 0
        self.nonfinite = FiniteSteps(trainer_cfg.max_nonfinite_steps)
        # The stage's veto on an update, asked before each optimizer step with the step's
        # loss, gradient norm and metrics (as in StepStats); False refuses the update as a
        # non-finite one is refused, without counting as one (the RL guard's skip).
        self.step_check: Callable[[float, float, dict[str, float]], bool] | None = None

    def set_base_lrs(self, base_lrs: list[float]) -> None:
        """The schedule's base rate per parameter group, with the optimizer's rates set to
        the schedule's value at its current position."""
        scheduler = self.scheduler
        rates = [b * fn(scheduler.last_epoch) for b, fn in zip(base_lrs, scheduler.lr_lambdas)]
        state = scheduler.state_dict() | {"base_lrs": list(base_lrs), "_last_lr": rates}
        scheduler.load_state_dict(state)
        for group, base, rate in zip(self.optimizer.param_groups, base_lrs, rates):
            group["initial_lr"], group["lr"] = base, rate

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        """Logits ``[rows, T, V]`` of one micro-batch (packed, padded or with shared
        prefixes, realigned by ``MicroBatch.align_logits``); V = 1 for a value head."""
        return micro_batch_logits(self.model, mb)

    def align(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """Pad the list with empty micro-batches up to the largest count over ranks."""
        count = all_reduce_max(len(micro_batches), self.info.device)
        names = list(micro_batches[0].fields) if micro_batches else []
        extra = [dummy_micro_batch(self.pad_id, names) for _ in range(count - len(micro_batches))]
        return micro_batches + extra

    def train_step(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        local_normalizer: float | None = None,
        loss_inputs: Sequence[Any] | None = None,
    ) -> StepStats:
        """One optimizer update over this rank's micro-batches, or none when the loss or
        the gradient norm is not finite (``StepStats.skipped``). It advances no step
        counter: the stage's loop owns its step.

        ``local_normalizer`` defaults to this rank's loss-token count; the core sums it
        over ranks, and the loss is ``Σ_ranks Σ_micro loss_sum / Σ_ranks normalizer``.
        ``loss_inputs``, one per micro-batch, are ``loss_fn``'s third argument.
        """
        start = time.perf_counter()
        if local_normalizer is None:
            local_normalizer = float(sum(mb.loss_mask.sum().item() for mb in micro_batches))
        local_tokens = sum(mb.num_tokens for mb in micro_batches)
        normalizer, tokens = all_reduce_sum([local_normalizer, local_tokens], self.info.device)
        # FSDP averages gradients over ranks; multiplying by world size turns that
        # average into the sum that a global normalizer needs.
        scale = self.info.world_size / max(normalizer, 1.0)
        loss_total, metric_sums, outputs = self._backward(
            micro_batches, loss_fn, scale, loss_inputs
        )
        grad_norm = self._clip()
        keys = sorted(metric_sums)
        summed = all_reduce_sum(
            [loss_total.item(), *[metric_sums[k] for k in keys]], self.info.device
        )
        loss = summed[0] / max(normalizer, 1.0)
        lr = self.scheduler.get_last_lr()[0]
        metrics = {k: v / max(normalizer, 1.0) for k, v in zip(keys, summed[1:])}
        stepped = self._step_if_finite(loss, grad_norm, metrics)
        return StepStats(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens=int(tokens),
            seconds=time.perf_counter() - start,
            skipped=not stepped,
            metrics=metrics,
            outputs=outputs,
        )

    def _backward(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        scale: float,
        loss_inputs: Sequence[Any] | None,
    ) -> tuple[torch.Tensor, dict[str, float], list[Any]]:
        """Forward and backward (loss × ``scale``) of every micro-batch, and of the empty
        ones that even out the count over ranks; returns this rank's loss sum, metric
        sums and the loss's extra outputs of its own micro-batches."""
        batches = self.align(micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = torch.zeros((), dtype=torch.float64)
        metric_sums: dict[str, float] = {}
        outputs = []
        for i, mb in enumerate(batches):
            # Off: reduce-scatter once, after the last micro-batch (less traffic, more memory).
            last = i == len(batches) - 1
            self.model.set_requires_gradient_sync(last or self.cfg.reduce_every_micro_batch)
            mb = mb.to(self.info.device)
            own = i < len(micro_batches)
            args = () if loss_inputs is None else (loss_inputs[i] if own else None,)
            loss_sum, metrics, *output = loss_fn(self.forward(mb), mb, *args)
            (loss_sum * scale).backward()
            loss_total += loss_sum.detach().double().cpu()
            for k, v in metrics.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + float(v)
            if output and own:
                outputs.append(output[0])
        return loss_total, metric_sums, outputs

    @property
    def nonfinite_in_a_row(self) -> int:
        return self.nonfinite.in_a_row

    def _step_if_finite(self, loss: float, grad_norm: float, metrics: dict[str, float]) -> bool:
        """The optimizer and scheduler step when loss and gradient norm are finite and
        ``step_check`` (if any) accepts; else drop the gradients (``FiniteSteps`` raises
        after too many non-finite ones in a row)."""
        if not self.nonfinite.finite(loss, grad_norm, self.step) or (
            self.step_check is not None and not self.step_check(loss, grad_norm, metrics)
        ):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.readout.wait()  # a publish still reading the weights
        self.optimizer.step()
        self.scheduler.step()
        return True

    def _clip(self) -> float:
        max_norm = self.optim_cfg.max_grad_norm or float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded CPU state dict on rank 0 (empty elsewhere). Every rank must call it."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def full_parameters(self, version: int | None = None) -> FullParameters:
        """The parameters unsharded one at a time, for a weights publish that may read
        them on its own thread until the next optimizer step (``readout``)."""
        return self.readout.full_parameters("" if version is None else f"of v{version}")

    @property
    def fsdp_module(self) -> FSDPModule:
        return self.model  # type: ignore[return-value]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
