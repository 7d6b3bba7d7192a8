"""Typed reads of a JSON request body: each returns the value or raises `Invalid` naming the field.

JSON null counts as absent (clients send `"stop": null`); bool is not a number (JSON true is not 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.recipe.apis.errors import Invalid

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def obj(body: Any, where: str = "body") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise Invalid(f"{where}: expected an object, got {_type_name(body)}", None if where == "body" else where)
    return body


def required_str(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None:
        raise Invalid(f"{key}: field required", key)
    if not isinstance(value, str) or not value:
        raise Invalid(f"{key}: expected a non-empty string, got {_type_name(value)}", key)
    return value


def opt_bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise Invalid(f"{key}: expected a boolean, got {_type_name(value)}", key)
    return value


def opt_int(body: dict[str, Any], key: str, lo: int = INT64_MIN, hi: int = UINT64_MAX) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise Invalid(f"{key}: expected an integer, got {_type_name(value)}", key)
    if not lo <= value <= hi:
        raise Invalid(f"{key}: {value} is out of range [{lo}, {hi}]", key)
    return value


def opt_number(
    body: dict[str, Any], key: str, default: float, lo: float, hi: float, *, lo_open: bool = False
) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise Invalid(f"{key}: expected a number, got {_type_name(value)}", key)
    if value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise Invalid(f"{key}: {value} is out of range {bracket}{lo}, {hi}]", key)
    return float(value)


def text_content(value: Any, where: str, block_kinds: Sequence[str] = ("text",)) -> str:
    """A message's content: a string, or an array of text parts/blocks whose texts are joined by newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise Invalid(f"{where}: expected a string or an array of content parts, got {_type_name(value)}", where)
    texts = []
    for i, part in enumerate(value):
        part = obj(part, f"{where}.{i}")
        kind = part.get("type")
        if kind not in block_kinds:
            raise Invalid(f"{where}.{i}.type: {kind!r} content is not supported (only text)", f"{where}.{i}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise Invalid(f"{where}.{i}.text: expected a string, got {_type_name(text)}", f"{where}.{i}.text")
        texts.append(text)
    return "\n".join(texts)


def stop_strings(value: Any, key: str, max_items: int, *, one_string_ok: bool = True) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) and one_string_ok else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        expected = "a string or an array of strings" if one_string_ok else "an array of strings"
        raise Invalid(f"{key}: expected {expected}", key)
    if len(items) > max_items:
        raise Invalid(f"{key}: at most {max_items} stop sequences are supported, got {len(items)}", key)
    return tuple(s for s in items if s)


def reject_present(body: dict[str, Any], key: str, what: str) -> None:
    """A feature that would change the response's shape: refuse it rather than silently ignore it."""
    value = body.get(key)
    if value not in (None, [], False):
        raise Invalid(f"{key}: {what} not supported yet", key)
