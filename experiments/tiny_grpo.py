"""Asynchronous GRPO/DAPO on the tiny model, starting from the tiny_sft checkpoint (the
launcher runs experiments/tiny_sft.py first when it is missing), on the same held-out
addition task, with greedy held-out evaluation every 10 steps.

RL prompts are the task's "unseen" split: problems in neither SFT's train split nor the
held-out eval. The SFT model partly memorized its train problems, and RL on those
transferred less to held-out problems.

DAPO as configuration: clip-higher (ε_high 0.28), dynamic sampling (groups whose
samples all got the same reward are dropped and more prompts leased), token-level loss
(the trainer core's global token mean), no overlong shaping (answers are short).
Placement for 2 cores: one generator thread and one trainer thread. The trainer computes
each group's prompt once (``trainer.share_prefix``): most of a flat batch's tokens are
the four samples' copies of one prompt. It spends the time that frees on a second update
of each batch (``rl.update_epochs=2``, against the same proximal policy), which learned
more in 10 minutes than giving the freed core to a second generator.

Measured figures and the variants behind these values: docs/results.md."""

from dataclasses import replace
from pathlib import Path

from asyncrl.algorithms.losses import PPOLossConfig
from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.config import load_experiment
from asyncrl.engine.config import EngineConfig, RemoteEngineConfig
from asyncrl.engine.embedded import EmbeddedEngineConfig
from asyncrl.engine.leases import SamplingConfig
from asyncrl.evaluation import EvalConfig
from asyncrl.models import ModelConfig
from asyncrl.stages.rl import RLConfig, RLExperiment
from asyncrl.trainer.config import OptimConfig, TrainerConfig

SFT_FILE = Path(__file__).with_name("tiny_sft.py")
sft = load_experiment(SFT_FILE)

config = RLExperiment(
    name="tiny_grpo",
    init_from_experiment=str(SFT_FILE),
    model=ModelConfig(path=sft.sft.export_dir),
    task=replace(sft.task, full_marks_only=True, rl_split="unseen"),
    num_generators=1,
    # A checkpoint every 50 steps (~80 s, ~0.2 s each): a trainer that dies redoes at most
    # that many steps, and the buffer keeps at most that many steps' batches to serve again.
    trainer=TrainerConfig(
        num_ranks=1,
        threads_per_rank=1,
        micro_batch_tokens=4096,
        checkpoint_every=50,
        share_prefix=True,
    ),
    # A batch's update noise decides the usable rate: 64 prompts of 4 samples take what 8
    # prompts a step could not. A cosine decay from 2e-4 beat a constant rate; the schedule
    # counts updates, and a 10-minute run makes about 390 steps of two, so it spans 900.
    optim=OptimConfig(lr=2e-4, warmup_steps=20, schedule="cosine", total_steps=900),
    # positive_nll_coef: RPO's NLL term on the tokens of positive-advantage samples; it
    # reaches a given held-out accuracy much sooner. α = 2 goes with sampling at T = 0.7
    # (more correct samples, closer to the greedy policy that is evaluated).
    rl=RLConfig(
        algorithm="grpo",
        max_steps=2000,
        update_epochs=2,
        loss=PPOLossConfig(clip_low=0.2, clip_high=0.28, positive_nll_coef=2.0),
    ),
    buffer=BufferConfig(
        prompts_per_batch=64, samples_per_prompt=4, max_staleness=2, dynamic_sampling=True
    ),
    sampling=SamplingConfig(max_new_tokens=8, temperature=0.7),
    reward=RewardConfig(workers=0),
    engine=EngineConfig(
        embedded=EmbeddedEngineConfig(
            max_slots=64, max_seq_len=64, threads=1, flip_policy="recompute"
        ),
        # The same context and threads for launched servers, with engine.backend=remote.
        remote=RemoteEngineConfig(max_seq_len=64, threads=1),
    ),
    eval=EvalConfig(every_steps=10, num_examples=200, max_new_tokens=8),
    time_limit_s=600.0,
)
