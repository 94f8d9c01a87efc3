"""The image reward model: a 0.4 M-parameter picture scorer trained on pairs of the image
SFT policy's own pictures, ranked by the judge (made on first use under
``runs/data/image-pairs``, from ``runs/models/image-sft``, which is made first if
missing). It is measured by how often it ranks held-out scenes' pairs as the judge does.

Why these values: four pictures per prompt, so that most prompts give a pair whose
pictures the judge tells apart; 2048 training prompts, which two cores draw in a few
minutes; weight decay, since a scorer this size can learn the pairs by heart.
"""

from asyncrl.image.scorer import ScorerConfig
from asyncrl.stages.image_pairs import ImagePairsConfig
from asyncrl.stages.image_rm import ImageRMExperiment
from asyncrl.trainer.config import OptimConfig

config = ImageRMExperiment(
    name="image_rm",
    scorer=ScorerConfig(channels=32, text_dim=32, hidden=256),
    pairs=ImagePairsConfig(train_prompts=2048, held_out_prompts=256, per_prompt=4),
    batch_size=64,
    max_steps=600,
    eval_every=100,
    optim=OptimConfig(lr=1e-3, weight_decay=0.01, warmup_steps=20),
    export_dir="runs/models/image-rm",
)
