"""The image reward model: a scorer of (picture, prompt) trained on pairs of the image SFT
policy's own pictures ranked by the judge (made on first use under
``runs/data/image-pairs``, from ``runs/models/image-sft``, which is made first if
missing). It is measured by how often it ranks held-out scenes' pairs as the judge does.

Why these values: four pictures per prompt, so that most prompts give a pair whose
pictures the judge tells apart; 2048 training prompts, which two cores draw in a few
minutes. The word reader (each word matched against every place of the picture), since
held-out scenes are new compositions of known words: a reader that takes the prompt whole
learns the 1,800 pairs by heart (95% on them, 52% on held-out ones), and the policy's own
transformer as the reader reaches 63%. The same pictures judged again against their scene
or one a word away (20,000 pairs more), so that the scorer sees one picture preferred under
one prompt and not under the next; pairs mirrored at random as well. 3,000 steps, where
the held-out accuracy levels off; the scorer is small, so the learning rate is
pretraining's.
"""

from asyncrl.image.scorer import ScorerConfig
from asyncrl.stages.image_pairs import ImagePairsConfig
from asyncrl.stages.image_rm import ImageRMExperiment
from asyncrl.trainer.config import OptimConfig

config = ImageRMExperiment(
    name="image_rm",
    scorer=ScorerConfig(reader="words", channels=32, text_dim=32, hidden=256),
    pairs=ImagePairsConfig(train_prompts=2048, held_out_prompts=256, per_prompt=4, rejudged=20_000),
    batch_size=64,
    max_steps=3000,
    eval_every=250,
    mirror=True,
    optim=OptimConfig(lr=1e-3, weight_decay=0.01, warmup_steps=20),
    export_dir="runs/models/image-rm",
)
