"""The package's layering, read from the source with ``ast`` (nothing is imported).

Every import of every ``asyncrl`` module counts: at the top, inside functions and under
``if TYPE_CHECKING:`` (a cycle that only type checkers see still ties two modules
together). An import names the most precise module it can: ``from asyncrl.x import y``
is an edge to ``asyncrl.x.y`` when that is a module, else to ``asyncrl.x``. The rules:

- the layers of ``LAYERS`` (docs/architecture.md, Layers), bottom to top: a module
  imports nothing from a layer above its own, and every module of the package is in one;
- no import cycle between modules of ``asyncrl``, nor between its top-level packages;
- the buffer (``asyncrl.buffer``) imports nothing from the trainer, the stages or the
  generator: it is what they talk to, not the other way round;
- a stage imports nothing from a process's internals (``asyncrl.generator.worker``,
  ``asyncrl.buffer.server``);
- below the stages, no function takes the whole experiment or an untyped ``cfg``: each
  component takes its own config (``asyncrl.config``'s helpers, generic over every config
  dataclass, excepted);
- no module imports another's private names (``from asyncrl.x import _y``);
- the formatter decides the layout: its skip comments stay rare in the repository.

Why one file: the rules read one import graph, built once from the source; the reader and
the rules change together.
"""

from __future__ import annotations

import ast
import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asyncrl"
FMT_SKIP = "# fmt" + ": skip"  # spelled in two parts so that this file does not count
MAX_FMT_SKIPS = 10


@dataclass(frozen=True)
class Import:
    """One imported module (and, for ``from … import``, the names taken from it)."""

    importer: str
    target: str
    names: tuple[str, ...]
    line: int

    def where(self) -> str:
        path = PACKAGE.parent / (self.importer.replace(".", "/") + ".py")
        if not path.exists():
            path = path.with_suffix("") / "__init__.py"
        return f"{path.relative_to(ROOT)}:{self.line}"


@functools.cache
def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a (possibly relative) ``from … import`` names."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: set[str]) -> list[Import]:
    """Every import of an ``asyncrl`` module in ``path``, wherever it stands."""
    out = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "asyncrl":
                    out.append(Import(module, alias.name, (), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, is_package, node)
            if source.split(".")[0] != "asyncrl":
                continue
            plain = []
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:  # a submodule
                    out.append(Import(module, f"{source}.{alias.name}", (), node.lineno))
                else:
                    plain.append(alias.name)
            if plain:
                out.append(Import(module, source, tuple(plain), node.lineno))
    return out


@functools.cache
def all_imports() -> tuple[Import, ...]:
    files = module_files()
    modules = set(files)
    return tuple(imp for module, path in files.items() for imp in imports_of(module, path, modules))


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def cycles(edges: dict[str, set[str]]) -> list[tuple[list[str], set[str]]]:
    """Per strongly connected component of more than one module (Tarjan's algorithm): a
    shortest cycle through its first module, and all its modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [(cycle_in(component, edges), component) for component in components]


def cycle_in(component: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges.get(v, set()) & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def report(bad: list[Import]) -> str:
    return "\n".join(f"{imp.where()}: imports {imp.target} {list(imp.names)}" for imp in bad)


# ---- the rules --------------------------------------------------------------------------
LAYERS: tuple[tuple[str, frozenset[str]], ...] = tuple(
    (name, frozenset(members.split()))
    for name, members in (
        (
            "foundations",
            "wire security seeds metrics report background balance config liveness elastic "
            "elastic_signals",
        ),
        ("transport", "transport process_groups"),
        ("models and data", "models logprobs chat_tokenizers shapes random_models tasks image"),
        ("engines", "engine interfaces serving"),
        ("weights", "weights"),
        ("buffer", "buffer"),
        ("rollout", "episodes envs generator sim"),
        ("trainer", "algorithms trainer"),
        ("RL loop", "loop"),
        ("stages", "stages evaluation"),
        ("launcher", "launcher"),
    )
)
"""``asyncrl``'s top-level modules and packages by layer, bottom first."""


def top(module: str) -> str:
    """The top-level module or package of ``asyncrl`` a module belongs to."""
    return module.split(".")[1] if module.count(".") else module


def layer_of(module: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        if top(module) in members:
            return index
    raise AssertionError(f"{module} is in no layer of LAYERS: add {top(module)!r} to one")


def upward(imports) -> list[Import]:
    return [
        imp
        for imp in imports
        if imp.importer != "asyncrl" and layer_of(imp.target) > layer_of(imp.importer)
    ]


def test_no_module_imports_from_a_layer_above_its_own():
    bad = upward(all_imports())
    listing = "\n".join(
        f"{imp.where()}: {imp.importer} ({LAYERS[layer_of(imp.importer)][0]}) imports "
        f"{imp.target} ({LAYERS[layer_of(imp.target)][0]})"
        for imp in bad
    )
    assert not bad, f"imports from a layer above:\n{listing}"


def test_the_layer_rule_sees_an_upward_import(tmp_path):
    """An upward import added to a module (here, the buffer importing a stage, inside a
    function) is caught."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from asyncrl.stages import rl\n")
    added = imports_of("asyncrl.buffer.probe", path, set(module_files()))
    assert [imp.target for imp in upward(added)] == ["asyncrl.stages.rl"]


def test_every_module_is_in_a_layer():
    for module in module_files():
        if module != "asyncrl":
            layer_of(module)


def test_below_the_stages_no_function_takes_the_whole_experiment():
    """A parameter typed as a stage's experiment, or a config parameter (``cfg``,
    ``config``, ``experiment``) left untyped or typed ``Any``."""
    stages = next(i for i, (name, _) in enumerate(LAYERS) if name == "stages")
    experiments = {"RLExperiment", "SFTExperiment", "DPOExperiment", "RewardModelExperiment"}
    names = {"cfg", "config", "experiment"}
    bad = []
    for module, path in module_files().items():
        if module in ("asyncrl", "asyncrl.config") or layer_of(module) >= stages:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                kind = ast.unparse(arg.annotation).strip("'\"") if arg.annotation else None
                untyped = arg.arg in names and kind in (None, "Any", "object")
                if kind in experiments or untyped:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    bad.append(f"{where}: {node.name}({arg.arg}: {kind})")
    assert not bad, "takes the whole experiment or an untyped config:\n" + "\n".join(bad)


def test_no_cycles_between_packages():
    edges: dict[str, set[str]] = {}
    for imp in all_imports():
        a, b = top(imp.importer), top(imp.target)
        if imp.importer != "asyncrl" and a != b:
            edges.setdefault(a, set()).add(b)
    found = [" -> ".join(cycle) for cycle, _ in cycles(edges)]
    assert not found, "import cycles between asyncrl's packages:\n" + "\n".join(found)


PROBE = """
from typing import TYPE_CHECKING

import asyncrl.buffer.server as server

if TYPE_CHECKING:
    from asyncrl.wire import Chunk


def f():
    from . import core
    from .core import _private
"""


def test_the_reader_sees_every_kind_of_import(tmp_path):
    """Top-level, ``TYPE_CHECKING`` and function-level imports, relative ones resolved, a
    submodule taken by ``from … import`` named as itself; and the real graph is not empty,
    so the rules below cannot pass on nothing."""
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    modules = set(module_files())
    got = {(i.target, i.names) for i in imports_of("asyncrl.buffer.probe", path, modules)}
    assert got == {
        ("asyncrl.buffer.server", ()),
        ("asyncrl.wire", ("Chunk",)),
        ("asyncrl.buffer.core", ()),
        ("asyncrl.buffer.core", ("_private",)),
    }
    assert {"asyncrl.wire", "asyncrl.buffer", "asyncrl.buffer.core"} <= modules
    assert len(all_imports()) > 100


def test_no_import_cycles():
    edges: dict[str, set[str]] = {}
    for imp in all_imports():
        if imp.target != imp.importer:
            edges.setdefault(imp.importer, set()).add(imp.target)
    found = [
        " -> ".join(cycle) + (f"  (one of: {', '.join(sorted(c))})" if len(c) > 2 else "")
        for cycle, c in cycles(edges)
    ]
    where = [
        imp.where() + f": {imp.importer} imports {imp.target}"
        for imp in all_imports()
        if any(imp.importer in c and imp.target in c for _, c in cycles(edges))
    ]
    listing = "\n".join(found + ["imports within them:"] + where)
    assert not found, f"import cycles between asyncrl modules:\n{listing}"


def test_the_buffer_imports_nothing_from_its_clients():
    clients = ("asyncrl.trainer", "asyncrl.stages", "asyncrl.generator")
    bad = [
        imp
        for imp in all_imports()
        if within(imp.importer, "asyncrl.buffer") and any(within(imp.target, c) for c in clients)
    ]
    assert not bad, "the buffer imports from its clients:\n" + report(bad)


def test_stages_import_no_process_internals():
    internals = ("asyncrl.generator.worker", "asyncrl.buffer.server")
    bad = [
        imp
        for imp in all_imports()
        if within(imp.importer, "asyncrl.stages") and any(within(imp.target, m) for m in internals)
    ]
    assert not bad, "a stage imports a process's internals:\n" + report(bad)


def test_no_module_imports_another_modules_private_names():
    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    bad = [
        imp
        for imp in all_imports()
        if imp.target != imp.importer
        and (
            any(private(n) for n in imp.names)
            or any(private(part) for part in imp.target.split("."))
        )
    ]
    assert not bad, "private names imported across modules:\n" + report(bad)


def tracked_python_files() -> list[Path]:
    """The repository's tracked ``.py`` files (every one under the root, less the virtual
    environment and run outputs, where git is not there to ask)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", "*.py"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        return [ROOT / name for name in listed.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", "runs", ".git", "build"}
        return [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]


def test_fmt_skip_stays_rare():
    places = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in tracked_python_files()
        if path.exists()
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if FMT_SKIP in line
    ]
    listing = "\n".join(places)
    assert len(places) <= MAX_FMT_SKIPS, f"{len(places)} uses of {FMT_SKIP!r}:\n{listing}"
