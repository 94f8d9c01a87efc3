"""Experiment configs: dataclasses, overrides, loading and saving.

Each component owns a config dataclass beside its code (``ModelConfig`` in
``asyncrl.models``, ``TaskConfig`` in ``asyncrl.tasks``, ``TrainerConfig`` in
``asyncrl.trainer.config`` …) with a docstring under every field. An experiment is a
Python file in ``experiments/`` that builds one top-level config and names it ``config``;
the launcher loads it, applies ``key.sub=value`` overrides parsed into each field's type,
calls ``finalize()`` (where derived values are computed, in one place), and saves the
result as JSON in the run directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message names the key."""


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def flat_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every settable dotted key of a config tree, e.g. ``trainer.lr``."""
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if _is_dataclass_instance(value):
            keys.extend(flat_keys(value, key + "."))
        else:
            keys.append(key)
    return keys


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def parse_value(text: str, tp: Any) -> Any:
    """Parse an override string into the annotated type ``tp``; raises ValueError."""
    origin = get_origin(tp)
    if tp is Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if type(None) in options and text.strip().lower() in ("none", "null"):
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return parse_value(text, option)
            except ValueError:
                continue
        raise ValueError(text)
    if origin is Literal:
        for choice in get_args(tp):
            if str(choice) == text:
                return choice
        raise ValueError(text)
    if origin in (list, tuple, dict) or tp in (list, tuple, dict):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            if origin in (list, tuple) and not text.strip().startswith("["):
                # Convenience: a,b,c for a list of strings or numbers.
                value = [part.strip() for part in text.split(",")]
            else:
                raise ValueError(text) from e
        expected = dict if (origin or tp) is dict else (list, tuple)
        if not isinstance(value, expected):
            raise ValueError(text)
        args = get_args(tp)
        if origin in (list, tuple) and args and args[0] is not Any:
            value = [parse_value(str(v) if not isinstance(v, str) else v, args[0]) for v in value]
        return tuple(value) if origin is tuple else value
    if tp is bool:
        return _parse_bool(text)
    if tp is int:
        return int(text)
    if tp is float:
        return float(text)
    if tp is str:
        return text
    raise ValueError(f"unsupported field type {_type_name(tp)}")


def _field_types(cfg: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(cfg))


def _suggest(key: str, cfg: Any) -> str:
    valid = flat_keys(cfg)
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    if not close:
        # Fall back to keys sharing the last component or the section.
        last = key.rsplit(".", 1)[-1]
        close = [k for k in valid if k.rsplit(".", 1)[-1] == last][:3]
    return ", ".join(close) if close else ", ".join(valid[:8]) + ", ..."


def _refuse_renamed(cls: type, name: str, prefix: str) -> None:
    """Raise ConfigError naming the key that replaced ``name``, if the config class lists
    it in its ``RENAMED`` (old field name → new one)."""
    new = getattr(cls, "RENAMED", {}).get(name)
    if new is not None:
        raise ConfigError(
            f"config key '{prefix}{name}' is gone: use '{prefix}{new}' "
            f"(the docstring of {cls.__name__}.{new} says how it differs)"
        )


def set_override(cfg: Any, key: str, text: str) -> None:
    """Set ``key`` (dotted) on the config tree ``cfg`` from its string form ``text``."""
    parts = key.split(".")
    node = cfg
    for i, name in enumerate(parts):
        if _is_dataclass_instance(node):
            names = {f.name for f in dataclasses.fields(node)}
            if name not in names:
                _refuse_renamed(type(node), name, "".join(p + "." for p in parts[:i]))
                raise ConfigError(
                    f"unknown config key '{key}'; closest valid keys: {_suggest(key, cfg)}"
                )
            tp = _field_types(node)[name]
            if i == len(parts) - 1:
                if _is_dataclass_instance(getattr(node, name)):
                    raise ConfigError(
                        f"config key '{key}' is a section; set one of its fields, e.g. "
                        f"{', '.join(flat_keys(getattr(node, name), key + '.')[:3])}"
                    )
                try:
                    value = parse_value(text, tp)
                except ValueError:
                    raise ConfigError(
                        f"cannot parse '{text}' for config key '{key}': expected {_type_name(tp)}"
                    ) from None
                setattr(node, name, value)
                return
            node = getattr(node, name)
        elif isinstance(node, dict):
            # A free-form dict field (e.g. a dataset's kwargs): the rest of the key is one entry.
            sub = ".".join(parts[i:])
            node[sub] = parse_value(text, Any)
            return
        else:
            raise ConfigError(
                f"unknown config key '{key}'; closest valid keys: {_suggest(key, cfg)}"
            )


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Apply ``key=value`` strings in order; the first bad one raises ConfigError."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, text = item.split("=", 1)
        set_override(cfg, key.strip(), text)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a config tree from ``to_dict`` output (as saved in the run directory)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = from_dict(tp, value)
        elif get_origin(tp) is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    for name in sorted(unknown):
        _refuse_renamed(cls, name, "")
    if unknown:
        raise ConfigError(f"unknown keys for {cls.__name__}: {sorted(unknown)}")
    return cls(**kwargs)


def save_json(cfg: Any, path: str | Path) -> None:
    data = {"__class__": f"{type(cfg).__module__}.{type(cfg).__qualname__}", **to_dict(cfg)}
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def load_json(path: str | Path) -> Any:
    """Load a config saved by ``save_json``; the class is recorded in the file."""
    data = json.loads(Path(path).read_text())
    module_name, _, qualname = data.pop("__class__").rpartition(".")
    module = importlib.import_module(module_name)
    return from_dict(getattr(module, qualname), data)


def load_experiment(path: str | Path) -> Any:
    """Import an experiment file and return its ``config`` object (a fresh copy each call)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"asyncrl_experiment_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "config"):
        raise ConfigError(f"{path} defines no 'config'")
    return module.config
