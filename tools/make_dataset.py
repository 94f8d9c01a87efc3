"""Write generated dataset files in the common shapes, for source="dataset" tasks and their
tests (``asyncrl.tasks.dataset``). Problems come from reasoning-gym (``gsm_symbolic`` by
default: GSM8K-like word problems with worked solutions), so no data is copied from
elsewhere.

    python tools/make_dataset.py --out runs/data/gsm --shape gsm8k --format parquet \\
        [--train 1000 --eval 100 --seed 0 --dataset gsm_symbolic]

Shapes: gsm8k (question, answer: worked solution ending "#### 42"), math (problem,
solution ending "\\boxed{42}"), messages (a user/assistant conversation plus a system
column) and preferences (prompt, chosen: the worked solution, rejected: one reaching a
wrong answer, answer). Writes OUT/train.EXT and OUT/eval.EXT; the eval problems come from
another seed range and none occurs in train. Prints one JSON line: the files, their row
counts and the TaskConfig.fields that reads them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

SHAPES = ("gsm8k", "math", "messages", "preferences")
FIELDS = {
    "gsm8k": {"prompt": "question"},
    "math": {"prompt": "problem", "completion": "solution"},
    "messages": {},
    "preferences": {},
}
SYSTEM = "Solve the problem step by step. End with #### and the answer."
# Eval candidates drawn per wanted eval row, to leave room for dropping train repeats.
EVAL_CANDIDATES_PER_ROW = 20


def problems(dataset: str, seed: int, size: int) -> list[tuple[str, str, str]]:
    """(question, answer, worked solution ending "#### answer") for reasoning-gym items
    ``seed .. seed + size - 1``; items without a worked solution get a one-line one."""
    import reasoning_gym

    items = reasoning_gym.create_dataset(dataset, seed=seed, size=size)
    out = []
    for entry in items:
        answer = str(entry["answer"])
        working = (entry.get("metadata") or {}).get("answer_cot") or f"The answer is {answer}."
        # gsm_symbolic sometimes ends with "#### 8.0" for the answer "8": the final line is
        # rewritten so that the reference read off the solution is the answer.
        working = re.sub(r"\n?####[^\n]*\s*$", "", working.strip())
        out.append((entry["question"], answer, f"{working}\n#### {answer}"))
    return out


def split_problems(
    dataset: str, seed: int, n_train: int, n_eval: int
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """Train from seeds [seed, seed + n_train); eval from the seeds after them, keeping
    the first ``n_eval`` distinct problems that do not occur in train."""
    train = problems(dataset, seed, n_train)
    seen = {question for question, _, _ in train}
    eval_rows = []
    for problem in problems(dataset, seed + n_train, max(1, n_eval * EVAL_CANDIDATES_PER_ROW)):
        if len(eval_rows) == n_eval:
            break
        if problem[0] not in seen:
            seen.add(problem[0])
            eval_rows.append(problem)
    if len(eval_rows) < n_eval:
        raise SystemExit(f"only {len(eval_rows)} distinct eval problems not in train; lower --eval")
    return train, eval_rows


def wrong_answer(answer: str, rng: random.Random) -> str:
    """An answer that differs from ``answer``: off by a small amount when it is a number."""
    try:
        value = float(answer)
    except ValueError:
        return answer + "0"
    offset = rng.choice([-3, -2, -1, 1, 2, 3])
    return str(int(value) + offset) if value.is_integer() else str(value + offset)


def row(shape: str, problem: tuple[str, str, str], rng: random.Random) -> dict[str, Any]:
    """One row of ``shape`` for ``problem``."""
    question, answer, solution = problem
    if shape == "gsm8k":
        return {"question": question, "answer": solution}
    if shape == "math":
        working = solution.rsplit("\n####", 1)[0]
        return {"problem": question, "solution": f"{working}\nThe answer is $\\boxed{{{answer}}}$."}
    if shape == "messages":
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": solution}]
        return {"system": SYSTEM, "messages": turns}
    # The rejected side reaches a wrong answer the way a slip would: its last step and its
    # final answer agree with each other, not with the reference.
    wrong = wrong_answer(answer, rng)
    working = solution.rsplit("\n####", 1)[0]
    at = working.rfind(answer)
    if at >= 0:
        working = working[:at] + wrong + working[at + len(answer) :]
    rejected = f"{working}\n#### {wrong}"
    return {"prompt": question, "chosen": solution, "rejected": rejected, "answer": answer}


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` as Parquet or as JSON lines, by the extension of ``path``."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="directory to write train/eval files to")
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    parser.add_argument("--train", type=int, default=1000, help="train rows")
    parser.add_argument("--eval", type=int, default=100, help="eval rows")
    parser.add_argument("--seed", type=int, default=0, help="first reasoning-gym seed")
    parser.add_argument("--dataset", default="gsm_symbolic", help="reasoning-gym dataset")
    args = parser.parse_args(argv)
    if args.train < 1 or args.eval < 0:
        parser.error("--train must be >= 1 and --eval >= 0")
    train, eval_rows = split_problems(args.dataset, args.seed, args.train, args.eval)
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"shape": args.shape, "fields": FIELDS[args.shape]}
    for split, chosen in (("train", train), ("eval", eval_rows)):
        if not chosen:
            continue
        path = out / f"{split}.{args.format}"
        write(path, [row(args.shape, problem, rng) for problem in chosen])
        report[f"{split}_path"] = str(path)
        report[f"{split}_rows"] = len(chosen)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
