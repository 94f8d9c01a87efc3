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
from asyncrl.stages.critic import CriticConfig
from asyncrl.trainer.config import OptimConfig

grpo = load_experiment(Path(__file__).with_name("tiny_grpo.py"))

config = replace(
    grpo,
    name="tiny_ppo",
    rl=replace(
        grpo.rl,
        algorithm="ppo",
        update_epochs=1,  # one policy update per batch, as tiny_chain's figures were measured
        # The NLL term on positive-advantage tokens, as in tiny_grpo. On tiny_rm's score
        # (tiny_chain), 300 s: without it and without the critic warmup the policy fell
        # to 0% by step 60 (an older, chance-level reward model); with α = 2, to 27.5% at
        # step 20 and 28-34% after; with α = 2 and the warmup, it held 40.5% through step
        # 20, then fell to 25-34%. On the verifier, before both: 31-46%, 36% at 10 min.
        loss=PPOLossConfig(clip_low=0.2, clip_high=0.2, positive_nll_coef=2.0),
        # The zero head has to reach the value scale first. Measured over 12 steps: at lr
        # 1e-4 the mean value was 0.08 against mean returns of 0.5; at 1e-3 it met them by
        # step 6 (and the policy is not touched by the critic's rate).
        critic=CriticConfig(
            gamma=1.0,
            lam=0.95,
            value_clip=0.2,
            # Without it, PPO on tiny_rm's score fell from 40.5% to 27.5% in its first 20
            # steps while the critic's values were still far from the returns.
            warmup_steps=20,
            optim=OptimConfig(lr=1e-3, warmup_steps=5, schedule="constant"),
        ),
    ),
    # The policy's rate stays tiny_grpo's earlier constant 1e-4, the one tiny_chain's
    # figures were measured with (tiny_grpo's cosine from 2e-4 was measured on GRPO only).
    optim=OptimConfig(lr=1e-4, warmup_steps=20, schedule="constant"),
    buffer=replace(grpo.buffer, dynamic_sampling=False),
    # The critic's GAE reads flat rows, so no shared prompts; and one generator, the
    # placement tiny_chain's figures were measured with.
    trainer=replace(grpo.trainer, share_prefix=False),
    num_generators=1,
)
