"""Asynchronous Flow-GRPO on the image policy image SFT exported (``runs/models/image-sft``,
made first if missing): SDE pictures of training scenes, judged on their pixels, raise
held-out success. One generator and one trainer share the two cores, a thread each.

Why these values: 10 SDE steps at noise level 0.7 (Flow-GRPO's) with SD3's shift; 4 of
each picture's 10 steps trained (Flow-GRPO trains a fraction); groups of 8 pictures per
prompt, so a group rarely scores all the same, starting from one noise, so that their
rewards compare the steps' actions rather than starts; η = 4, the staleness the
decoupled loss is meant to absorb; a constant learning rate a tenth of pretraining's,
since a policy gradient on a 3072-dimensional Gaussian step is noisy; a KL of 0.1 to the
start, because without one the policy drifts onto what the judge's partial credit pays
(one blob of each of two colours for every prompt), and at 1.0 it does not move.
"""

from asyncrl.algorithms.losses import PPOLossConfig
from asyncrl.buffer.config import BufferConfig
from asyncrl.engine.image import ImageSamplingConfig
from asyncrl.models import ModelConfig
from asyncrl.stages.image_grpo import FlowGRPOConfig, ImageGRPOExperiment
from asyncrl.stages.image_sft import ImageEvalConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig

config = ImageGRPOExperiment(
    name="image_grpo",
    model=ModelConfig(path="runs/models/image-sft"),
    image=ImageSamplingConfig(steps=10, shift=3.0, noise_level=0.7, shared_start=True),
    rl=FlowGRPOConfig(
        max_steps=400,
        train_steps=4,
        loss=PPOLossConfig(clip_low=1e-3, clip_high=1e-3, kl_coef=0.1),
    ),
    buffer=BufferConfig(prompts_per_batch=4, samples_per_prompt=8, max_staleness=4),
    optim=OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant"),
    trainer=TrainerConfig(threads_per_rank=1),
    eval=ImageEvalConfig(every_steps=20, num_scenes=64),
    time_limit_s=900,
)
