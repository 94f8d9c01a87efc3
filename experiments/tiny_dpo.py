"""DPO on the tiny addition task: the tiny_sft policy trained on pairs of its own samples
(correct against incorrect by the verifier, made when missing) against itself as the
frozen reference, with greedy held-out accuracy on the task as the figure. The loss is
DPO plus RPO's NLL term on the chosen completion. The launcher runs tiny_sft first when
its checkpoint is missing.
"""

from pathlib import Path

from asyncrl.algorithms.preference import DPOLossConfig
from asyncrl.config import load_experiment
from asyncrl.evaluation import EvalConfig
from asyncrl.models import ModelConfig
from asyncrl.stages.dpo import DPOExperiment
from asyncrl.stages.preference_data import PreferenceDataConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig

SFT_FILE = Path(__file__).with_name("tiny_sft.py")
sft = load_experiment(SFT_FILE)

config = DPOExperiment(
    name="tiny_dpo",
    init_from_experiment=str(SFT_FILE),
    model=ModelConfig(path=sft.sft.export_dir),
    task=sft.task,
    # The policy's own samples: 8 at T = 1 per unseen problem, each completion in one pair.
    data=PreferenceDataConfig(
        train_path="runs/data/tiny-prefs/train.jsonl",
        eval_path="runs/data/tiny-prefs/eval.jsonl",
        prompt_split="unseen",
        samples_per_prompt=8,
        max_pairs_per_prompt=2,
    ),
    # Plain DPO lowers both completions' likelihoods while widening their gap, and held-out
    # accuracy fell at 1e-4 and swung at 2e-5; RPO's NLL term on the chosen completion
    # (α = 1) at 5e-5 rose steadily (docs/results.md).
    loss=DPOLossConfig(beta=0.1, nll_coef=1.0),
    trainer=TrainerConfig(num_ranks=1, threads_per_rank=2, micro_batch_tokens=4096),
    optim=OptimConfig(lr=5e-5, warmup_steps=20, schedule="constant"),
    batch_size=64,
    max_steps=300,
    eval=EvalConfig(every_steps=25, num_examples=200, max_new_tokens=8),
    export_dir="runs/models/tiny-dpo",
)
