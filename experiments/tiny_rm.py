"""A reward model for the tiny addition task: a scalar head on a backbone that knows the
task (tiny_sft_2k, 92.5% held-out greedy accuracy), trained with Bradley–Terry on pairs
of the RL policy's own samples: a correct completion (chosen) against an incorrect one
(rejected) by the task's verifier.

The pairs are sampled from the tiny_sft policy, the one RL starts from and whose samples
the reward model will score, when ``runs/data/tiny-prefs`` is missing (8 samples at T = 1
on each of the task's unseen problems, i.e. in neither SFT's train split nor the held-out
eval split; eval pairs from the eval split). The launcher runs tiny_sft_2k, and tiny_sft
for the pairs, first when their outputs are missing. The model is exported to
``runs/models/tiny-rm``, where PPO on the learned reward (tiny_chain) reads it.
"""

from pathlib import Path

from asyncrl.config import load_experiment
from asyncrl.evaluation import EvalConfig
from asyncrl.models import ModelConfig
from asyncrl.stages.preference_data import PreferenceDataConfig
from asyncrl.stages.reward_model import RewardModelExperiment
from asyncrl.trainer.config import OptimConfig, TrainerConfig

HERE = Path(__file__).parent
SFT_FILE, BACKBONE_FILE = HERE / "tiny_sft.py", HERE / "tiny_sft_2k.py"
sft, backbone = load_experiment(SFT_FILE), load_experiment(BACKBONE_FILE)

config = RewardModelExperiment(
    name="tiny_rm",
    init_from_experiment=str(BACKBONE_FILE),
    model=ModelConfig(path=backbone.sft.export_dir),
    task=sft.task,
    # 16 samples a prompt, and each prompt's right answer against up to 4 distinct wrong
    # ones: more pairs than the head can memorize (on DPO's smaller set it overfitted).
    data=PreferenceDataConfig(
        train_path="runs/data/tiny-prefs-all/train.jsonl",
        eval_path="runs/data/tiny-prefs-all/eval.jsonl",
        policy=sft.sft.export_dir,
        policy_experiment=str(SFT_FILE),
        prompt_split="unseen",
        samples_per_prompt=16,
        max_pairs_per_prompt=4,
        train_pairing="all",
    ),
    trainer=TrainerConfig(num_ranks=1, threads_per_rank=2, micro_batch_tokens=4096),
    # The zero-initialised head learns at head_lr: at the backbone's 1e-4 it barely moves.
    # A constant rate, β2 0.999 and no clipping held out far better than the stage
    # defaults (warmup, cosine decay, β2 0.95, gradients clipped to 1).
    optim=OptimConfig(
        lr=1e-4, head_lr=1e-2, beta2=0.999, max_grad_norm=0.0, warmup_steps=0, schedule="constant"
    ),
    batch_size=64,
    max_steps=600,
    eval=EvalConfig(every_steps=50),
    export_dir="runs/models/tiny-rm",
)
