"""The RL loop's parts: what ``asyncrl.stages.rl`` calls, step by step, between the
batch it takes and the version it publishes. Each part reads its own section of the
experiment (``RLConfig`` in ``config``, the trainer's or the rollout's config), never the
whole of it.

- ``batch``: a buffer batch to sequences, micro-batches, proximal and reference logprobs,
  the decoupled-PPO loss and the update(s); the batch's length and mismatch figures.
- ``advantages``: where the advantages come from (group-relative, or the ``critic``'s GAE).
- ``reward_norm``: running reward normalization, before the advantages.
- ``guard`` (its statistics in ``monitor``): the collapse guard, warn, skip or roll back.
- ``colocated``: the colocated placement's in-process buffer and engine, a batch source
  and weight publisher in one.
- ``recorded``: a finished run's batches from its write-ahead log, the replay's source.
"""
