"""Asynchronous PPO with a critic on the tiny model: tiny_grpo's run (start from the
tiny_sft checkpoint, unseen prompts, 64 prompts × 4 samples, lr 1e-4, placement for 2
cores, greedy held-out evaluation every 10 steps) with a critic in place of groups.

The critic is the SFT model's backbone under a zero value head, trained by a second FSDP2
core on the trainer rank; advantages are GAE (γ = 1, λ = 0.95) on the reward of each
completion's last token, whitened over the batch. No group is dropped (a critic needs no
group baseline, so dynamic sampling is off) and the clip range is symmetric.
"""

from dataclasses import replace
from pathlib import Path

from asyncrl.algorithms.losses import PPOLossConfig
from asyncrl.config import load_experiment
from asyncrl.loop.critic import CriticConfig
from asyncrl.trainer.config import OptimConfig

grpo = load_experiment(Path(__file__).with_name("tiny_grpo.py"))

config = replace(
    grpo,
    name="tiny_ppo",
    rl=replace(
        grpo.rl,
        algorithm="ppo",
        update_epochs=1,  # one policy update per batch, as tiny_chain's figures were measured
        # The NLL term on positive-advantage tokens, as in tiny_grpo: on a learned reward
        # it slows the policy's slide toward what the reward model gets wrong.
        loss=PPOLossConfig(clip_low=0.2, clip_high=0.2, positive_nll_coef=2.0),
        # The zero value head has to reach the returns' scale quickly: at lr 1e-4 it had
        # barely moved after 12 steps, at 1e-3 it met them by step 6 (the policy's rate is
        # its own).
        critic=CriticConfig(
            gamma=1.0,
            lam=0.95,
            value_clip=0.2,
            # The policy waits while the critic's values are still far from the returns:
            # updates on those advantages pulled it down in its first 20 steps.
            warmup_steps=20,
            optim=OptimConfig(lr=1e-3, warmup_steps=5, schedule="constant"),
        ),
    ),
    # A constant 1e-4, the rate tiny_chain's figures were measured with (tiny_grpo's
    # cosine from 2e-4 was measured on GRPO only).
    optim=OptimConfig(lr=1e-4, warmup_steps=20, schedule="constant"),
    buffer=replace(grpo.buffer, dynamic_sampling=False),
    # The critic's GAE reads flat rows, so no shared prompts; and one generator, the
    # placement tiny_chain's figures were measured with.
    trainer=replace(grpo.trainer, share_prefix=False),
    num_generators=1,
)
