"""What a ``structured_outputs.json`` schema may use: the keywords the grammar (xgrammar's JSON
schema converter) enforces. A schema that is not a valid JSON Schema, or that relies on a
keyword the converter would drop, is refused naming the keyword and where it is (a JSON
pointer), so no output is ever checked against a looser schema than the client sent.

Refused, because the grammar would accept documents the schema rejects:
- ``not``, ``if``/``then``/``else``, ``contains`` (``minContains``/``maxContains``),
  ``dependentRequired``, ``dependentSchemas``, ``dependencies``, ``uniqueItems: true``,
  an ``allOf`` of several schemas, ``multipleOf`` other than whole on integers;
- ``oneOf`` whose branches may overlap (enforced as ``anyOf``): accepted when the branches'
  types are disjoint, or they are a discriminated union (one required property whose
  ``const``/``enum`` values differ);
- ``pattern`` or ``format`` with ``minLength``/``maxLength``; ``required`` outside ``properties``;
  ``patternProperties`` / ``propertyNames`` beside ``properties``; a draft-03 schema (its
  ``required: true``, ``divisibleBy``, ``disallow``, ``extends`` are not read);
- an assertion beside ``$ref``, ``anyOf``, ``oneOf``, ``allOf``, ``enum`` or ``const`` (compiled
  from that one keyword); annotations, ``$defs`` and a ``type`` every value or branch has pass,
  as pydantic writes them;
- a ``$ref`` that is not a local JSON pointer, or under a nested ``$id``; ``$dynamicRef``,
  ``$recursiveRef`` (every local ``$ref``'s target is checked like the rest, wherever it is);
- a ``pattern`` (or ``patternProperties`` name) with a literal ``"``, ``\\`` or control
  character outside a class: the grammar would write it unescaped (invalid JSON).
Not refused: ``format``, enforced by xgrammar's own patterns, which differ from a validator's
at the edges (``ipv4`` takes leading zeros, ``date-time`` any second 60)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft3Validator, validator_for

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
# A node with one of these is compiled from it alone (the first, if several), its siblings
# dropped; annotations and keywords no validator reads (``discriminator``, ``x-...``) are
# harmless beside them, these are not.
_EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_ASSERTIONS = frozenset({
    *_EXCLUSIVE, "type", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "items", "prefixItems",
    "additionalItems", "maxItems", "minItems", "unevaluatedItems", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "required", "maxProperties",
    "minProperties", "unevaluatedProperties",
})  # fmt: skip


def check_json_schema(schema: Any) -> None:
    """Raise ``InvalidRequestError`` (param ``structured_outputs.json``) if ``schema`` is not a
    valid JSON Schema or uses what the grammar cannot enforce (see the module docstring)."""
    if schema is False:
        raise _refuse("", "the schema false matches no document")
    if isinstance(schema, dict) and not isinstance(schema.get("$schema", ""), str):
        raise _refuse("/$schema", "is not a valid JSON Schema: '$schema' must be a URI string")
    if validator_for(schema) is Draft3Validator:
        raise _refuse("/$schema", "a draft-03 schema is not enforced by the grammar (write it "
                      "as draft 4 or later)")  # fmt: skip
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/" + "/".join(str(p) for p in exc.path) if exc.path else ""
        raise _refuse(where, f"is not a valid JSON Schema: {exc.message}") from None
    for where, node in _walk(schema):
        _check_node(schema, where, node)


def _refuse(where: str, reason: str) -> InvalidRequestError:
    at = f"at {where}: " if where else ""
    return InvalidRequestError(at + reason, param=_PARAM)


def _walk(root: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object the grammar compiles, once each: those under the root's keywords,
    then those under each local ``$ref``'s target wherever it is (OpenAPI keeps its schemas
    under ``components/schemas``; xgrammar follows any local pointer)."""
    walked: set[str] = set()
    pending: list[tuple[str, Any]] = [("", root)]
    while pending:
        start, subtree = pending.pop()
        for where, node in _subschemas(subtree, start):
            if where in walked:
                continue
            walked.add(where)
            yield where, node
            target = _ref_target(root, node.get("$ref"))
            if target is not None and target[0] not in walked:
                pending.append(target)


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
    _check_reference(root, where, node)
    _check_siblings(root, where, node)
    _check_patterns(where, node)
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
    beside = [k for k in ("patternProperties", "propertyNames") if k in node]
    if beside and "properties" in node:
        raise _refuse(where, f"{beside[0]!r} beside 'properties' is not enforced by the grammar")
    branches = node.get("oneOf") or ()
    if len(branches) > 1 and not _exclusive(root, branches):
        raise _refuse(
            where, "'oneOf' branches that may overlap are enforced only as 'anyOf': use "
            "'anyOf', or make the branches exclusive (distinct types, or a required property "
            "with a different 'const' in each)"
        )  # fmt: skip


def _check_reference(root: Any, where: str, node: dict[str, Any]) -> None:
    for key in ("$dynamicRef", "$recursiveRef"):
        if key in node:
            raise _refuse(
                where, f"{key!r} is not enforced by the grammar (only local JSON-pointer "
                "references: '$ref': '#/...')"
            )  # fmt: skip
    ref = node.get("$ref")
    if isinstance(ref, str) and not _is_local(ref):
        raise _refuse(
            where, f"'$ref' {ref!r} is not enforced by the grammar (only local JSON-pointer "
            "references: '#' or '#/...')"
        )  # fmt: skip
    resource = _embedding_resource(root, where) if isinstance(ref, str) else None
    if resource is not None:
        raise _refuse(
            where, f"'$ref' {ref!r} is inside the schema with an '$id' at {resource or '/'}, "
            "which JSON Schema resolves it against, but the grammar resolves it from the root: "
            "write it as a pointer from the root and drop that '$id'"
        )  # fmt: skip


def _embedding_resource(root: Any, where: str) -> str | None:
    """The pointer of the innermost schema below the root, on the way to ``where`` (itself
    included), that starts a resource of its own (an ``$id`` that is not a bare fragment, as
    draft 7's anchors are); None when there is none."""
    node, path, found = root, "", None
    for part in where.split("/")[1:]:
        name = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(name)
        elif isinstance(node, list) and name.isdigit() and int(name) < len(node):
            node = node[int(name)]
        else:
            return found
        path += "/" + part
        resource_id = node.get("$id") if isinstance(node, dict) else None
        if isinstance(resource_id, str) and not resource_id.startswith("#"):
            found = path
    return found


def _check_siblings(root: Any, where: str, node: dict[str, Any]) -> None:
    """Refuse an assertion beside the keyword the converter compiles the node from alone; a
    ``type`` that every value or branch already has changes nothing and is allowed."""
    own = next((key for key in _EXCLUSIVE if key in node), None)
    if own is None:
        return
    for key in node:
        if key == own or key not in _ASSERTIONS:
            continue
        if key == "type" and _admitted_types(root, node) <= _types({"type": node["type"]}):
            continue
        if own == "$ref":
            fix = "move it into the referenced schema"
        elif own in ("enum", "const"):
            fix = f"keep only the values it allows in {own!r}"
        else:
            fix = f"move it into each schema of {own!r}"
        raise _refuse(
            where, f"{key!r} beside {own!r} is not enforced by the grammar (it compiles the "
            f"node from {own!r} alone): {fix}"
        )  # fmt: skip


def _admitted_types(root: Any, node: dict[str, Any]) -> set[str]:
    """The JSON types the keyword a node is compiled from (``_EXCLUSIVE``) admits."""
    if "$ref" in node:
        branches = [node]
    elif "const" in node or "enum" in node:
        return _types(node)
    else:
        branches = node.get("anyOf") or node.get("oneOf") or node.get("allOf") or ()
    admitted: set[str] = set()
    for branch in branches:
        target = _resolve(root, branch)
        admitted |= _types(target) if isinstance(target, dict) else {*_TYPES, "integer"}
    return admitted


def _check_patterns(where: str, node: dict[str, Any]) -> None:
    regexes = [("'pattern'", node.get("pattern"))]
    regexes += [(f"'patternProperties' name {name!r}", name) for name in
                node.get("patternProperties") or {}]  # fmt: skip
    for what, regex in regexes:
        literal = _unescaped_literal(regex) if isinstance(regex, str) else None
        if literal is not None:
            raise _refuse(
                where, f"{what} matches {literal!r} outside a character class, which the "
                "grammar would write unescaped (invalid JSON): a pattern may not match '\"', "
                "'\\' or a control character U+0000-U+001F"
            )  # fmt: skip


def _unescaped_literal(regex: str) -> str | None:
    r"""The first atom of ``regex`` outside a character class that matches a character a JSON
    string must escape (``"``, ``\``, U+0000-U+001F), as written; None if there is none.
    xgrammar writes a pattern's literals into the string as they are, but leaves those
    characters out of classes, ``.`` and ``\D``-like escapes."""
    i, in_class = 0, False
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            atom = _escape_atom(regex, i)
            i += len(atom)
            if not in_class and _json_escaped(atom):
                return atom
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == '"' or ord(char) < 0x20:
            return char
        i += 1
    return None


def _escape_atom(regex: str, start: int) -> str:
    r"""The escape sequence at ``regex[start]`` (a backslash): ``\xHH``, ``\uHHHH``, ``\cX``
    or a backslash and one character."""
    kind = regex[start + 1 : start + 2]
    digits = {"x": 2, "u": 4, "c": 1}.get(kind, 0)
    return regex[start : start + 2 + digits]


def _json_escaped(atom: str) -> bool:
    """Whether the escape ``atom`` matches a character JSON escapes in strings."""
    kind = atom[1:2]
    if kind in ('"', "\\") or (kind and (kind in "nrtfv0" or ord(kind) < 0x20)):
        return True
    if kind == "c":
        return len(atom) == 3 and atom[2].isalpha()
    if kind in ("x", "u") and len(atom) > 2:
        try:
            code = int(atom[2:], 16)
        except ValueError:
            return False
        return code <= 0x1F or code in (0x22, 0x5C)
    return False


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


def _is_local(ref: str) -> bool:
    return ref == "#" or ref.startswith("#/")


def _ref_target(root: Any, ref: Any) -> tuple[str, Any] | None:
    """The JSON pointer (escaped as ``_subschemas`` writes it) and value a local ``$ref``
    names; None for any other ``$ref``, or one that names nothing (the compile refuses it)."""
    if not isinstance(ref, str) or not _is_local(ref):
        return None
    target, where = root, ""
    for part in ref[2:].split("/") if ref != "#" else ():
        name = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and name in target:
            target = target[name]
        elif isinstance(target, list) and name.isdigit() and int(name) < len(target):
            target = target[int(name)]
        else:
            return None
        where += "/" + _escape(name)
    return where, target


def _resolve(root: Any, node: Any) -> Any:
    """``node`` with a local ``$ref`` ("#/...") followed; anything else as it is."""
    seen = 0
    while isinstance(node, dict) and seen < 32:
        target = _ref_target(root, node.get("$ref"))
        if target is None:
            return node
        node, seen = target[1], seen + 1
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
