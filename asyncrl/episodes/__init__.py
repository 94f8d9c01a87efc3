"""Multi-turn episodes (``task.environment``): a sample is an episode of model turns and
an environment's observations, one token sequence trained with a loss mask.

- ``env``: the interface a task implements (``Environment``, ``Step``), replayable, with
  tools under timeouts.
- ``episode``: one episode as token ids (``Episode``): turns kept as sampled, observations
  rendered onto token ids after them, replay from a recorded prefix.
- ``driver``: the generator's side (``EpisodeDriver``): episodes on its engine, turns
  streamed to the buffer as they finish, environments in a thread pool.
- ``evaluate``: greedy held-out episodes (``episode_accuracy``).
"""

from asyncrl.episodes.env import Environment, Step, load_environment

__all__ = ["Environment", "Step", "load_environment"]
