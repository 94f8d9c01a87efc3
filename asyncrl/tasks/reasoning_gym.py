"""reasoning-gym adapter: procedural problems with verifiers, as a ``Task``.

Examples are generated on access from ``reasoning_gym`` datasets (item i of a dataset is a
pure function of its seed and i), so the train split costs nothing until read. The eval
split is drawn from a second seed and filtered so that no eval prompt occurs in train. The
unseen split (RL prompts after SFT on train) is drawn from a third seed and keeps the
distinct problems that occur in neither.
Scoring extracts the answer with ``answer_pattern`` and defers to the dataset's own
``score_answer``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import reasoning_gym

# Imported for its side effect: it registers the arithmetic_series dataset with reasoning-gym.
from asyncrl.tasks import series  # noqa: F401
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
        check_common(config, ("answer", "solution"))
        self.config = config
        self._eval_candidates = max(1, config.eval_size * EVAL_CANDIDATES_PER_EXAMPLE)
        _check_seeds(config, self._eval_candidates)
        self._train = _create_dataset(config, config.seed, config.train_size)
        self._eval_pool = _create_dataset(config, config.eval_seed, self._eval_candidates)
        self._eval_indices: list[int] | None = None
        self._unseen_pool = _create_dataset(config, config.unseen_seed, config.unseen_candidates)
        self._unseen_indices: list[int] | None = None
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
        if split == "unseen":
            if self._unseen_indices is None:
                self._unseen_indices = self._unseen()
            return LazyExamples(self._unseen_indices, self._unseen_example)
        raise ValueError(f'split {split!r} is not "train", "eval" or "unseen"')

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

    def _unseen_example(self, index: int) -> Example:
        return self._example("unseen", index, self._unseen_pool[index])

    def _train_questions(self) -> set[str]:
        """The train split's questions (a fresh set: callers add to it)."""
        return {self._train[i]["question"] for i in range(self.config.train_size)}

    def _unseen(self) -> list[int]:
        """Indices into the unseen pool of its distinct problems found in neither train nor
        eval (only as many as the problem space leaves: a small space leaves few)."""
        seen = self._train_questions()
        seen |= {ex.meta["entry"]["question"] for ex in self.examples("eval")}
        indices = _first_distinct(self._unseen_pool, self.config.unseen_candidates, seen)
        if not indices:
            raise ValueError(
                f"{self.name}: none of {self.config.unseen_candidates} unseen candidates is "
                "absent from train and eval; lower train_size or widen dataset_kwargs"
            )
        return indices

    def _example(self, split: Split, index: int, entry: dict[str, Any]) -> Example:
        cfg = self.config
        answer = None if entry["answer"] is None else str(entry["answer"])
        solution = (entry.get("metadata") or {}).get("solution")
        if solution is None and "{solution}" in cfg.completion_template:
            raise ValueError(
                f"{self.name}: completion_template {cfg.completion_template!r} uses {{solution}} "
                "but this dataset's entries have no metadata['solution']"
            )
        completion = None
        if answer is not None:
            completion = cfg.completion_template.format(answer=answer, solution=solution)
        return Example(
            uid=f"{split}:{index}",
            prompt=cfg.prompt_template.format(question=entry["question"]),
            answer=answer,
            completion=completion,
            meta={"index": index, "entry": entry},
        )

    def _held_out_indices(self) -> list[int]:
        """Indices into the eval pool of the first ``eval_size`` prompts that occur neither
        in train (held-out must be held out) nor earlier in eval (accuracy over distinct
        problems)."""
        cfg = self.config
        seen: set[str] = set()
        if cfg.train_size <= MAX_DEDUP_TRAIN_SIZE:
            seen = self._train_questions()
        else:
            log.warning(
                "%s: train_size %d > %d, so eval is not deduplicated against train",
                self.name,
                cfg.train_size,
                MAX_DEDUP_TRAIN_SIZE,
            )
        indices = _first_distinct(self._eval_pool, self._eval_candidates, seen, cfg.eval_size)
        if len(indices) < cfg.eval_size:
            raise ValueError(
                f"{self.name}: only {len(indices)} of {self._eval_candidates} eval candidates "
                f"are distinct and absent from train, fewer than eval_size={cfg.eval_size}; "
                "lower eval_size or train_size, or widen dataset_kwargs"
            )
        return indices


def _first_distinct(
    pool: Any, candidates: int, seen: set[str], limit: int | None = None
) -> list[int]:
    """Indices of the first ``limit`` (all, for None) of ``pool[:candidates]`` whose
    question is not in ``seen`` nor repeated; adds each one taken to ``seen``."""
    indices: list[int] = []
    for i in range(candidates):
        if len(indices) == limit:
            break
        question = pool[i]["question"]
        if question not in seen:
            seen.add(question)
            indices.append(i)
    return indices


def _check_seeds(cfg: TaskConfig, eval_candidates: int) -> None:
    """reasoning-gym seeds item i with ``Random(seed + i)``, so eval_seed = seed + 1 would
    make eval the train split shifted by one: the splits' seed ranges must not overlap."""
    ranges = {
        "seed": (cfg.seed, cfg.train_size),
        "eval_seed": (cfg.eval_seed, eval_candidates),
        "unseen_seed": (cfg.unseen_seed, cfg.unseen_candidates),
    }
    # Random(n) and Random(-n) are the same stream, so negative seeds could alias too.
    negative = [f"{k} ({start})" for k, (start, _) in ranges.items() if start < 0]
    if negative:
        raise ValueError(f"{', '.join(negative)} must be >= 0")
    names = list(ranges)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            (a0, an), (b0, bn) = ranges[a], ranges[b]
            if a0 < b0 + bn and b0 < a0 + an:
                raise ValueError(
                    f"{a} range [{a0}, {a0 + an}) and {b} range [{b0}, {b0 + bn}) overlap: "
                    "reasoning-gym seeds item i with seed + i, so one split would repeat "
                    f"the other's items; move {b} outside the {a} range"
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
