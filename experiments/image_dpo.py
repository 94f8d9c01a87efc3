"""Diffusion-DPO on the image SFT policy (``runs/models/image-sft``, made first if
missing), on pairs of its own pictures ranked by the judge (the reward model's pairs,
``runs/data/image-pairs``), with the SFT policy frozen as the reference.

Why these values: β on the scale of per-dimension velocity errors, large enough that
the policy moves only where the pairs disagree with the reference; a learning rate a
tenth of pretraining's: at a hundredth, 300 steps moved the velocity errors a little and
the sampler's pictures not at all.
"""

from asyncrl.algorithms.preference import DPOLossConfig
from asyncrl.stages.image_dpo import ImageDPOExperiment
from asyncrl.stages.image_pairs import ImagePairsConfig
from asyncrl.stages.image_sft import ImageEvalConfig
from asyncrl.trainer.config import OptimConfig

config = ImageDPOExperiment(
    name="image_dpo",
    pairs=ImagePairsConfig(train_prompts=2048, held_out_prompts=256, per_prompt=4),
    loss=DPOLossConfig(beta=2000.0),
    batch_size=32,
    max_steps=300,
    optim=OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant"),
    eval=ImageEvalConfig(every_steps=50, num_scenes=64),
    time_limit_s=900,
)
