"""Strict-mode JSON schemas (`"strict": true` on a tool or a json_schema response format), as the reference
normalizes them: only the keywords constrained decoding supports are kept, every object gets
`"additionalProperties": false` and `"required"` = all its properties, in property order.

    {"type": "object", "properties": {"a": {"type": "string", "minLength": 1}}}
 -> {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": false, "required": ["a"]}

A node is `{"type": ...}` (one of seven types, or a list of scalar types), else `{"anyOf": [...]}` (whose items
must be typed nodes), else `{"$ref": ...}`. Shape errors are reported first (whole tree, as parsing does), then
the rules, children before parents: an object needs properties (except at the top), `required` must name them
all, `additionalProperties` may not be true.
"""

from __future__ import annotations

from typing import Any

from services.recipe.convert.serde import invalid_type, is_number, unknown_variant
from services.recipe.errors import BodyError, StrictError
from shared.json_depth import MAX_JSON_DEPTH, too_deep

_TYPES = ("object", "string", "number", "integer", "boolean", "array", "null")
_SCALARS = ("string", "number", "integer", "boolean", "null")
_FORMATS = ("email", "hostname", "ipv4", "ipv6", "uuid")
_NUMERIC = ("const", "default", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def normalize(schema: Any, *, empty_top: bool) -> tuple[dict[str, Any], bool]:
    """The normalized schema and whether its top is an object schema. Raises StrictError. `empty_top`: a
    top-level object may have no properties (tool parameters; a response format may not)."""
    if too_deep(schema):  # _node and _rules recurse once per level
        raise StrictError(f"the schema nests more than {MAX_JSON_DEPTH} levels deep", shape=False)
    try:
        node = _node(schema)
    except BodyError as exc:
        raise StrictError(exc.message, shape=True) from None
    _rules(node, top=empty_top)  # the rules run before the top-level check
    return node, node.get("type") == "object"


def _node(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        if "type" in value:
            return _typed(value)
        if "anyOf" in value:
            return _any_of(value)
        if "$ref" in value:
            return {"$ref": value["$ref"]}
    raise BodyError("one of `type`, `anyOf`, `$ref` field is required")


def _any_of(value: dict[str, Any]) -> dict[str, Any]:
    items = value["anyOf"]
    try:
        if not isinstance(items, list):
            raise invalid_type(items, "a sequence")
        out: dict[str, Any] = {"anyOf": [_variant_item(v) for v in items]}
    except BodyError as exc:
        raise BodyError(f"field `anyOf`: {exc.message}") from None
    _description(value, out)
    return out


def _variant_item(value: Any) -> dict[str, Any]:
    """An anyOf item must be a typed schema."""
    if isinstance(value, list):  # serde's sequence form of a tagged enum: the tag first
        if not value:
            raise BodyError("missing field `type`")
        raise invalid_type(value[0], "variant identifier")
    if not isinstance(value, dict):
        raise invalid_type(value, "internally tagged enum JsonSchemaType")
    if "type" not in value:
        raise BodyError("missing field `type`")
    if not isinstance(value["type"], str):  # a type list is not allowed here
        raise invalid_type(value["type"], "variant identifier")
    return _typed(value)


def _typed(value: dict[str, Any]) -> dict[str, Any]:
    kind = value["type"]
    if isinstance(kind, list):
        for t in kind:
            if not isinstance(t, str):
                raise BodyError(f"field `type`: {invalid_type(t, 'string or map').message}")
            if t not in _SCALARS:
                raise BodyError(f"field `type`: {unknown_variant(t, _SCALARS).message}")
        out: dict[str, Any] = {"type": list(kind)}
        _description(value, out)
        return out
    if not isinstance(kind, str):
        raise invalid_type(kind, "variant identifier")
    if kind not in _TYPES:
        raise unknown_variant(kind, _TYPES)
    return _BUILDERS[kind](value)


def _description(value: dict[str, Any], out: dict[str, Any]) -> None:
    if value.get("description") is not None:
        if not isinstance(value["description"], str):
            raise invalid_type(value["description"], "a string")
        out["description"] = value["description"]


def _object(value: dict[str, Any]) -> dict[str, Any]:
    props = value.get("properties")
    if props is not None and not isinstance(props, dict):
        raise invalid_type(props, "a map")
    properties = {k: _node(v) for k, v in (props or {}).items()}
    additional = value.get("additionalProperties")
    if additional is not None and not isinstance(additional, bool):
        raise invalid_type(additional, "a boolean")
    required = value.get("required")
    if required is not None:
        if not isinstance(required, list):
            raise invalid_type(required, "a sequence")
        for r in required:
            if not isinstance(r, str):
                raise invalid_type(r, "a string")
    out: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": additional,
                           "required": required}
    _description(value, out)
    return out


def _string(value: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string"}
    _description(value, out)
    if value.get("pattern") is not None:
        if not isinstance(value["pattern"], str):
            raise invalid_type(value["pattern"], "a string")
        out["pattern"] = value["pattern"]
    fmt = value.get("format")
    if fmt is not None:
        if isinstance(fmt, dict):
            raise BodyError("invalid value: map, expected map with a single key")
        if not isinstance(fmt, str):
            raise invalid_type(fmt, "string or map")
        if fmt not in _FORMATS:
            raise unknown_variant(fmt, _FORMATS)
        out["format"] = fmt
    if value.get("enum") is not None:
        if not isinstance(value["enum"], list):
            raise invalid_type(value["enum"], "a sequence")
        out["enum"] = value["enum"]
    return out


def _number(kind: str) -> Any:
    def build(value: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"type": kind}
        _description(value, out)
        for key in _NUMERIC:
            if value.get(key) is not None:
                if not is_number(value[key]):
                    raise invalid_type(value[key], "a JSON number")
                out[key] = value[key]
        return out

    return build


def _plain(kind: str) -> Any:
    def build(value: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"type": kind}
        _description(value, out)
        return out

    return build


def _array(value: dict[str, Any]) -> dict[str, Any]:
    if "items" not in value:
        raise BodyError("missing field `items`")
    out: dict[str, Any] = {"type": "array", "items": _node(value["items"])}
    _description(value, out)
    return out


_BUILDERS = {
    "object": _object, "string": _string, "number": _number("number"), "integer": _number("integer"),
    "boolean": _plain("boolean"), "null": _plain("null"), "array": _array,
}


def _rules(node: dict[str, Any], *, top: bool = False) -> None:
    """Checks children first; fills `additionalProperties` and `required` of each object."""
    for child in _children(node):
        _rules(child)
    if node.get("type") != "object":
        return
    properties: dict[str, Any] = node["properties"]
    if not properties and not top:
        raise StrictError("An object with no properties is not allowed.", shape=False)
    required = node["required"]
    if required is not None:
        seen: set[str] = set()
        for name in required:
            if name in seen:
                raise StrictError(f"Duplicate required property '{name}'", shape=False)
            seen.add(name)
            if name not in properties:
                raise StrictError(f"Required property '{name}' not found in object", shape=False)
        if len(seen) != len(properties):
            raise StrictError("Required properties must match all properties in the object", shape=False)
    if node["additionalProperties"] is True:
        raise StrictError("additionalProperties should not be true", shape=False)
    node["additionalProperties"] = False
    node["required"] = list(properties)
    description = node.pop("description", None)
    if description is not None:  # the reference writes it after the constraints
        node["description"] = description


def _children(node: dict[str, Any]) -> list[dict[str, Any]]:
    if node.get("type") == "object":
        return list(node["properties"].values())
    if node.get("type") == "array":
        return [node["items"]]
    return list(node.get("anyOf", ()))
