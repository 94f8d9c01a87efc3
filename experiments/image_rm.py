"""The image reward model: a head on the image SFT policy's transformer, trained on pairs
of that policy's own pictures ranked by the judge (made on first use under
``runs/data/image-pairs``, from ``runs/models/image-sft``, which is made first if
missing). It is measured by how often it ranks held-out scenes' pairs as the judge does.

Why these values: four pictures per prompt, so that most prompts give a pair whose
pictures the judge tells apart; 2048 training prompts, which two cores draw in a few
minutes; the policy's transformer as the reader, since it already ties the prompt's words
to pixels (a reader from scratch learns the 1,800 pairs by heart: 95% on them, 52% on
held-out ones); pairs mirrored at random, which makes up to four of each; the transformer
at a tenth of the new head's learning rate, so that fine-tuning keeps what it knows.
"""

from asyncrl.image.scorer import ScorerConfig
from asyncrl.stages.image_pairs import ImagePairsConfig
from asyncrl.stages.image_rm import ImageRMExperiment
from asyncrl.trainer.config import OptimConfig

config = ImageRMExperiment(
    name="image_rm",
    scorer=ScorerConfig(backbone="runs/models/image-sft", per_patch=8, hidden=256),
    pairs=ImagePairsConfig(train_prompts=2048, held_out_prompts=256, per_prompt=4),
    batch_size=64,
    max_steps=400,
    eval_every=50,
    mirror=True,
    optim=OptimConfig(lr=1e-4, head_lr=1e-3, weight_decay=0.01, warmup_steps=20),
    export_dir="runs/models/image-rm",
)
