"""Flow-matching pretraining of the image policy (2.3 M parameters, 32 × 32 pixels) on
procedurally rendered scenes: counts, colours, shapes and positions, judged on held-out
scenes never trained on. Stopped early on purpose: SFT should leave room for DPO and RL.
The exported policy at ``runs/models/image-sft`` is where the image chain's later stages
start.
"""

from asyncrl.image.model import ImageModelConfig
from asyncrl.stages.image_sft import ImageEvalConfig, ImageSFTConfig, ImageSFTExperiment
from asyncrl.trainer.config import OptimConfig

config = ImageSFTExperiment(
    name="image_sft",
    model=ImageModelConfig(),
    optim=OptimConfig(lr=1e-3, warmup_steps=20, min_lr_ratio=0.1, beta2=0.99),
    sft=ImageSFTConfig(batch_size=32, max_steps=600, export_dir="runs/models/image-sft"),
    eval=ImageEvalConfig(every_steps=100, num_scenes=64),
    time_limit_s=600,
)
