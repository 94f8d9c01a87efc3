"""sglang's own route table and request types, read from the source files of its released
wheels (``tools/sglang_wheels.sh`` fetches them): what ``test_sglang_wheels.py`` checks
asyncrl's calls against. sglang's modules do not import without triton and a torchvision
built for the exact torch, so the files are parsed (``ast``), never imported:

- ``srt/entrypoints/http_server.py``: every ``@app.get/post/put/delete/api_route(path)``
  handler, its methods, and the request struct it parses (its first parameter's type,
  ``Annotated[Struct, Body()]`` from 0.5.20);
- ``srt/managers/io_struct.py``: each class's annotated fields, its bases' first (a
  dataclass in 0.5.10, a ``msgspec.Struct`` from 0.5.20; both declare fields alike), and
  whether each has a default;
- ``srt/sampling/sampling_params.py``: ``SamplingParams``' keys (its ``__init__``'s
  parameters in 0.5.10, its fields from 0.5.20), which sglang builds with
  ``SamplingParams(**sampling_params)``.

``problems`` then says what in a JSON body does not fit a struct: an unknown key, a
required field missing, a value of the wrong JSON type (where the annotation says).
"""

from __future__ import annotations

import ast
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "sglang_wheels.sh"
CACHE = Path(os.environ.get("SGLANG_WHEELS_DIR") or ROOT / ".sglang-wheels")
PINNED = ("0.5.10", "0.5.20", "0.5.21", "0.5.23")
"""The releases checked: the oldest pinned, the last before weight-update sessions, the
first with them, the newest supported."""
REQUIRED = os.environ.get("ASYNCRL_REQUIRE_SGLANG_WHEELS") == "1"
"""Set in CI: a wheel that cannot be fetched fails the tests instead of skipping them."""
_fetch_failure: list[str] = []


@dataclass
class Field:
    required: bool
    annotation: ast.expr | None


@dataclass
class Release:
    """One sglang release, as its wheel's source declares it."""

    version: str
    routes: dict[str, set[str]] = field(default_factory=dict)
    """Methods of each path."""
    bodies: dict[str, str] = field(default_factory=dict)
    """The struct each path's handler parses its body into, where it takes one."""
    structs: dict[str, dict[str, Field]] = field(default_factory=dict)
    sampling: dict[str, Field] = field(default_factory=dict)
    """``SamplingParams``' keys."""

    def serves(self, method: str, path: str) -> bool:
        return method in self.routes.get(path, set())

    def body_problems(self, path: str, body: dict) -> list[str]:
        """What in ``body`` does not fit the struct ``path`` parses (none: no struct)."""
        struct = self.bodies.get(path)
        return problems(body, self.structs[struct], struct) if struct else []


def release(version: str) -> Release:
    """The parsed release ``version``; fetched first when it is not cached (skipped when
    that fails, unless ``ASYNCRL_REQUIRE_SGLANG_WHEELS=1``)."""
    folder = CACHE / f"sglang-{version}"
    if not (folder / "SOURCE").exists():
        _fetch()
    read = (folder / name for name in ("http_server.py", "io_struct.py", "sampling_params.py"))
    http_server, io_struct, sampling_params = (ast.parse(path.read_text()) for path in read)
    out = Release(version, structs=_structs(io_struct))
    _routes(http_server, out)
    out.sampling = _sampling(sampling_params)
    return out


def _fetch() -> None:
    """Run the fetch script once per session for every pinned release."""
    if not _fetch_failure:
        env = {**os.environ, "SGLANG_WHEELS_DIR": str(CACHE), "SGLANG_VERSIONS": " ".join(PINNED)}
        try:
            done = subprocess.run(
                ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900
            )
            why = "" if done.returncode == 0 else " / ".join(done.stderr.splitlines()[-2:])
        except subprocess.TimeoutExpired:
            why = "timed out after 900 s"
        _fetch_failure.append(why)
    if _fetch_failure[0]:
        message = f"sglang's wheels could not be fetched ({SCRIPT.name}): {_fetch_failure[0]}"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)


def _literal(node: ast.expr):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _unwrap(annotation: ast.expr | None) -> ast.expr | None:
    """``X`` of ``Annotated[X, ...]``, else the annotation itself."""
    if isinstance(annotation, ast.Subscript) and _name(annotation.value) == "Annotated":
        first = annotation.slice.elts[0] if isinstance(annotation.slice, ast.Tuple) else None
        return first
    return annotation


def _name(node: ast.expr | None) -> str:
    """The last name of ``a.b.Name`` or ``Name``; "" otherwise."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _routes(tree: ast.Module, out: Release) -> None:
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)):
                continue
            kind, owner = deco.func.attr, _name(deco.func.value)
            if owner != "app" or kind not in ("get", "post", "put", "delete", "api_route"):
                continue
            path = _literal(deco.args[0]) if deco.args else None
            if not isinstance(path, str):
                continue  # a path from the environment (ollama, vertex)
            methods = {kind.upper()}
            for keyword in deco.keywords:
                if keyword.arg == "methods":
                    methods = set(_literal(keyword.value))
            out.routes.setdefault(path, set()).update(methods)
            for arg in node.args.args:
                struct = _name(_unwrap(arg.annotation))
                if struct in out.structs:
                    out.bodies[path] = struct
                    break


def _fields(body: list[ast.stmt]) -> dict[str, Field]:
    """Annotated fields of a class body (not ``ClassVar``s nor dataclasses' ``KW_ONLY``)."""
    out = {}
    for stmt in body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        kind = _name(
            stmt.annotation.value if isinstance(stmt.annotation, ast.Subscript) else stmt.annotation
        )
        if kind in ("ClassVar", "KW_ONLY"):
            continue
        out[stmt.target.id] = Field(_no_default(stmt.value), stmt.annotation)
    return out


def _no_default(value: ast.expr | None) -> bool:
    """Whether a field declared ``= value`` has no default (``field()`` without one)."""
    if value is None:
        return True
    if isinstance(value, ast.Call) and _name(value.func) == "field":
        return not {k.arg for k in value.keywords} & {"default", "default_factory"}
    return False


def _structs(tree: ast.Module) -> dict[str, dict[str, Field]]:
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    out: dict[str, dict[str, Field]] = {}

    def fields_of(name: str) -> dict[str, Field]:
        if name not in out:
            inherited: dict[str, Field] = {}
            for base in classes[name].bases:
                if _name(base) in classes:
                    inherited |= fields_of(_name(base))
            out[name] = inherited | _fields(classes[name].body)
        return out[name]

    for name in classes:
        fields_of(name)
    return out


def _sampling(tree: ast.Module) -> dict[str, Field]:
    (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    init = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    if not init:
        return _fields(cls.body)
    args = init[0].args
    positional = args.args[1:]  # after self
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = {a.arg: Field(d is None, a.annotation) for a, d in zip(positional, defaults)}
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out[a.arg] = Field(d is None, a.annotation)
    return out


def problems(body: dict, fields: dict[str, Field], where: str) -> list[str]:
    """What in ``body`` does not fit ``fields`` (a struct's, or ``SamplingParams``')."""
    found = [f"{where}: no field {key!r}" for key in body if key not in fields]
    found += [
        f"{where}: required field {name!r} missing"
        for name, spec in fields.items()
        if spec.required and name not in body
    ]
    found += [
        f"{where}.{key}={value!r:.60} does not fit {ast.unparse(fields[key].annotation)}"
        for key, value in body.items()
        if key in fields and not fits(value, fields[key].annotation)
    ]
    return found


_SCALARS = {
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
}
_SEQUENCES = {"List", "list", "Set", "set", "Sequence", "Tuple", "tuple", "FrozenSet"}


def fits(value, annotation: ast.expr | None) -> bool:
    """Whether a JSON ``value`` fits a type annotation: the scalars, ``None``,
    ``Optional``/``Union``/``|``, sequences, dicts, ``Literal`` and ``Annotated``;
    anything else (sglang's own classes, ``Any``) is taken to fit."""
    if annotation is None:
        return True
    if isinstance(annotation, ast.Constant):
        if isinstance(annotation.value, str):  # a forward reference
            return fits(value, ast.parse(annotation.value, mode="eval").body)
        return value is None if annotation.value is None else True
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return fits(value, annotation.left) or fits(value, annotation.right)
    if isinstance(annotation, ast.Subscript):
        return _fits_generic(value, _name(annotation.value), annotation.slice)
    check = _SCALARS.get(_name(annotation))
    return check(value) if check else True


def _fits_generic(value, kind: str, args: ast.expr) -> bool:
    items = args.elts if isinstance(args, ast.Tuple) else [args]
    if kind == "Optional":
        return value is None or fits(value, items[0])
    if kind == "Union":
        return any(fits(value, item) for item in items)
    if kind == "Annotated":
        return fits(value, items[0])
    if kind == "Literal":
        return value in [_literal(item) for item in items]
    if kind in _SEQUENCES:
        return isinstance(value, list) and all(fits(v, items[0]) for v in value)
    if kind in ("Dict", "dict", "Mapping"):
        return isinstance(value, dict) and all(fits(v, items[-1]) for v in value.values())
    return True
