"""Which JSON Schemas the grammar backend enforces exactly, and a check that rejects the rest.

xgrammar turns a schema into a grammar, but it silently ignores some keywords (``not``,
``uniqueItems``, ``contains``, ``propertyNames``, ...), treats ``oneOf`` as ``anyOf``, drops
``multipleOf`` on non-integers, and drops string lengths next to a ``pattern`` or an ``enum``.
An output generated under such a schema can then fail validation, so such schemas are refused
up front with an ``InvalidParamsError`` naming the keyword and its place in the schema: every
finished constrained output must validate. Keywords that only annotate are accepted.
"""

from __future__ import annotations

from typing import Any

from pagedq.errors import InvalidParamsError

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly",
})
ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties",
    "minProperties", "maxProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# String formats xgrammar turns into a grammar; any other format would pass as a plain string.
FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
              "array": list, "object": dict, "null": type(None)}


def check_schema(schema: dict[str, Any]) -> None:
    """Raise InvalidParamsError if ``schema`` is malformed or uses a keyword the backend
    would not enforce."""
    _check_meta(schema)
    _walk(schema, "#")


def _check_meta(schema: dict[str, Any]) -> None:
    """The schema is itself valid under its draft's metaschema (2020-12 when unstated)."""
    # measured: jsonschema adds ~0.15 s to the engine's import; only a JSON Schema request needs it
    import jsonschema

    try:
        jsonschema.validators.validator_for(
            schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(root)"
        raise InvalidParamsError(
            f"structured_outputs.json is not a valid JSON Schema at {where}: {exc.message}") from exc


def _fail(path: str, why: str) -> InvalidParamsError:
    return InvalidParamsError(f"structured_outputs.json at {path}: {why}")


def _walk(node: Any, path: str) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise _fail(path, f"a schema must be an object or a boolean, got {type(node).__name__}")
    for key in node:
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise _fail(path, f"keyword {key!r} is not supported (the grammar could not enforce "
                              f"it); supported keywords: {', '.join(sorted(ENFORCED))}")
    _check_combinations(node, path)
    for key, sub in _children(node):
        _walk(sub, f"{path}/{key}")


def _check_combinations(node: dict[str, Any], path: str) -> None:
    if "enum" in node or "const" in node:
        extra = set(node) - ANNOTATIONS - {"enum", "const", "type"}
        if extra:
            raise _fail(path, f"{sorted(extra)} next to enum/const is not enforced: list only the "
                              "allowed values in enum")
        _check_enum_types(node, path)
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        raise _fail(path, "minLength/maxLength next to pattern is not enforced: put the length "
                          "into the pattern, e.g. ^[a-z]{1,8}$")
    if "multipleOf" in node:
        value = node["multipleOf"]
        if node.get("type") != "integer" or not isinstance(value, int) or isinstance(value, bool):
            raise _fail(path, "multipleOf is enforced only on type integer with an integer divisor")
    if "format" in node and node["format"] not in FORMATS:
        raise _fail(path, f"format {node['format']!r} is not enforced; supported formats: "
                          f"{', '.join(sorted(FORMATS))} (or use a pattern)")
    if "$ref" in node and not str(node["$ref"]).startswith("#"):
        raise _fail(path, f"$ref {node['$ref']!r}: only local references (#/...) resolve; inline "
                          "the referenced schema or put it under $defs")
    if isinstance(node.get("items"), list):
        raise _fail(path, "items as a list (draft 4 tuples) is not supported: use prefixItems")


def _check_enum_types(node: dict[str, Any], path: str) -> None:
    types = node.get("type")
    if types is None:
        return
    types = [types] if isinstance(types, str) else list(types)
    values = node.get("enum", []) + ([node["const"]] if "const" in node else [])
    for value in values:
        if not any(_is_type(value, t) for t in types):
            raise _fail(path, f"enum/const value {value!r} is not of type {types}: remove it")


def _is_type(value: Any, json_type: str) -> bool:
    if isinstance(value, bool) and json_type in ("integer", "number"):
        return False
    if json_type == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, JSON_TYPES.get(json_type, ()))


def _children(node: dict[str, Any]):
    """(path segment, subschema) of every nested schema."""
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        for name, sub in (node.get(key) or {}).items():
            yield f"{key}/{name}", sub
    for key in ("additionalProperties", "items"):
        if isinstance(node.get(key), (dict, bool)):
            yield key, node[key]
    for key in ("prefixItems", "anyOf"):
        for i, sub in enumerate(node.get(key) or []):
            yield f"{key}/{i}", sub
