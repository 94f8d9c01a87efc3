"""SFT of the tiny Qwen2 model on reasoning-gym's basic_arithmetic (two terms, + and −,
up to two digits): short prompts a 1M-parameter model can learn on two CPU cores in a
few minutes, while leaving accuracy for RL to add. The exported HF checkpoint at
``runs/models/tiny-sft`` is where the RL experiments start.
"""

from asyncrl.models import ModelConfig
from asyncrl.stages.sft import SFTConfig, SFTExperiment
from asyncrl.trainer.config import OptimConfig, TrainerConfig

config = SFTExperiment(
    name="tiny_sft",
    model=ModelConfig(path="runs/models/tiny-qwen2", make_if_missing=True),
    trainer=TrainerConfig(num_ranks=1, micro_batch_tokens=4096),
    optim=OptimConfig(lr=3e-3, warmup_steps=20, min_lr_ratio=0.05),
    sft=SFTConfig(batch_size=64, max_steps=600, export_dir="runs/models/tiny-sft"),
)
