"""The Helm chart's view of the deployment config: the JSON Schema of ``values.models`` and of
the config's other sections the chart passes verbatim (``values.sleepMode``, ``values.media``,
``values.responsesStore``), generated from the dataclasses ``cluster.config`` builds and the
engine's own argument table, so the chart accepts exactly what ``cluster deploy`` accepts (same
keys, same types; ranges and model-shape checks stay with ``load_config``, which Serve runs on
the cluster).

    python -m cluster.ops.kuberay helm/llm-cluster/values.schema.json    # rewrite those parts

The chart's RayService runs ``cluster.serving.serve:build_app`` as a Serve application builder:
Serve calls it with the ``args`` mapping of ``serveConfigV2``, which is a deployment config as a
dict.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from cluster.config import DeploymentConfig, ModelDeployment
from engine import config as engine_config

JSONSchema = dict[str, Any]

# values key -> the deployment config's section it is, passed into the app's args verbatim.
CONFIG_SECTIONS = {
    "sleepMode": "sleep_mode",
    "media": "media",
    "responsesStore": "responses_store",
}

_SCALARS: dict[type, JSONSchema] = {
    bool: {"type": "boolean"},
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
}


def models_schema() -> JSONSchema:
    """The schema of the ``models`` list: one item per ``ModelDeployment``."""
    return {
        "type": "array",
        "minItems": 1,
        "description": "The deployment config's model list (configs/*.yaml `models`), verbatim.",
        "items": _dataclass_schema(ModelDeployment),
    }


def section_schema(section: str) -> JSONSchema:
    """The schema of one of ``DeploymentConfig``'s sections (``sleep_mode``, ``media``, ...)."""
    schema = _type_schema(typing.get_type_hints(DeploymentConfig)[section])
    description = f"The deployment config's `{section}` (configs/*.yaml), verbatim; {{}}: defaults."
    return {**schema, "description": description}


def generated_schemas() -> dict[str, JSONSchema]:
    """Every part of the values schema this module owns: values key -> its schema."""
    parts = {"models": models_schema()}
    parts.update({key: section_schema(section) for key, section in CONFIG_SECTIONS.items()})
    return parts


def engine_kwargs_schema() -> JSONSchema:
    """Every engine argument but ``model`` (that one comes from ``model_loading_config``) and
    ``placement_group_strategy`` (a deployment's is ``placement_group_config.strategy``)."""
    hints = typing.get_type_hints(engine_config.EngineConfig)
    properties: dict[str, JSONSchema] = {}
    # The engine's keyword -> (sub-config, field) table is the single source of the names.
    for key, (group, name) in engine_config._ENGINE_ARGS.items():
        if key in ("model", "placement_group_strategy"):
            continue
        properties[key] = _type_schema(typing.get_type_hints(hints[group])[name])
        (spec,) = (f for f in dataclasses.fields(hints[group]) if f.name == name)
        if spec.metadata.get("any_case"):  # vLLM's spellings too (pooling_type: MEAN)
            properties[key] = _any_case(properties[key])
    return {"type": "object", "additionalProperties": False, "properties": properties}


def _any_case(schema: JSONSchema) -> JSONSchema:
    """A string enum's schema that takes its values in any case (a pattern: JSON Schema's
    regexes have no case-insensitive flag)."""
    words = ["".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in value)
             for value in schema["enum"]]  # fmt: skip
    return {"type": "string", "pattern": "^(" + "|".join(words) + ")$"}


def _dataclass_schema(cls: type) -> JSONSchema:
    hints = typing.get_type_hints(cls)
    properties: dict[str, JSONSchema] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name == "engine_kwargs":
            properties[f.name] = engine_kwargs_schema()
        else:
            properties[f.name] = _type_schema(hints[f.name])
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    schema: JSONSchema = {"type": "object", "additionalProperties": False}
    schema["properties"] = properties
    if required:
        schema["required"] = required
    return schema


def _type_schema(hint: Any) -> JSONSchema:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        members = [_type_schema(a) for a in args if a is not type(None)]
        if type(None) not in args:  # one of several forms (model_source: a string or a section)
            return {"anyOf": members}
        (schema,) = members
        if "type" in schema and isinstance(schema["type"], str):
            return {**schema, "type": [schema["type"], "null"]}
        return {"anyOf": [schema, {"type": "null"}]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (list, collections.abc.Sequence) or (
        origin is tuple and len(args) == 2 and args[1] is Ellipsis
    ):
        return {"type": "array", "items": _type_schema(args[0])}
    if dataclasses.is_dataclass(hint):
        return _dataclass_schema(hint)
    if origin is dict and args and args[1] is float:  # resource amounts (bundles)
        return {"type": "object", "additionalProperties": {"type": "number"}}
    if origin is dict:  # free-form fields (hf_overrides): config.json's own keys
        return {"type": "object"}
    if hint in _SCALARS:
        return dict(_SCALARS[hint])
    raise TypeError(f"no JSON Schema for config type {hint!r}")


def write_generated_schemas(values_schema: Path) -> bool:
    """Rewrite the generated parts of the chart's values schema; True when it changed."""
    schema = json.loads(values_schema.read_text())
    properties = schema["properties"]
    generated = generated_schemas()
    if all(properties.get(key) == part for key, part in generated.items()):
        return False
    properties.update(generated)
    values_schema.write_text(json.dumps(schema, indent=2) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m cluster.ops.kuberay helm/llm-cluster/values.schema.json")
        return 2
    changed = write_generated_schemas(Path(args[0]))
    print(f"{args[0]}: {'updated' if changed else 'already up to date'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
