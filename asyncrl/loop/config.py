"""The RL loop's own settings, ``RLConfig``: the advantage estimator, the loss, updates per
batch, the critic, the guard and reward normalization. The loop's parts read their section
of it; the whole experiment (``RLExperiment``, with the model, task, trainer, buffer and
engine) is the stage's (``asyncrl.stages.rl_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncrl.algorithms.losses import PPOLossConfig
from asyncrl.loop.critic import CriticConfig
from asyncrl.loop.monitor import GuardConfig


@dataclass
class RLConfig:
    algorithm: Literal["grpo", "dr_grpo", "rloo", "ppo"] = "grpo"
    """Advantage estimator: GRPO, Dr.GRPO (no std scaling), RLOO, or PPO with a critic
    (GAE over token values, see ``critic``)."""
    max_steps: int = 100
    """Steps of the run: batches, each published as a version (with ``update_epochs`` > 1
    a step takes several optimizer updates)."""
    overlong_cache: int = 0
    """DAPO overlong shaping over this many tokens before ``max_new_tokens`` (0: off)."""
    overlong_filter: bool = False
    """DAPO overlong filtering: a truncated sample (finish reason ``length``, it reached
    ``max_new_tokens``) gets loss mask 0 on its completion, so it adds nothing to the loss
    nor to the token count the loss is averaged over. Its reward still counts in its
    group's baseline: only its own loss terms go (with PPO, its value loss too). Logged
    as ``train/overlong_filtered_samples`` and ``_tokens``."""
    export_dir: str = ""
    """Write the final policy as an HF directory here; empty means ``RUN_DIR/hf``."""
    loss: PPOLossConfig = field(default_factory=PPOLossConfig)
    """The decoupled-PPO loss: clipping, importance-sampling correction, KL and entropy terms."""
    proximal_pass: bool = False
    """Compute the proximal logprobs in a separate no-grad forward before the step. Off,
    they are the step's own forward's logprobs, detached: with one update per batch both
    forwards see the same weights and give the same values (a test checks loss and
    gradients), and the separate pass only costs a forward over the batch. With
    ``update_epochs > 1`` the first update's are kept for the later ones."""
    update_epochs: int = 1
    """Optimizer updates per batch, each over the whole batch (PPO's epochs, GRPO's μ),
    all against the proximal policy of the step's start; the version still advances once
    per batch. The learning-rate schedule counts updates (``optim.total_steps`` defaults
    to ``max_steps × update_epochs``)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model, GAE and the value loss; used when ``algorithm`` is ``ppo``."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The collapse guard: entropy, reward, gradient norm, clip fraction and importance
    weight against their running levels; warn, skip the update or roll back
    (``asyncrl.loop.guard``)."""
    reward_norm: Literal["none", "running"] = "none"
    """``running``: rewards become (r − mean) / std with a moving mean and std of the
    run's rewards (``asyncrl.loop.reward_norm``), before advantages, for reward scales
    that drift (a reward model's). GRPO's per-group z-score makes it a no-op there; it
    rescales RLOO's, Dr.GRPO's and PPO's advantages. Off by default: a verifier's 0/1
    reward has a fixed scale."""
    reward_norm_decay: float = 0.9
    """Per-step decay of that moving mean and variance (each step's batch moments in
    turn): about the last 10 batches, so a drifting scale is followed within as many."""
