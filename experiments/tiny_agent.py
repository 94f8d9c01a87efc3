"""Asynchronous GRPO on the calculator agent task (``asyncrl.envs.calculator``), starting
from the tiny_agent_sft checkpoint (the launcher runs experiments/tiny_agent_sft.py first
when it is missing), with greedy held-out episodes evaluated every 10 steps.

Each sample is an episode: the model calls ``calc``, the environment answers with the
result, the model answers; a model turn is one line (sampling stops at "\\n"), and only
the model's turns are trained. RL prompts are ``rl.jsonl``: problems in neither the SFT
demonstrations nor the held-out eval.

tiny_grpo's DAPO settings (clip-higher, dynamic sampling, token-level loss, RPO's NLL
term on positive samples) and placement (one generator thread, one trainer thread).
Measured figures: docs/results.md.
"""

from dataclasses import replace
from pathlib import Path

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.config import load_experiment
from asyncrl.engine.config import EngineConfig, RemoteEngineConfig
from asyncrl.engine.embedded import EmbeddedEngineConfig
from asyncrl.engine.leases import SamplingConfig
from asyncrl.envs.calculator import STOP
from asyncrl.evaluation import EvalConfig
from asyncrl.models import ModelConfig
from asyncrl.stages.rl import RLExperiment
from asyncrl.trainer.config import TrainerConfig

SFT_FILE = Path(__file__).with_name("tiny_agent_sft.py")
sft = load_experiment(SFT_FILE)  # also writes the data files when they are missing
grpo = load_experiment(Path(__file__).with_name("tiny_grpo.py"))  # its RL settings
RL_PATH = str(Path(sft.task.train_path).with_name("rl.jsonl"))
TURN_TOKENS = sft.eval.max_new_tokens
# Prompts are at most 7 tokens ("999*99\n"); a slot holds one and a whole episode.
MAX_SEQ_LEN = 8 + sft.task.max_episode_tokens

config = RLExperiment(
    name="tiny_agent",
    init_from_experiment=str(SFT_FILE),
    model=ModelConfig(path=sft.sft.export_dir),
    task=replace(sft.task, train_path=RL_PATH),
    num_generators=1,
    # No shared prefix: the prompt is 7 of an episode's ~40 tokens, little to save.
    trainer=TrainerConfig(
        num_ranks=1, threads_per_rank=1, micro_batch_tokens=4096, checkpoint_every=50
    ),
    # tiny_grpo's rate and cosine decay over what 10 minutes make: about 100 updates at
    # the start's ~5 s a step (steps slow down as dynamic sampling drops solved groups).
    optim=replace(grpo.optim, total_steps=200),
    rl=grpo.rl,
    # 8 samples a prompt, not tiny_grpo's 4: at an SFT start of 20-50% success, more
    # groups hold both a success and a failure (the ones dynamic sampling keeps), for the
    # same 256 episodes a batch.
    buffer=BufferConfig(
        prompts_per_batch=32, samples_per_prompt=8, max_staleness=2, dynamic_sampling=True
    ),
    # T = 0.7 goes with the NLL term, as in tiny_grpo: samples close to the greedy policy
    # that is evaluated. A turn budget of a line; the episode budget is the task's.
    sampling=SamplingConfig(max_new_tokens=TURN_TOKENS, temperature=0.7, stop=[STOP]),
    # The environment gives the reward: no verifier runs in the pool.
    reward=RewardConfig(workers=0),
    engine=EngineConfig(
        embedded=EmbeddedEngineConfig(max_slots=64, max_seq_len=MAX_SEQ_LEN, threads=1),
        remote=RemoteEngineConfig(max_seq_len=MAX_SEQ_LEN, threads=1),
    ),
    eval=EvalConfig(every_steps=10, num_examples=200, max_new_tokens=TURN_TOKENS, stop=[STOP]),
    time_limit_s=600.0,
)
