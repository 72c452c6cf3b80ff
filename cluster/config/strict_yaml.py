"""Frozen dataclasses built strictly from plain YAML data (dicts, lists, scalars), so that a
typo or a wrong type in a deployment YAML is an error naming its key path, never a default
silently kept: unknown keys, missing required keys and values of the wrong type raise
``ConfigError`` (``models[0].deployment_config.replicas: unknown key (known keys: ...)``).

The YAML itself is read by ``load_yaml_file``, which refuses a key given twice in one mapping
(PyYAML's loaders keep the last, so a duplicated ``engine_kwargs`` block would silently replace
the first).

Types are read from the fields' annotations: a dataclass (built recursively), ``list[X]``,
``dict[...]`` (copied as is), ``X | None``, ``X | Section`` (a mapping builds the section),
``Literal[...]``, ``bool``, ``int``, ``float`` (an integer is widened) and ``str``. Ranges are
not checked here but by each section's ``check(path)`` afterwards, with ``engine.validation``'s
helpers and message format.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from engine.errors import ConfigError
from engine.validation import check_bool, check_choice, check_int, check_number, check_str, require


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping key given twice raises ``ConfigError``
    naming the key and both lines. Keys merged in with ``<<`` may still be overridden."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    earlier = first_line.get(key)
                except TypeError:
                    continue  # an unhashable key: SafeLoader's own error below
                if earlier is not None:
                    raise ConfigError(
                        f"line {line}: key {key!r} given twice (first at line {earlier}); "
                        "the second would silently replace the first"
                    )
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml_file(path: str | os.PathLike[str]) -> Any:
    """The plain data of a YAML file; a missing file, invalid YAML or a key given twice in a
    mapping raise ``ConfigError`` naming the file (and the lines)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        loader = _UniqueKeyLoader(path.read_text())  # what yaml.load does, with this loader
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def build_dataclass(cls: type, data: Any, path: str = "") -> Any:
    """Strictly build dataclass ``cls`` from plain YAML data: unknown keys, missing keys and
    wrong types raise ``ConfigError`` naming the key path."""
    where = path or "config"
    require(isinstance(data, dict), where, f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            known = ", ".join(fields)
            raise ConfigError(f"{_join(path, str(key))}: unknown key (known keys: {known})")
    values = {}
    for name, f in fields.items():
        key_path = _join(path, name)
        if name in data:
            values[name] = _convert(hints[name], data[name], key_path)
        else:
            no_default = (
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            )
            require(not no_default, key_path, "is required")
    try:
        return cls(**values)
    except ConfigError as exc:  # a section that checks itself names its keys, not their path
        if not path or str(exc).startswith(path):
            raise
        raise ConfigError(f"{path}.{exc}") from None


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        # ``str | Section``: a mapping builds the section, anything else the other member.
        sections = [a for a in members if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and sections:
            return build_dataclass(sections[0], value, path)
        inner = next((a for a in members if not dataclasses.is_dataclass(a)), members[0])
        return _convert(inner, value, path)
    if origin is Literal:
        check_choice(value, path, args)
        return value
    if origin in (list, collections.abc.Sequence):
        require(isinstance(value, list), path, f"must be a list, got {type(value).__name__}")
        return [_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        require(isinstance(value, dict), path, f"must be a mapping, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, path)
    return _scalar(hint, value, path)


def _scalar(hint: Any, value: Any, path: str) -> Any:
    if hint is bool:
        check_bool(value, path)
    elif hint is int:
        check_int(value, path)
    elif hint is float:
        check_number(value, path)
        return float(value)
    elif hint is str:
        check_str(value, path)
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
