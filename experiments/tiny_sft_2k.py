"""The reward model's backbone: tiny_sft's run trained five times longer (2,000 steps, the
cosine schedule stretched to match), about 7 minutes on 2 cores.

A reward model judges answers only as well as its backbone knows them: on tiny_sft's
backbone the scalar head never learned to verify; on this one it does (docs/results.md).
The RL policy still starts from tiny_sft; a reward model larger or better trained than
its policy is the usual setup.
"""

from dataclasses import replace
from pathlib import Path

from asyncrl.config import load_experiment

sft = load_experiment(Path(__file__).with_name("tiny_sft.py"))

config = replace(
    sft,
    name="tiny_sft_2k",
    sft=replace(sft.sft, max_steps=2000, export_dir="runs/models/tiny-sft-2k"),
    eval=replace(sft.eval, every_steps=250),
)
