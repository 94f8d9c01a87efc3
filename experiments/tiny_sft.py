"""SFT of the tiny Qwen2 model (1M parameters, char tokenizer) on reasoning-gym's
basic_arithmetic restricted to two-term addition of numbers up to 100: short prompts
that a tiny model learns on two CPU cores in a few minutes, evaluated on held-out
problems (none of the eval prompts occurs in train), and leaving accuracy for RL to add.
The exported HF checkpoint at ``runs/models/tiny-sft`` is where the RL experiments start.
"""

from asyncrl.evaluation import EvalConfig
from asyncrl.models import ModelConfig
from asyncrl.stages.sft import SFTConfig, SFTExperiment
from asyncrl.tasks import TaskConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig

ADDITION = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
}

config = SFTExperiment(
    name="tiny_sft",
    model=ModelConfig(path="runs/models/tiny-qwen2", make_if_missing=True),
    task=TaskConfig(dataset="basic_arithmetic", dataset_kwargs=ADDITION),
    trainer=TrainerConfig(num_ranks=1, micro_batch_tokens=4096, row_tokens=256),
    # 1e-3: higher rates (3e-3, 5e-3) never learned the task on 2 cores.
    optim=OptimConfig(lr=1e-3, warmup_steps=20, min_lr_ratio=0.05),
    # Stopped early on purpose: SFT should leave accuracy for RL to add.
    sft=SFTConfig(batch_size=64, max_steps=400, export_dir="runs/models/tiny-sft"),
    eval=EvalConfig(every_steps=100, num_examples=200),
)
