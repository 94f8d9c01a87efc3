"""Files are split by concern, not trimmed to a count: a Python file of the repository over
``LONG`` lines says in its module docstring why it is one unit (a paragraph that begins
``Why one file:``), and none is over ``MAX`` lines at all. Functions stay under a screen
(``MAX_FUNCTION`` lines, decorators and docstring included) outside the tests."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONG = 360
MAX = 600
MAX_FUNCTION = 60
REASON = "Why one file:"


def python_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in names if (ROOT / name).exists()]


def unexplained(path: Path) -> str | None:
    """Why ``path`` breaks the rule, or None."""
    text = path.read_text()
    lines = text.count("\n")
    if lines > MAX:
        return f"{lines} lines: split it by concern"
    doc = ast.get_docstring(ast.parse(text)) or ""
    if lines > LONG and REASON not in doc:
        return f"{lines} lines and no {REASON!r} paragraph in its docstring"
    return None


def test_a_long_file_says_why_it_is_one_unit():
    bad = {str(p.relative_to(ROOT)): why for p in python_files() if (why := unexplained(p))}
    assert not bad, "\n".join(f"{name}: {why}" for name, why in sorted(bad.items()))


def test_the_rule_sees_a_long_file_without_a_reason(tmp_path):
    body = "x = 1\n" * (LONG + 1)
    plain, explained = tmp_path / "plain.py", tmp_path / "explained.py"
    plain.write_text('"""A module."""\n' + body)
    explained.write_text(f'"""A module.\n\n{REASON} one table, read whole."""\n' + body)
    assert unexplained(plain) and unexplained(explained) is None


def test_no_function_of_the_code_is_longer_than_a_screen():
    """The package, tools, launchers and experiments; a test may run a whole scenario."""
    bad = []
    for path in python_files():
        if path.relative_to(ROOT).parts[0] == "tests":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > MAX_FUNCTION:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not bad, f"functions over {MAX_FUNCTION} lines:\n" + "\n".join(bad)
