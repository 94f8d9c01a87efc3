"""The whole chain with one command: SFT → reward model → asynchronous PPO with a critic
on the learned reward.

    python launch/local.py experiments/tiny_chain.py

The launcher runs each missing stage first: tiny_sft when ``runs/models/tiny-sft`` is
missing, tiny_rm (which makes its preference pairs from the SFT policy when they are
missing) when ``runs/models/tiny-rm`` is missing; stages whose outputs exist are skipped.
The RL stage is tiny_ppo's run with the buffer scoring every completion with the reward
model (``reward.source="model"``: a batched forward in a thread of the buffer process)
instead of the verifier; held-out evaluation still uses the verifier, so it measures
whether optimizing the learned reward raised true accuracy.
"""

from dataclasses import replace
from pathlib import Path

from asyncrl.config import load_experiment

HERE = Path(__file__).parent
ppo = load_experiment(HERE / "tiny_ppo.py")
rm = load_experiment(HERE / "tiny_rm.py")

config = replace(
    ppo,
    name="tiny_chain",
    reward_model_experiment=str(HERE / "tiny_rm.py"),
    reward=replace(ppo.reward, source="model", model_path=rm.export_dir, model_batch_size=64),
)
