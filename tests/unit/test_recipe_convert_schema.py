"""The pieces under conversion: serde-worded body errors, JSON-schema checks and strict-mode normalization."""

from __future__ import annotations

import re
from dataclasses import FrozenInstanceError, dataclass
from typing import Any

import pytest

from services.recipe.convert import schema, serde, strict
from services.recipe.convert.serde import Enum, Field, Opt, Record, Seq, Str, Struct, Tagged, UInt, json_field
from services.recipe.errors import BodyError, SchemaError, StrictError


def message(reader: Any, value: Any) -> str:
    with pytest.raises(BodyError) as info:
        reader.read(value)
    return info.value.message


def test_unexpected_values_are_named_as_serde_names_them() -> None:
    assert [serde.unexpected(v) for v in (None, True, 5, 1.5, 1e-7, "a\"\n", [], {})] == [
        "null", "boolean `true`", "integer `5`", "floating point `1.5`", "floating point `1e-7`",
        'string "a\\"\\n"', "sequence", "map"]


def test_scalars() -> None:
    assert message(UInt(32), -1) == "invalid value: integer `-1`, expected u32"
    assert message(UInt(8), 256) == "invalid value: integer `256`, expected u8"
    assert message(UInt(32), 1.0) == "invalid type: floating point `1.0`, expected u32"
    assert serde.F32.read(2) == 2.0 and serde.F32.read(0.1) != 0.1  # rounded to f32
    assert message(Str, None) == "invalid type: null, expected a string"
    assert Opt(Str).read(None) is None


def test_enums_word_unknown_variants_by_count() -> None:
    assert message(Enum(["a"]), "x") == "unknown variant `x`, expected `a`"
    assert message(Enum(["a", "b"]), "x") == "unknown variant `x`, expected `a` or `b`"
    assert message(Enum(["a", "b", "c"]), "x") == "unknown variant `x`, expected one of `a`, `b`, `c`"
    assert message(Enum(["a"]), {}) == "invalid value: map, expected map with a single key"


def test_structs_report_the_first_bad_value_then_the_first_missing_field() -> None:
    s = Struct("S", [Field("a", Str, required=True), Field("b", UInt(8), required=True), Field("c", Opt(Str))])
    assert message(s, {"b": "x", "c": 5}) == 'invalid type: string "x", expected u8'
    assert message(s, {"c": "ok"}) == "missing field `a`"
    assert s.read({"a": "x", "b": 1, "unknown": [1]}) == {"a": "x", "b": 1, "c": None}
    assert message(s, []) == "invalid length 0, expected struct S with 3 elements"  # serde's sequence form
    assert message(s, 7) == "invalid type: integer `7`, expected struct S"


@dataclass(frozen=True)
class S:
    a: str = json_field(Str, required=True)
    b: int | None = json_field(Opt(UInt(8)), default=3)


def test_records_read_into_frozen_dataclasses_with_the_struct_s_words() -> None:
    r = Record(S)
    assert r.read({"b": 1, "a": "x", "unknown": 0}) == S("x", 1) and r.read(["y", 2]) == S("y", 2)
    assert r.read({"a": "x"}).b == 3
    with pytest.raises(FrozenInstanceError):
        r.read({"a": "x"}).a = "y"  # type: ignore[misc]
    assert message(r, {"b": 1}) == "missing field `a`"
    assert message(r, {"a": 1}) == "invalid type: integer `1`, expected a string"
    assert message(r, 7) == "invalid type: integer `7`, expected struct S"
    assert message(r, ["y"]) == "invalid length 1, expected struct S with 2 elements"


def test_tagged_enums() -> None:
    t = Tagged("T", "type", {"x": Struct("X", [Field("v", Seq(Str), required=True)]), "y": None})
    assert t.read({"type": "x", "v": ["a"]}) == ("x", {"v": ["a"]})
    assert t.read({"type": "y", "ignored": 1}) == ("y", {})
    assert message(t, {}) == "missing field `type`"
    assert message(t, {"type": 1}) == "invalid type: integer `1`, expected variant identifier"
    assert message(t, {"type": "z"}) == "unknown variant `z`, expected `x` or `y`"
    assert message(t, "s") == 'invalid type: string "s", expected internally tagged enum T'


@pytest.mark.parametrize(("value", "error"), [
    (5, '5 is not of types "boolean", "object"'),
    ({"properties": 5}, '5 is not of type "object"'),
    ({"type": "weird"}, "\"weird\" is not valid under any of the schemas listed in the 'anyOf' keyword"),
    ({"required": ["a", "a"]}, '["a","a"] has non-unique elements'),
    ({"anyOf": []}, "[] has less than 1 item"),
    ({"minLength": -1}, "-1 is less than the minimum of 0"),
    ({"$ref": "#/nope"}, "Pointer '/nope' does not exist"),
    ({"properties": 5, "type": 5}, '5 is not of type "object"'),  # applicators are checked before "type"
])
def test_schema_check(value: Any, error: str) -> None:
    with pytest.raises(SchemaError, match="^" + re.escape(error) + "$"):
        schema.check(value)


def test_valid_schemas_pass() -> None:
    schema.check({"type": "object", "properties": {"a": {"type": ["string", "null"]}}, "required": ["a"]})
    schema.check(True)
    assert schema.object_type_error({"type": "object"}) is None
    assert schema.object_type_error({"type": "array"}) == (
        "schema must be a JSON Schema of 'type: \"object\"', got 'type: \"array\"'.")


def test_strict_normalization_keeps_supported_keywords_and_closes_objects() -> None:
    node, is_object = strict.normalize({"type": "object", "title": "T", "properties": {
        "a": {"type": "string", "minLength": 1, "format": "email"},
        "b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": 0}}, "description": "B"},
        "d": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    }}, empty_top=True)
    assert is_object
    assert node == {"type": "object", "properties": {
        "a": {"type": "string", "format": "email"},
        "b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": 0}},
              "additionalProperties": False, "required": ["c"], "description": "B"},
        "d": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    }, "additionalProperties": False, "required": ["a", "b", "d"]}


@pytest.mark.parametrize(("value", "error", "shape"), [
    ({"type": "object", "properties": {"a": {"type": "object"}}}, "An object with no properties is not allowed.",
     False),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": []},
     "Required properties must match all properties in the object", False),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
     "Required property 'b' not found in object", False),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
     "additionalProperties should not be true", False),
    ({"type": "object", "properties": {"a": {"description": "no type"}}},
     "one of `type`, `anyOf`, `$ref` field is required", True),
    ({"type": "object", "properties": {"a": {"type": "array"}}}, "missing field `items`", True),
    ({"type": "object", "properties": {"a": {"anyOf": [{"description": "x"}]}}},
     "field `anyOf`: missing field `type`", True),
])
def test_strict_errors(value: Any, error: str, shape: bool) -> None:
    with pytest.raises(StrictError) as info:
        strict.normalize(value, empty_top=True)
    assert (info.value.message, info.value.shape) == (error, shape)


def test_a_response_format_needs_properties_even_at_the_top() -> None:
    assert strict.normalize({"type": "object", "properties": {}}, empty_top=True)[1]
    with pytest.raises(StrictError, match="no properties"):
        strict.normalize({"type": "object", "properties": {}}, empty_top=False)
