"""JSON schemas from clients (tool parameters, response formats): a meta-schema check with the reference's
messages, and the strict-mode normalization.

`check` validates a schema against the shape JSON Schema 2020-12 gives its keywords, reporting the first
violation as the reference's validator does ("5 is not of type \"object\""); it walks the keywords in the
meta-schema's order (applicators before validation keywords), so with two mistakes the same one is reported.
"""

from __future__ import annotations

import re
from typing import Any

from services.recipe.errors import SchemaError
from services.recipe.formats.jsontext import dumps
from shared.json_depth import MAX_JSON_DEPTH, too_deep

SIMPLE_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")

# Keyword -> kind, in the meta-schema's evaluation order (core, applicator, validation, meta-data, format,
# content); a keyword's value failing its kind is the error.
_KEYWORDS: tuple[tuple[str, str], ...] = (
    ("$id", "string"), ("$schema", "string"), ("$ref", "string"), ("$anchor", "string"),
    ("$dynamicRef", "string"), ("$dynamicAnchor", "string"), ("$vocabulary", "object"), ("$comment", "string"),
    ("$defs", "schema_map"),
    ("prefixItems", "schema_array"), ("items", "schema"), ("contains", "schema"),
    ("additionalProperties", "schema"), ("properties", "schema_map"), ("patternProperties", "schema_map"),
    ("dependentSchemas", "schema_map"), ("propertyNames", "schema"), ("if", "schema"), ("then", "schema"),
    ("else", "schema"), ("allOf", "schema_array"), ("anyOf", "schema_array"), ("oneOf", "schema_array"),
    ("not", "schema"),
    ("unevaluatedItems", "schema"), ("unevaluatedProperties", "schema"),
    ("type", "type"), ("enum", "array"), ("multipleOf", "positive"), ("maximum", "number"),
    ("exclusiveMaximum", "number"), ("minimum", "number"), ("exclusiveMinimum", "number"),
    ("maxLength", "count"), ("minLength", "count"), ("pattern", "regex"), ("maxItems", "count"),
    ("minItems", "count"), ("uniqueItems", "boolean"), ("maxContains", "count"), ("minContains", "count"),
    ("maxProperties", "count"), ("minProperties", "count"), ("required", "string_set"),
    ("dependentRequired", "object"),
    ("title", "string"), ("description", "string"), ("deprecated", "boolean"), ("readOnly", "boolean"),
    ("writeOnly", "boolean"), ("examples", "array"),
    ("format", "string"), ("contentEncoding", "string"), ("contentMediaType", "string"),
    ("contentSchema", "schema"),
    ("definitions", "schema_map"), ("dependencies", "object"),
)


def show(value: Any) -> str:
    """A JSON value as the validator prints it: compact JSON."""
    return dumps(value, "compact")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _unique(items: list[Any]) -> bool:
    seen = [dumps(i, "compact") for i in items]
    return len(set(seen)) == len(seen)


def check(schema: Any) -> None:
    """Raises SchemaError with the first meta-schema violation, or for a schema nested too deeply to walk."""
    if too_deep(schema):
        raise SchemaError(f"the schema nests more than {MAX_JSON_DEPTH} levels deep")
    _check_schema(schema, schema)


def _check_schema(value: Any, root: Any) -> None:
    if isinstance(value, bool):
        return
    if not isinstance(value, dict):
        raise SchemaError(f'{show(value)} is not of types "boolean", "object"')
    for key, kind in _KEYWORDS:
        if key in value:
            _check_keyword(value[key], kind, root)
    ref = value.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        _resolve(root, ref)


def _check_keyword(v: Any, kind: str, root: Any) -> None:
    if kind == "schema":
        _check_schema(v, root)
    elif kind == "schema_map":
        if not isinstance(v, dict):
            raise SchemaError(f'{show(v)} is not of type "object"')
        for item in v.values():
            _check_schema(item, root)
    elif kind == "schema_array":
        if not isinstance(v, list):
            raise SchemaError(f'{show(v)} is not of type "array"')
        if not v:
            raise SchemaError(f"{show(v)} has less than 1 item")
        for item in v:
            _check_schema(item, root)
    elif kind == "type":
        ok = v in SIMPLE_TYPES if isinstance(v, str) else (
            isinstance(v, list) and len(v) > 0 and all(isinstance(t, str) and t in SIMPLE_TYPES for t in v)
            and _unique(v)
        )
        if not ok:
            raise SchemaError(f"{show(v)} is not valid under any of the schemas listed in the 'anyOf' keyword")
    elif kind in ("string", "regex"):
        if not isinstance(v, str):
            raise SchemaError(f'{show(v)} is not of type "string"')
        if kind == "regex" and not _compiles(v):
            raise SchemaError(f'{show(v)} is not a "regex"')
    elif kind in ("object", "array", "boolean"):
        py = {"object": dict, "array": list, "boolean": bool}[kind]
        if not isinstance(v, py):
            raise SchemaError(f'{show(v)} is not of type "{kind}"')
    elif kind in ("number", "positive"):
        if not _is_num(v):
            raise SchemaError(f'{show(v)} is not of type "number"')
        if kind == "positive" and v <= 0:
            raise SchemaError(f"{show(v)} is less than or equal to the minimum of 0")
    elif kind == "count":
        if not (_is_num(v) and float(v).is_integer()):
            raise SchemaError(f'{show(v)} is not of type "integer"')
        if v < 0:
            raise SchemaError(f"{show(v)} is less than the minimum of 0")
    elif kind == "string_set":
        if not isinstance(v, list):
            raise SchemaError(f'{show(v)} is not of type "array"')
        for item in v:
            if not isinstance(item, str):
                raise SchemaError(f'{show(item)} is not of type "string"')
        if not _unique(v):
            raise SchemaError(f"{show(v)} has non-unique elements")


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def _resolve(root: Any, ref: str) -> None:
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaError(f"Pointer '{ref[1:]}' does not exist")


def object_type_error(schema: Any) -> str | None:
    """Tool parameters must be an object schema: the reference's message when they are not."""
    if isinstance(schema, dict) and schema.get("type") == "object":
        return None
    kind = schema.get("type") if isinstance(schema, dict) else None
    return f"schema must be a JSON Schema of 'type: \"object\"', got 'type: {show(kind)}'."
