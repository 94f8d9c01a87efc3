"""Asynchronous GRPO of your own model on your own GSM8K-shaped data, with the chat
template and the math reward, starting from ``experiments/gsm8k_sft.py``'s export (the
launcher runs that first when it is missing).

The reward is math-verify's check of the completion's final answer against the row's
(``task.rewards={"math": 1.0}``): ``#### 42``, ``\\boxed{42}`` and equivalent forms all
count. The engine's context is sized from the longest rendered prompt plus
``sampling.max_new_tokens`` before anything starts. DAPO's dynamic sampling drops groups
whose samples all scored the same, with a bound on how long a step waits for others.
For your own model and data, override ``model.path`` (or the SFT file's) and the task's
paths; README "Your own model and data" has the command line.
"""

from dataclasses import replace
from pathlib import Path

from asyncrl.algorithms.losses import PPOLossConfig
from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.config import load_experiment
from asyncrl.engine.leases import SamplingConfig
from asyncrl.models import ModelConfig
from asyncrl.stages.rl import RLConfig, RLExperiment
from asyncrl.trainer.config import OptimConfig, TrainerConfig

SFT_FILE = Path(__file__).with_name("gsm8k_sft.py")
sft = load_experiment(SFT_FILE)

config = RLExperiment(
    name="gsm8k_grpo",
    init_from_experiment=str(SFT_FILE),
    model=ModelConfig(path=sft.sft.export_dir),
    task=sft.task,
    trainer=TrainerConfig(num_ranks=1, micro_batch_tokens=4096, row_tokens=1024),
    optim=OptimConfig(lr=1e-6, warmup_steps=5),
    rl=RLConfig(algorithm="grpo", max_steps=200, loss=PPOLossConfig(clip_high=0.28)),
    buffer=BufferConfig(
        prompts_per_batch=16, samples_per_prompt=8, max_staleness=2, dynamic_sampling=True
    ),
    # Worked GSM8K solutions run 100–300 tokens; 512 leaves room, and truncation is counted.
    sampling=SamplingConfig(max_new_tokens=512, temperature=1.0),
    # math-verify in a worker process, under the pool's timeout.
    reward=RewardConfig(workers=1, timeout_s=10.0),
    eval=replace(sft.eval, every_steps=20, max_new_tokens=512),
    time_limit_s=0.0,
)
