"""What a ``structured_outputs.json`` schema may use: the keywords the grammar (xgrammar's JSON
schema converter) enforces. A schema that is not a valid JSON Schema, or that relies on a
keyword the converter would drop, is refused naming the keyword and where it is (a JSON
pointer), so no output is ever checked against a looser schema than the client sent.

Refused, because the grammar would accept documents the schema rejects:
- ``not``, ``if`` / ``then`` / ``else``, ``contains`` (and ``minContains`` / ``maxContains``),
  ``dependentRequired``, ``dependentSchemas``, ``dependencies``, ``uniqueItems: true``;
- ``allOf`` of more than one schema;
- ``multipleOf`` other than a whole number on integers (on numbers, or a fractional one);
- ``oneOf`` whose branches may overlap (it is enforced as ``anyOf``): accepted when the
  branches' types are disjoint, or every branch is an object requiring one property whose
  ``const`` / ``enum`` values differ between branches (a discriminated union);
- a string's ``pattern`` or ``format`` together with ``minLength`` / ``maxLength``;
- ``required`` naming a property that ``properties`` does not define.
Not refused: ``format`` is enforced by xgrammar's own patterns, which differ from a JSON Schema
validator's at the edges (``ipv4`` takes leading zeros, ``date-time`` any second 60).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from engine.errors import InvalidRequestError

_PARAM = "structured_outputs.json"
_DROPPED = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
# Keywords whose value is one subschema, or a list or a name -> subschema map of them.
_ONE = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems", "not", "if", "then", "else", "contains")  # fmt: skip
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_TYPES = ("null", "boolean", "object", "array", "number", "string")


def check_json_schema(schema: Any) -> None:
    """Raise ``InvalidRequestError`` (param ``structured_outputs.json``) if ``schema`` is not a
    valid JSON Schema or uses what the grammar cannot enforce (see the module docstring)."""
    if schema is False:
        raise _refuse("", "the schema false matches no document")
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/" + "/".join(str(p) for p in exc.path) if exc.path else ""
        raise _refuse(where, f"is not a valid JSON Schema: {exc.message}") from None
    for where, node in _subschemas(schema, ""):
        _check_node(schema, where, node)


def _refuse(where: str, reason: str) -> InvalidRequestError:
    at = f"at {where}: " if where else ""
    return InvalidRequestError(at + reason, param=_PARAM)


def _subschemas(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in ``node`` with its JSON pointer (booleans have no keywords)."""
    if not isinstance(node, dict):
        return
    yield where, node
    for key in _ONE:
        if key in node:
            yield from _subschemas(node[key], f"{where}/{key}")
    for key in _LIST:
        for i, child in enumerate(node.get(key) or ()):
            yield from _subschemas(child, f"{where}/{key}/{i}")
    for key in _MAP:
        for name, child in (node.get(key) or {}).items():
            yield from _subschemas(child, f"{where}/{key}/{_escape(name)}")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _check_node(root: dict[str, Any] | bool, where: str, node: dict[str, Any]) -> None:
    for key in _DROPPED:
        if key in node:
            raise _refuse(where, f"{key!r} is not enforced by the grammar")
    if node.get("uniqueItems") is True:
        raise _refuse(where, "'uniqueItems': true is not enforced by the grammar")
    if len(node.get("allOf") or ()) > 1:
        raise _refuse(where, "'allOf' of more than one schema is not enforced by the grammar")
    if "multipleOf" in node:
        step = node["multipleOf"]
        if _types(node) != {"integer"} or not float(step).is_integer():
            raise _refuse(where, "'multipleOf' is enforced only as a whole number on integers")
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        raise _refuse(
            where, "'minLength' / 'maxLength' with 'pattern' or 'format' is not enforced by the "
            "grammar (put the length in the pattern)"
        )  # fmt: skip
    _check_required(where, node)
    branches = node.get("oneOf") or ()
    if len(branches) > 1 and not _exclusive(root, branches):
        raise _refuse(
            where, "'oneOf' branches that may overlap are enforced only as 'anyOf': use "
            "'anyOf', or make the branches exclusive (distinct types, or a required property "
            "with a different 'const' in each)"
        )  # fmt: skip


def _check_required(where: str, node: dict[str, Any]) -> None:
    missing = [n for n in node.get("required") or () if n not in (node.get("properties") or {})]
    if missing:
        raise _refuse(
            where, f"'required' names {missing[0]!r}, which 'properties' does not define (the "
            "grammar enforces only the required properties it defines)"
        )  # fmt: skip


def _types(node: dict[str, Any]) -> set[str]:
    """The JSON types a schema node admits, as far as its own keywords say (all if none do)."""
    if "const" in node:
        return {_type_of(node["const"])}
    if "enum" in node:
        return {_type_of(v) for v in node["enum"]}
    declared = node.get("type")
    if declared is None:
        return {*_TYPES, "integer"}
    names = {declared} if isinstance(declared, str) else set(declared)
    return names | {"integer"} if "number" in names else names


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _resolve(root: Any, node: Any) -> Any:
    """``node`` with a local ``$ref`` ("#/...") followed; anything else as it is."""
    seen = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and seen < 32:
        ref = node["$ref"]
        if not ref.startswith("#"):
            return node
        target = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return node
            target = target[part]
        node, seen = target, seen + 1
    return node


def _exclusive(root: Any, branches: list[Any]) -> bool:
    """Whether no document can match two of ``branches``: disjoint types, or a required
    property whose const / enum values are disjoint between the branches."""
    nodes = [_resolve(root, b) for b in branches]
    if not all(isinstance(n, dict) for n in nodes):
        return False
    types = [_types(n) for n in nodes]
    if all(not (a & b) for a, b in itertools.combinations(types, 2)):
        return True
    if not all(t == {"object"} for t in types):
        return False
    shared = set.intersection(*(set(n.get("required") or ()) for n in nodes))
    for name in shared:
        values = [_values(_resolve(root, (n.get("properties") or {}).get(name))) for n in nodes]
        if all(v is not None for v in values) and all(
            not (a & b) for a, b in itertools.combinations(values, 2)
        ):
            return True
    return False


def _values(node: Any) -> set[str] | None:
    """The JSON texts a ``const`` / ``enum`` schema allows, or None for any other schema."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {json.dumps(node["const"], sort_keys=True)}
    if "enum" in node:
        return {json.dumps(v, sort_keys=True) for v in node["enum"]}
    return None
