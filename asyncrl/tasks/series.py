"""``arithmetic_series``: the last term of an arithmetic series, found by writing the
series out, a reasoning task whose worked solutions vary in length by more than 10×.

A problem is "n terms from a by d": what is the n-th term of a, a+d, a+2d, …? Its worked
solution writes each term after the number of terms left, counting down,
``" 03:13 02:19 01:25"``, and the answer is the last number written. Every step depends
only on the text just before it (the count less one, the previous term plus d), every
chain ends the same way, after the term counted 01, and every count has two digits (n
too, in the prompt): short problems and long ones share one format and one stopping
rule, so training on the short ones (which RL sees most, as long chains are more often
all wrong and filtered) does not teach long ones to stop early. Chains counting up to n,
or down from an unpadded n, did: RL on them lost held-out accuracy (docs/results.md). A
chain is right only if every term in it is. The number of terms is drawn so that most problems are short
and a few are long: with probability ``long_fraction`` it is log-uniform over
[``short_max_terms`` + 1, ``max_terms``], else uniform over [2, ``short_max_terms``]. A
term takes 6–9 characters, so the defaults give completions of 15 to 400 characters with
p10 ≈ 15 and p99 ≈ 320 (one token per character with a character tokenizer): the long
tail that makes a synchronous batch wait for its slowest sample. The answer is checked
exactly.

It is a reasoning-gym ``ProceduralDataset`` (item i is a pure function of seed + i),
registered on import, so ``TaskConfig(dataset="arithmetic_series")`` gets reasoning-gym's
splits, deduplication and scoring path. The worked solution is in
``entry["metadata"]["solution"]``: ``completion_template=" {solution}"`` trains on it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from reasoning_gym import factory
from reasoning_gym.dataset import ProceduralDataset

NAME = "arithmetic_series"


@dataclass
class ArithmeticSeriesConfig:
    min_start: int = 1
    """Smallest first term a."""
    max_start: int = 999
    """Largest first term a: ~36,000 distinct short problems, so a train split of several
    thousand leaves most of them to the held-out and RL splits."""
    max_step: int = 9
    """Largest common difference d (d is uniform over 1 … max_step)."""
    short_max_terms: int = 5
    """Short problems have 2 … short_max_terms terms."""
    max_terms: int = 50
    """Long problems have up to this many terms: their solutions stay under 400 characters,
    inside a 512-token generation budget."""
    long_fraction: float = 0.2
    """Fraction of problems drawn from the long range."""
    seed: int | None = None
    size: int = 500

    def validate(self) -> None:
        if not 1 <= self.min_start <= self.max_start:
            raise ValueError(
                f"need 1 <= min_start <= max_start, got {self.min_start}, {self.max_start}"
            )
        if self.max_step < 1:
            raise ValueError(f"max_step must be >= 1, got {self.max_step}")
        if not 2 <= self.short_max_terms < self.max_terms <= 99:
            raise ValueError(
                f"need 2 <= short_max_terms < max_terms <= 99 (counts have two digits), got "
                f"{self.short_max_terms}, {self.max_terms}"
            )
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")


def worked_solution(start: int, step: int, terms: int) -> tuple[str, int]:
    """The solution text of "``terms`` terms from ``start`` by ``step``": each term after
    the number of terms left, two digits, counting down to 01, ``"03:13 02:19 01:25"``, and
    the last term (the answer)."""
    series = [start + step * i for i in range(terms)]
    return " ".join(f"{terms - i:02d}:{term}" for i, term in enumerate(series)), series[-1]


class ArithmeticSeriesDataset(ProceduralDataset):
    def __init__(self, config: ArithmeticSeriesConfig) -> None:
        super().__init__(config=config, seed=config.seed, size=config.size)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        cfg = self.config
        rng = random.Random(self.seed + idx)
        start = rng.randint(cfg.min_start, cfg.max_start)
        step = rng.randint(1, cfg.max_step)
        if rng.random() < cfg.long_fraction:
            low, high = cfg.short_max_terms + 1, cfg.max_terms
            terms = min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))
        else:
            terms = rng.randint(2, cfg.short_max_terms)
        solution, last = worked_solution(start, step, terms)
        return {
            "question": f"{terms:02d} terms from {start} by {step}",
            "answer": str(last),
            "metadata": {"start": start, "step": step, "terms": terms, "solution": solution},
        }

    def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
        return 1.0 if answer is not None and answer.strip() == entry["answer"] else 0.0


if NAME not in factory.DATASETS:
    factory.register_dataset(NAME, ArithmeticSeriesDataset, ArithmeticSeriesConfig)
