"""Tests for asyncrl.tasks: reasoning-gym task, templates, answer extraction, JSONL loading."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.tasks import DataError, Example, TaskConfig, build_task, extract_answer, load_jsonl

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def default_task():
    return build_task(TaskConfig())


def _digest(task, n_train: int = 200) -> str:
    train = task.examples("train")
    rows = [(e.uid, e.prompt, e.answer) for e in train[:n_train]]
    rows += [(e.uid, e.prompt, e.answer) for e in task.examples("eval")]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


# --- reasoning-gym ----------------------------------------------------------------------


def test_reasoning_gym_deterministic_across_builds(default_task):
    again = build_task(TaskConfig())
    assert _digest(again) == _digest(default_task)
    assert again.examples("train")[12345] == default_task.examples("train")[12345]
    other_seed = build_task(TaskConfig(seed=7))
    assert _digest(other_seed) != _digest(default_task)


def test_reasoning_gym_deterministic_in_another_process(default_task):
    code = (
        "import sys; sys.path.insert(0, 'tests'); from test_tasks import _digest; "
        "from asyncrl.tasks import TaskConfig, build_task; "
        "print(_digest(build_task(TaskConfig())))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == _digest(default_task)


def test_pickled_task_is_rebuilt_from_config(default_task):
    clone = pickle.loads(pickle.dumps(default_task))
    assert clone.config == default_task.config
    example = default_task.examples("eval")[3]
    assert clone.examples("eval")[3] == example
    assert clone.score(example, example.completion) == 1.0


def test_sizes_uids_and_negative_index(default_task):
    train, eval_ = default_task.examples("train"), default_task.examples("eval")
    assert len(train) == 20000 and len(eval_) == 200
    assert train[-1].uid == "train:19999"
    assert len({e.uid for e in eval_}) == 200
    assert [e.uid for e in train[2:4]] == ["train:2", "train:3"]


def test_eval_is_held_out_and_distinct(default_task):
    train_prompts = {e.prompt for e in default_task.examples("train")}
    eval_prompts = [e.prompt for e in default_task.examples("eval")]
    assert len(set(eval_prompts)) == len(eval_prompts) == 200
    assert not train_prompts & set(eval_prompts)


def test_eval_seed_overlapping_train_seeds_is_rejected():
    # reasoning-gym seeds item i with seed + i: eval_seed = seed + 1 is train shifted by one.
    with pytest.raises(ValueError, match="overlap"):
        build_task(TaskConfig(seed=0, eval_seed=1))
    with pytest.raises(ValueError, match="unseen_seed range"):
        build_task(TaskConfig(unseen_seed=TaskConfig().eval_seed + 10))


def test_unseen_split_is_in_neither_train_nor_eval():
    small = TaskConfig(train_size=3000, unseen_candidates=2000)
    task = build_task(small)
    unseen = task.examples("unseen")
    prompts = [e.prompt for e in unseen]
    assert 100 < len(prompts) == len(set(prompts)) < 2000
    assert not set(prompts) & {e.prompt for e in task.examples("train")}
    assert not set(prompts) & {e.prompt for e in task.examples("eval")}
    assert unseen[0].uid.startswith("unseen:")
    assert task.score(unseen[0], unseen[0].completion) == 1.0


def test_eval_fails_when_train_covers_the_problem_space():
    kwargs = {**TaskConfig().dataset_kwargs, "max_digits": 1}  # 242 distinct problems
    task = build_task(TaskConfig(dataset_kwargs=kwargs, train_size=5000, eval_size=10))
    with pytest.raises(ValueError, match="absent from train"):
        task.examples("eval")


def test_score_reference_wrong_and_missing(default_task):
    for example in default_task.examples("eval")[:50]:
        assert default_task.score(example, example.completion) == 1.0
        wrong = str(int(example.answer) + 1)
        assert default_task.score(example, f" {wrong}") == 0.0
        assert default_task.score(example, " I do not know") == 0.0
        # The last number in the completion is the answer.
        assert default_task.score(example, f" {wrong}? No: {example.answer}") == 1.0
        assert default_task.score(example, f" {example.answer}? No: {wrong}") == 0.0


def test_score_partial_credit_comes_from_reasoning_gym(default_task):
    # reasoning-gym's default score_answer pays len(ref)/len(answer) when the reference is
    # a substring of the answer; pinned so a change upstream is noticed.
    example = Example(uid="x", prompt="p", answer="46", meta={"entry": {"answer": "46"}})
    assert default_task.score(example, " 146") == pytest.approx(2 / 3)


def test_bad_dataset_kwargs_name_the_dataset():
    with pytest.raises(ValueError, match="basic_arithmetic"):
        build_task(TaskConfig(dataset_kwargs={"operators": ["%"]}))
    with pytest.raises(ValueError, match="must not set"):
        build_task(TaskConfig(dataset_kwargs={"seed": 3}))


# --- answer extraction and templates ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pattern", "expected"),
    [
        ("3 + 4 = 7, so 8", r"-?\d+", "8"),
        ("the answer is -12", r"-?\d+", "-12"),
        ("no digits here", r"-?\d+", None),
        ("Answer: 5 ... Answer:  6 ", r"Answer:\s*(\S+)", "6"),
        ("<a>1</a> then <a> 2 </a>", r"<a>(.*?)</a>", "2"),
        ("<a></a>", r"<a>(.*?)</a>", None),
        ("x", r"(y)?x", None),
        ("  forty two \n", None, "forty two"),
        ("   ", None, None),
    ],
)
def test_extract_answer(text, pattern, expected):
    assert extract_answer(text, pattern) == expected


def test_templates_are_applied():
    cfg = TaskConfig(
        train_size=10,
        eval_size=5,
        prompt_template="Q: {question}\nA:",
        completion_template=" The answer is {answer}.",
    )
    task = build_task(cfg)
    example = task.examples("train")[0]
    raw = example.meta["entry"]
    assert example.prompt == f"Q: {raw['question']}\nA:"
    assert example.completion == f" The answer is {raw['answer']}."
    assert task.score(example, example.completion) == 1.0


@pytest.mark.parametrize(
    ("field", "template", "match"),
    [
        ("prompt_template", "Q: {problem}", "prompt_template 'Q: {problem}'.*'problem'"),
        ("prompt_template", "{answer}", "prompt_template.*'answer'"),
        ("prompt_template", "{}", "prompt_template.*unknown field ''"),
        ("completion_template", " {ans}", "completion_template ' {ans}'.*'ans'"),
        ("prompt_template", "{question", "prompt_template.*not a valid"),
    ],
)
@pytest.mark.parametrize("source", ["reasoning_gym", "jsonl"])
def test_bad_template_fails_at_build(field, template, match, source):
    cfg = TaskConfig(source=source, train_path="unused.jsonl", **{field: template})
    with pytest.raises(ValueError, match=match):
        build_task(cfg)


def test_bad_answer_pattern_fails_at_build():
    with pytest.raises(ValueError, match="answer_pattern"):
        build_task(TaskConfig(answer_pattern="(unclosed"))


# --- JSONL ------------------------------------------------------------------------------


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_three_kinds_load(tmp_path):
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "hi", "completion": " there"},
        {"prompt": "2+2=", "completion": " 4", "answer": "4"},
        {"prompt": "pick", "chosen": " good", "rejected": " bad", "id": 7},
    ]
    path = _write(tmp_path / "data.jsonl", [json.dumps(r) for r in rows])
    answer, sft, sft_answer, pref = load_jsonl(path, split="eval")
    assert (answer.prompt, answer.answer, answer.completion) == ("1+1=", "2", None)
    assert (sft.completion, sft.answer) == (" there", None)
    assert (sft_answer.completion, sft_answer.answer) == (" 4", "4")
    assert (pref.chosen, pref.rejected, pref.answer, pref.meta) == (
        " good",
        " bad",
        None,
        {"id": 7},
    )
    assert [e.uid for e in (answer, pref)] == ["eval:1", "eval:4"]


def test_jsonl_task_templates_scores_and_holds_out(tmp_path):
    train = _write(
        tmp_path / "train.jsonl",
        [
            json.dumps({"prompt": "1+1", "answer": "2"}),
            json.dumps({"prompt": "hi", "completion": "!"}),
        ],
    )
    eval_rows = [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+3", "answer": " 5 "}]
    eval_ = _write(tmp_path / "eval.jsonl", [json.dumps(r) for r in eval_rows])
    cfg = TaskConfig(
        source="jsonl",
        train_path=str(train),
        eval_path=str(eval_),
        prompt_template="Q: {question} A:",
        completion_template=" {answer}.",
    )
    task = build_task(cfg)
    first, second = task.examples("train")
    assert (first.prompt, first.completion) == ("Q: 1+1 A:", " 2.")
    assert (second.prompt, second.completion) == ("Q: hi A:", "!")
    (held_out,) = task.examples("eval")  # "1+1" occurs in train, so it is dropped
    assert held_out.prompt == "Q: 2+3 A:"
    assert task.score(held_out, "3, no, 5") == 1.0
    assert task.score(held_out, "5, no, 3") == 0.0
    assert task.score(held_out, "five") == 0.0
    with pytest.raises(ValueError, match="no reference answer"):
        task.score(second, "!")


def test_jsonl_eval_without_path_is_an_error(tmp_path):
    train = _write(tmp_path / "train.jsonl", [json.dumps({"prompt": "a", "answer": "b"})])
    task = build_task(TaskConfig(source="jsonl", train_path=str(train)))
    with pytest.raises(ValueError, match="eval_path"):
        task.examples("eval")


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "a", "answer": ', "invalid JSON"),
        ('["prompt", "answer"]', "expected a JSON object, got array"),
        ('{"question": "a", "answer": "b"}', 'missing key "prompt"'),
        ('{"prompt": "a", "answer": 4}', '"answer" must be a string, got number'),
        ('{"prompt": null, "answer": "4"}', '"prompt" must be a string, got null'),
        ('{"prompt": "a"}', "match no row kind"),
        ('{"prompt": "a", "chosen": "b"}', "match no row kind"),
        ('{"prompt": "a", "chosen": "b", "rejected": "c", "completion": "d"}', "match no row kind"),
    ],
)
def test_jsonl_bad_row_names_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"prompt": "a", "answer": "b"})
    path = _write(tmp_path / "data.jsonl", [good, "", bad_line, good])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_jsonl_empty_file_names_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=f"{path}: no rows"):
        load_jsonl(path)


def test_jsonl_non_utf8_names_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "b"}\n{"prompt": "\xff", "answer": "b"}\n')
    with pytest.raises(DataError, match=f"{path}:2: not UTF-8"):
        load_jsonl(path)


def _series(**kwargs) -> object:
    return build_task(
        TaskConfig(
            dataset="arithmetic_series",
            dataset_kwargs=kwargs,
            prompt_template="{question}:",
            completion_template=" {solution}",
            train_size=2000,
        )
    )


def test_arithmetic_series_solutions_are_checked_worked_series():
    from asyncrl.tasks.series import worked_solution

    assert worked_solution(13, 6, 7) == ("07:13 06:19 05:25 04:31 03:37 02:43 01:49", 49)
    assert worked_solution(995, 9, 2) == ("02:995 01:1004", 1004)
    task = _series()
    for ex in task.examples("eval")[:50]:
        terms, start, step = (int(x) for x in re.findall(r"\d+", ex.prompt))
        written = [t.split(":") for t in ex.completion.split()]
        assert [int(i) for i, _ in written] == list(range(terms, 0, -1))
        assert [int(t) for _, t in written] == [start + step * i for i in range(terms)]
        assert ex.answer == written[-1][1] and task.score(ex, ex.completion) == 1.0
        assert task.score(ex, ex.completion + " 1") == 0.0


def test_arithmetic_series_lengths_span_more_than_ten_times():
    """The long tail the long-tail experiments are built on: p10 ≤ 32 tokens and p99 ≥ 256
    of the reference solutions (one token per character), held out from train."""
    task = _series()
    lengths = sorted(len(ex.completion) for ex in task.examples("eval"))
    p10, p99 = lengths[len(lengths) // 10], lengths[round(0.99 * (len(lengths) - 1))]
    assert p10 <= 32 and p99 >= 256 and max(lengths) < 512, (p10, p99, max(lengths))
    train = {task.examples("train")[i].prompt for i in range(2000)}
    assert not train & {ex.prompt for ex in task.examples("eval")}


def test_solution_template_needs_a_dataset_with_solutions():
    with pytest.raises(ValueError, match="metadata\\['solution'\\]"):
        build_task(TaskConfig(completion_template=" {solution}")).examples("train")[0]
    with pytest.raises(ValueError, match="max_terms"):
        _series(max_terms=3).examples("train")[0]
