"""reasoning-gym adapter: procedural problems with verifiers, as a ``Task``.

Examples are generated on access from ``reasoning_gym`` datasets (item i of a dataset is a
pure function of its seed and i), so the train split costs nothing until read. The eval
split is drawn from a second seed and filtered so that no eval prompt occurs in train.
Scoring extracts the answer with ``answer_pattern`` and defers to the dataset's own
``score_answer``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import reasoning_gym

from asyncrl.tasks.base import (
    Example,
    Split,
    TaskConfig,
    check_common,
    clamp_reward,
    extract_answer,
)

log = logging.getLogger(__name__)

# Eval is deduplicated against train while the train prompts fit comfortably in memory and
# take seconds to generate (basic_arithmetic: ~15 us an item, 0.3 s for 20k items).
MAX_DEDUP_TRAIN_SIZE = 200_000
# Eval candidates tried per wanted eval example before giving up: when train covers most of
# a small problem space, few candidates are held out.
EVAL_CANDIDATES_PER_EXAMPLE = 50


class LazyExamples(Sequence[Example]):
    """Examples made on access from a sequence of dataset indices."""

    def __init__(self, indices: Sequence[int], make: Callable[[int], Example]) -> None:
        self._indices = indices
        self._make = make

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._make(j) for j in self._indices[i]]
        return self._make(self._indices[i])


class ReasoningGymTask:
    """A reasoning-gym dataset as a task; see the module docstring."""

    def __init__(self, config: TaskConfig) -> None:
        check_common(config)
        self.config = config
        self._eval_candidates = max(1, config.eval_size * EVAL_CANDIDATES_PER_EXAMPLE)
        _check_seeds(config, self._eval_candidates)
        self._train = _create_dataset(config, config.seed, config.train_size)
        self._eval_pool = _create_dataset(config, config.eval_seed, self._eval_candidates)
        self._eval_indices: list[int] | None = None
        self._warned_scorer_error = False

    def __reduce__(self) -> tuple[Any, ...]:
        # A reward worker rebuilds the task from its config rather than receiving datasets.
        return (type(self), (self.config,))

    @property
    def name(self) -> str:
        return f"reasoning_gym/{self.config.dataset}"

    def examples(self, split: Split) -> Sequence[Example]:
        if split == "train":
            return LazyExamples(range(self.config.train_size), self._train_example)
        if split == "eval":
            if self._eval_indices is None:
                self._eval_indices = self._held_out_indices()
            return LazyExamples(self._eval_indices, self._eval_example)
        raise ValueError(f'split {split!r} is not "train" or "eval"')

    def score(self, example: Example, completion: str) -> float:
        answer = extract_answer(completion, self.config.answer_pattern)
        if answer is None:
            return 0.0
        try:
            reward = self._train.score_answer(answer, example.meta["entry"])
        except Exception:
            # Model output is arbitrary text and a verifier that chokes on it must not take
            # down a reward worker; such an answer earns nothing. Warn once so a broken
            # verifier is still visible.
            if not self._warned_scorer_error:
                log.warning("%s: score_answer raised; scoring 0", self.name, exc_info=True)
                self._warned_scorer_error = True
            return 0.0
        reward = clamp_reward(reward)
        if self.config.full_marks_only:
            return 1.0 if reward >= 1.0 else 0.0
        return reward

    def _train_example(self, index: int) -> Example:
        return self._example("train", index, self._train[index])

    def _eval_example(self, index: int) -> Example:
        return self._example("eval", index, self._eval_pool[index])

    def _example(self, split: Split, index: int, entry: dict[str, Any]) -> Example:
        cfg = self.config
        answer = None if entry["answer"] is None else str(entry["answer"])
        return Example(
            uid=f"{split}:{index}",
            prompt=cfg.prompt_template.format(question=entry["question"]),
            answer=answer,
            completion=None if answer is None else cfg.completion_template.format(answer=answer),
            meta={"index": index, "entry": entry},
        )

    def _held_out_indices(self) -> list[int]:
        """Indices into the eval pool of the first ``eval_size`` prompts that occur neither
        in train (held-out must be held out) nor earlier in eval (accuracy over distinct
        problems)."""
        cfg = self.config
        seen: set[str] = set()
        if cfg.train_size <= MAX_DEDUP_TRAIN_SIZE:
            seen = {self._train[i]["question"] for i in range(cfg.train_size)}
        else:
            log.warning(
                "%s: train_size %d > %d, so eval is not deduplicated against train",
                self.name,
                cfg.train_size,
                MAX_DEDUP_TRAIN_SIZE,
            )
        indices: list[int] = []
        for i in range(self._eval_candidates):
            if len(indices) == cfg.eval_size:
                break
            question = self._eval_pool[i]["question"]
            if question not in seen:
                seen.add(question)
                indices.append(i)
        if len(indices) < cfg.eval_size:
            raise ValueError(
                f"{self.name}: only {len(indices)} of {self._eval_candidates} eval candidates "
                f"are distinct and absent from train, fewer than eval_size={cfg.eval_size}; "
                "lower eval_size or train_size, or widen dataset_kwargs"
            )
        return indices


def _check_seeds(cfg: TaskConfig, eval_candidates: int) -> None:
    """reasoning-gym seeds item i with ``Random(seed + i)``, so eval_seed = seed + 1 would
    make eval the train split shifted by one: the two seed ranges must not overlap."""
    # Random(n) and Random(-n) are the same stream, so negative seeds could alias too.
    if cfg.seed < 0 or cfg.eval_seed < 0:
        raise ValueError(f"seed ({cfg.seed}) and eval_seed ({cfg.eval_seed}) must be >= 0")
    train_end = cfg.seed + cfg.train_size
    eval_end = cfg.eval_seed + eval_candidates
    if cfg.seed < eval_end and cfg.eval_seed < train_end:
        raise ValueError(
            f"train seeds [{cfg.seed}, {train_end}) and eval seeds [{cfg.eval_seed}, "
            f"{eval_end}) overlap: reasoning-gym seeds item i with seed + i, so eval would "
            "repeat train items; move eval_seed outside the train range"
        )


def _create_dataset(cfg: TaskConfig, seed: int, size: int) -> Any:
    reserved = sorted({"seed", "size"} & cfg.dataset_kwargs.keys())
    if reserved:
        raise ValueError(
            f"dataset_kwargs must not set {reserved}; use TaskConfig seed/eval_seed/train_size"
        )
    try:
        return reasoning_gym.create_dataset(cfg.dataset, seed=seed, size=size, **cfg.dataset_kwargs)
    except (ValueError, TypeError, AssertionError) as e:
        raise ValueError(
            f"reasoning_gym.create_dataset({cfg.dataset!r}, **{cfg.dataset_kwargs}) failed: "
            f"{e} (the default dataset_kwargs suit basic_arithmetic only)"
        ) from e
