"""Config dataclasses of the trainer core: placement, packing, checkpoints, optimizer."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Literal

from asyncrl.config import ConfigError


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate schedule after warmup."""
    warmup_steps: int = 10
    """Linear warmup from 0 to ``lr`` over this many optimizer steps."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine schedule as a fraction of ``lr``."""
    head_lr: float = 0.0
    """Peak learning rate of a scalar head (``model.head = "value"``: the reward model's
    and the critic's ``score``); 0 means ``lr``. The head starts at zero, and at a
    backbone's fine-tuning rate it barely moves in a few hundred steps."""
    total_steps: int = 0
    """Steps the schedule spans; 0 means the stage's ``max_steps`` (set in ``finalize``)."""


@dataclass
class TrainerConfig:
    num_ranks: int = 1
    """Trainer processes (FSDP2 ranks) on this machine."""
    threads_per_rank: int = 0
    """torch intra-op threads per rank; 0 means the machine's cores divided among ranks."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer computes; auto picks CUDA when available."""
    micro_batch_tokens: int = 2048
    """Token budget of one micro-batch (rows × row width)."""
    row_tokens: int = 256
    """Capacity of one packed row (first-fit decreasing). Attention cost grows with the
    square of a row, so a few times the typical sequence is right; longer sequences get a
    row of their own."""
    packing: Literal["packed", "padded"] = "packed"
    """``packed`` concatenates sequences with restarting position ids; ``padded`` pads rows
    to the longest sequence (kept as a baseline for benchmarks and equivalence tests)."""
    share_prefix: bool = False
    """RL (GRPO, RLOO): lay out each group's samples as one tree over their common prompt,
    which is then computed once instead of n times (packed only; not with PPO's critic).
    Same loss and gradients as the flat layout; a test checks it."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (0: all). Resuming skips one that fails its
    manifest check (a crash or disk error), so with 2 or more a damaged newest one falls
    back to the previous."""
    resume: bool = True
    """Resume from the newest checkpoint in the run directory when there is one."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input from the forward and recompute the layer in
    the backward: activation memory drops to about one layer's, for one more forward of
    the layers. Same loss and gradients (a test checks it). The logits and the loss over
    them are not recomputed; ``micro_batch_tokens`` bounds those."""
    reduce_every_micro_batch: bool = True
    """Reduce-scatter the gradients after every micro-batch (FSDP2's own default), so that
    between micro-batches each rank holds its gradient shard. False reduce-scatters after
    the step's last micro-batch only: one collective a step instead of one a micro-batch,
    for the whole model's unsharded gradient on every rank meanwhile (FSDP2 keeps it while
    sync is off). Measured on Qwen2.5-0.5B's shape, 2 CPU ranks of 2 micro-batches: False
    raises the peak per rank 0.5 GB. Same gradients up to summation order."""
    malloc_mmap_threshold: int = 0
    """Bytes above which glibc's allocator maps each allocation on its own (and unmaps it
    when freed) in the trainer ranks; 0 leaves glibc's threshold, which rises to 32 MB as
    large tensors are freed, after which freed tensors' memory stays in the heap. Measured
    on Qwen2.5-0.5B's shape, 2 CPU ranks: 131072 (128 KiB) lowers the peak per rank 2-3 GB
    (to the tensors' own); glibc only."""
    cpu_offload: bool = False
    """Keep parameter shards, gradients and the optimizer step in CPU memory between uses
    (FSDP2's ``CPUOffloadPolicy``): accelerator memory for time on a GPU. A CPU trainer
    refuses it with an error, since its memory is the CPU's already."""
    max_nonfinite_steps: int = 5
    """Stop the run after this many consecutive optimizer updates with a NaN/inf loss or
    gradient (with ``rl.update_epochs`` = N, a batch takes N updates)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ConfigError`` for a value that cannot work (again after overrides)."""
        if not 0 <= self.malloc_mmap_threshold <= 32 << 20:  # glibc's most on 64 bits
            raise ConfigError(
                f"trainer.malloc_mmap_threshold must be 0 or a byte count up to 32 MiB, got "
                f"{self.malloc_mmap_threshold}"
            )
        if self.malloc_mmap_threshold and platform.libc_ver()[0] != "glibc":
            raise ConfigError(
                "trainer.malloc_mmap_threshold sets glibc's allocator: not glibc here"
            )
