"""Tests for asyncrl.tasks.dataset (source="dataset") and tools/make_dataset.py: every
shape loads through its field map from JSONL and Parquet, eval is held out, and bad
input fails naming the file, row and key.

Why one file: one loader (``source="dataset"``) and the tool that writes its files, shape by
shape and error by error; the cases share their file builders.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.tasks import DataError, TaskConfig
from asyncrl.tasks.dataset import DatasetTask, last_boxed, read_reference, read_rows

REPO = Path(__file__).resolve().parents[1]


def _load_tool(name: str) -> ModuleType:
    # tools/ is no package; loaded from its file rather than by putting it on sys.path.
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_dataset = _load_tool("make_dataset")

FORMATS = ["jsonl", "parquet"]


def _write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        # from_pylist takes its columns from the first row alone: give every row all keys.
        keys = dict.fromkeys(k for r in rows for k in r)
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _task(tmp_path: Path, fmt: str, rows: list[dict], **cfg) -> DatasetTask:
    path = _write(tmp_path / f"train.{fmt}", rows)
    return DatasetTask(TaskConfig(source="dataset", train_path=str(path), **cfg))


# --- the shapes -------------------------------------------------------------------------

GSM = [
    {"question": "Ann has 2 apples and gets 3.", "answer": "She has 2 + 3 = 5.\n#### 5"},
    {"question": "Bob has 7 pens and loses 4.", "answer": "7 - 4 = 3 left\n####  3 "},
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_gsm8k_question_answer(tmp_path, fmt):
    task = _task(tmp_path, fmt, GSM, fields={"prompt": "question"}, prompt_template="Q: {question}")
    first, second = task.examples("train")
    assert (first.uid, first.prompt, first.answer) == (
        "train:0",
        "Q: Ann has 2 apples and gets 3.",
        "5",
    )
    # The worked solution is the SFT target, as in the file; the reference is what follows ####.
    assert (first.completion, first.messages) == ("She has 2 + 3 = 5.\n#### 5", None)
    assert (second.answer, second.completion) == ("3", "7 - 4 = 3 left\n####  3 ")
    assert task.score(first, "so 2 + 3 = 5") == 1.0
    assert task.score(first, "5, no, 6") == 0.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_bare_answer_goes_through_completion_template(tmp_path, fmt):
    rows = [{"prompt": "1+1", "answer": " 2 "}, {"prompt": "2+2", "answer": "\\boxed{4}"}]
    bare, boxed = _task(tmp_path, fmt, rows, completion_template=" = {answer}.").examples("train")
    assert (bare.answer, bare.completion) == ("2", " = 2.")
    assert (boxed.answer, boxed.completion) == ("4", "\\boxed{4}")
    # reference="raw": the whole answer text is the reference, so it is a bare answer.
    raw = _task(tmp_path, fmt, GSM, fields={"prompt": "question"}, reference="raw")
    assert raw.examples("train")[0].completion == " She has 2 + 3 = 5.\n#### 5"


MATH = [
    {"problem": "Halve 1.", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
    {"problem": "Add 2 and 2.", "solution": "First \\boxed{3}? No: $\\boxed{4}$."},
    {"problem": "Say hi.", "solution": "hi"},
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_math_problem_solution_boxed(tmp_path, fmt):
    fields = {"prompt": "problem", "completion": "solution"}
    task = _task(tmp_path, fmt, MATH, fields=fields, answer_pattern=r"boxed\{(\d+)\}")
    half, four, unboxed = task.examples("train")
    assert (half.prompt, half.answer, half.completion) == (
        "Halve 1.",
        "\\frac{1}{2}",
        "It is $\\boxed{\\frac{1}{2}}$.",
    )
    assert half.meta == {"level": "Level 1"}
    assert four.answer == "4"
    assert task.score(four, "so \\boxed{4}") == 1.0
    # SFT rows need no reference; scoring one is an error, not a silent 0.
    assert (unboxed.answer, unboxed.completion) == (None, "hi")
    with pytest.raises(ValueError, match="train:2 has no reference answer"):
        task.score(unboxed, "hi")


CHAT = [
    {
        "messages": [
            {"role": "user", "content": "2+2?", "name": "ann"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "It is \\boxed{6}."},
        ],
        "system": "Be brief.",
    },
    {"messages": [{"role": "user", "content": "Tell a joke."}], "system": None},
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_chat_messages(tmp_path, fmt):
    task = _task(tmp_path, fmt, CHAT, prompt_template="[{question}]")
    sft, prompt_only = task.examples("train")
    assert sft.prompt == "[and 3+3?]"  # the last user turn, templated
    assert sft.completion == "It is \\boxed{6}."
    assert [t["role"] for t in sft.messages] == ["system", "user", "assistant", "user"]
    assert sft.messages[0]["content"] == "Be brief."
    assert sft.messages[1] == {"role": "user", "content": "2+2?"}  # other keys are dropped
    assert sft.messages[-1]["content"] == "and 3+3?"  # turns are kept untemplated
    assert sft.answer == "6"
    assert (prompt_only.prompt, prompt_only.completion, prompt_only.answer) == (
        "[Tell a joke.]",
        None,
        None,
    )
    assert prompt_only.messages == ({"role": "user", "content": "Tell a joke."},)


def test_system_column_without_messages_becomes_a_conversation(tmp_path):
    rows = [{"question": "1+1", "answer": "2", "system": "Only digits."}]
    (example,) = _task(tmp_path, "jsonl", rows, fields={"prompt": "question"}).examples("train")
    assert example.messages == (
        {"role": "system", "content": "Only digits."},
        {"role": "user", "content": "1+1"},
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_preferences_strings_and_conversations(tmp_path, fmt):
    strings = [{"prompt": "1+1", "chosen": " 2", "rejected": " 3", "answer": "2"}]
    (pair,) = _task(tmp_path, fmt, strings).examples("train")
    assert (pair.prompt, pair.chosen, pair.rejected, pair.answer) == ("1+1", " 2", " 3", "2")
    user = {"role": "user", "content": "2+2"}
    turns = [
        {
            "chosen": [user, {"role": "assistant", "content": "4"}],
            "rejected": [user, {"role": "assistant", "content": "5"}],
        }
    ]
    (pair,) = _task(tmp_path, fmt, turns).examples("train")
    assert (pair.prompt, pair.chosen, pair.rejected, pair.messages) == ("2+2", "4", "5", (user,))


@pytest.mark.parametrize(
    ("text", "mode", "expected"),
    [
        ("so 5\n#### 5", "auto", "5"),
        ("x \\boxed{\\sqrt{2}} y", "auto", "\\sqrt{2}"),
        (" 42 ", "auto", "42"),
        ("#### 1 and \\boxed{2}", "boxed", "2"),
        ("#### 1 and \\boxed{2}", "raw", "#### 1 and \\boxed{2}"),
        ("no marker", "gsm8k", None),
        ("no marker", "boxed", None),
    ],
)
def test_read_reference(text, mode, expected):
    assert read_reference(text, mode, whole_text_is_answer=True) == expected


def test_auto_reference_of_a_reply_never_takes_the_whole_reply():
    assert read_reference("Hello there", "auto", whole_text_is_answer=False) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [("\\boxed{a{b}c}", "a{b}c"), ("\\boxed{1} \\boxed{2}", "2"), ("\\boxed{1", None), ("1", None)],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_eval_is_deduplicated_against_train(tmp_path):
    train = _write(
        tmp_path / "train.parquet", [{"q": "a", "answer": "1"}, {"q": "b", "answer": "2"}]
    )
    eval_ = _write(tmp_path / "eval.jsonl", [{"q": "b", "answer": "2"}, {"q": "c", "answer": "3"}])
    cfg = TaskConfig(
        source="dataset", train_path=str(train), eval_path=str(eval_), fields={"prompt": "q"}
    )
    (held_out,) = DatasetTask(cfg).examples("eval")
    assert (held_out.uid, held_out.prompt) == ("eval:1", "c")
    only_repeats = _write(tmp_path / "repeats.jsonl", [{"q": "a", "answer": "1"}])
    cfg.eval_path = str(only_repeats)
    with pytest.raises(DataError, match="every eval prompt also occurs"):
        DatasetTask(cfg).examples("eval")


def test_task_pickles_by_config_and_loads_offline(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("dataset loading opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    task = _task(tmp_path, "parquet", GSM, fields={"prompt": "question"})
    assert len(task.examples("train")) == 2
    rebuilt = pickle.loads(pickle.dumps(task))
    assert rebuilt.config == task.config and rebuilt._splits == {}


def test_loading_leaves_progress_bars_as_they_were(tmp_path):
    import datasets

    path = _write(tmp_path / "train.jsonl", GSM)
    for enabled in (True, False):
        (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()
        read_rows(str(path))
        assert datasets.is_progress_bar_enabled() == enabled
    datasets.enable_progress_bars()


def test_datasets_is_imported_late_and_offline(tmp_path):
    path = _write(tmp_path / "train.jsonl", GSM)
    code = (
        # huggingface_hub first, as transformers imports it in a run: HF_HUB_OFFLINE is read
        # by then, and only HF_DATASETS_OFFLINE can still make `datasets` offline.
        "import sys, huggingface_hub.constants, asyncrl.tasks, asyncrl.tasks.dataset as d\n"
        "assert 'datasets' not in sys.modules, 'import asyncrl.tasks imported datasets'\n"
        f"assert len(d.read_rows({str(path)!r})) == 2\n"
        "import datasets\n"
        "print(datasets.config.HF_HUB_OFFLINE)"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == "True", out.stderr


# --- bad input --------------------------------------------------------------------------

# A reference under every mode, so that only the bad row fails.
GOOD = {"prompt": "a", "answer": "\\boxed{1} #### 1"}
# Rows with a bad value where the column's type stays one Parquet can store.
BAD_IN_BOTH = [
    ({"prompt": None, "answer": "1"}, {}, 'key "prompt": missing or blank'),
    ({"prompt": "b", "answer": ""}, {}, 'key "answer": no reference answer'),
    ({"prompt": "b", "answer": "x"}, {"reference": "gsm8k"}, 'key "answer": no reference'),
    ({"prompt": "b", "chosen": "x"}, {}, 'key "chosen": a preference pair needs both'),
    (
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
        {"reference": "boxed"},
        'key "messages": no reference answer under reference="boxed"',
    ),
    ({"messages": [{"role": "user"}]}, {}, "message 0 has no string content"),
    ({"messages": [{"role": "bot", "content": "x"}]}, {}, "message 0 has role 'bot'"),
    (
        {
            "chosen": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "user", "content": "v"}, {"role": "assistant", "content": "b"}],
        },
        {},
        'key "rejected": its turns before the reply differ',
    ),
    (
        {"prompt": "b", "completion": "c", "messages": [{"role": "assistant", "content": "d"}]},
        {},
        'key "completion": the messages already end with an assistant reply',
    ),
]
# Rows whose value has another type than the rest of its column: JSON only.
BAD_TYPES = [
    ({"prompt": 7, "answer": "1"}, {}, 'key "prompt": must be a string, got int'),
    ({"prompt": "b", "messages": "hi"}, {}, 'key "messages": must be a non-empty list'),
    ({"prompt": "b", "chosen": "x", "rejected": ["y"]}, {}, "message 0 must be an object"),
]


@pytest.mark.parametrize(
    ("fmt", "bad", "cfg", "message"),
    [(fmt, *case) for fmt in FORMATS for case in BAD_IN_BOTH]
    + [("jsonl", *case) for case in BAD_TYPES],
)
def test_bad_row_names_file_row_and_key(tmp_path, fmt, bad, cfg, message):
    task = _task(tmp_path, fmt, [GOOD, GOOD, bad], **cfg)
    with pytest.raises(DataError) as info:
        task.examples("train")
    assert str(info.value).startswith(f"{tmp_path / f'train.{fmt}'}: row 2 (0-based), key ")
    assert message in str(info.value)


def test_parquet_column_of_the_wrong_type_names_row_and_key(tmp_path):
    task = _task(tmp_path, "parquet", [{"prompt": 1, "answer": "1"}])
    with pytest.raises(DataError, match=r'row 0 \(0-based\), key "prompt": must be a string'):
        task.examples("train")


def test_bad_mapped_row_names_the_column_too(tmp_path):
    task = _task(tmp_path, "jsonl", [{"question": ["a"]}], fields={"prompt": "question"})
    with pytest.raises(DataError, match=r'row 0 \(0-based\), key "prompt" \(column "question"\)'):
        task.examples("train")


@pytest.mark.parametrize("fmt", FORMATS)
def test_mapped_column_missing_names_key_file_and_columns(tmp_path, fmt):
    task = _task(tmp_path, fmt, GSM, fields={"prompt": "problem"})
    with pytest.raises(DataError) as info:
        task.examples("train")
    text = str(info.value)
    assert str(tmp_path / f"train.{fmt}") in text
    assert '"prompt" to column "problem"' in text and "its columns: question, answer" in text


def test_file_without_a_prompt_column_says_what_to_map(tmp_path):
    task = _task(tmp_path, "parquet", GSM)
    with pytest.raises(DataError, match='no prompt column: map "prompt".*: question, answer'):
        task.examples("train")


def test_unknown_field_name_fails_at_build(tmp_path):
    with pytest.raises(DataError, match=r"unknown name\(s\) \['question'\]"):
        _task(tmp_path, "jsonl", GSM, fields={"question": "prompt"})


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.jsonl", "", "no rows (the file is empty)"),
        ("broken.jsonl", '{"prompt": "a"}\n{"prompt": \n', "cannot be read as json"),
        ("data.csv", "prompt\na\n", "unsupported file type; expected one of .jsonl, .json"),
        ("nothere.parquet", None, "no such file"),
    ],
)
def test_bad_file_names_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError) as info:
        DatasetTask(TaskConfig(source="dataset", train_path=str(path))).examples("train")
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)


# --- tools/make_dataset.py --------------------------------------------------------------


@pytest.mark.parametrize("shape", make_dataset.SHAPES)
def test_made_files_load_through_their_field_map(tmp_path, capsys, shape):
    argv = ["--out", str(tmp_path), "--shape", shape, "--format", "parquet"]
    assert make_dataset.main([*argv, "--train", "6", "--eval", "3", "--seed", "5"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["train_rows"], report["eval_rows"]) == (6, 3)
    cfg = TaskConfig(
        source="dataset",
        train_path=report["train_path"],
        eval_path=report["eval_path"],
        fields=report["fields"],
    )
    task = DatasetTask(cfg)
    train, eval_ = task.examples("train"), task.examples("eval")
    assert (len(train), len(eval_)) == (6, 3)
    assert not {e.prompt for e in train} & {e.prompt for e in eval_}
    for example in train:
        # Every shape carries a reference, and its SFT target or chosen side reaches it.
        assert example.answer is not None
        assert task.score(example, example.chosen or example.completion) == 1.0
        if shape == "preferences":
            assert task.score(example, example.rejected) == 0.0
