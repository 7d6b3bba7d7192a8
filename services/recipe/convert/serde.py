"""Typed reads of a JSON request body with the reference's error messages.

The reference (deepseek-recipe) deserializes each API's body into Rust structs with serde before converting
it, so a body of the wrong shape fails with serde's words: "missing field `model`", "invalid type: integer
`5`, expected a string", "unknown variant `x`, expected one of `a`, `b`". Clients (and our oracle tests) see
those messages, so the types here produce the same ones. A schema is a tree of these types; `read` walks the
value, raising `BodyError` at the first problem in document order, as serde does:

    Struct("ChatCompletionRequest", [Field("model", Str), Field("max_tokens", Opt(UInt(32)))...])

A struct reads its keys in the order the client sent them (the first bad value wins), then reports the first
missing required field in declaration order. Unknown keys are ignored. JSON null is a value: it is accepted
only by `Opt` (and `Any`).

A request's top level is a `Record`: a frozen dataclass whose fields declare their serde types (`json_field`), read
into an instance of it, so a converter gets typed attributes (`req.model`), not a dict:

    @dataclass(frozen=True)
    class CompletionRequest:
        model: str = json_field(Str, required=True)
    REQUEST = Record(CompletionRequest)   # REQUEST.read(body) -> CompletionRequest
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from services.recipe.errors import BodyError
from services.recipe.formats.jsontext import shortest_float


def unexpected(value: Any) -> str:
    """How serde names the JSON value it did not expect."""
    if value is None:
        return "null"
    if value is True or value is False:
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{shortest_float(value)}`"
    if isinstance(value, str):
        return f"string {rust_debug(value)}"
    if isinstance(value, list):
        return "sequence"
    return "map"


def rust_debug(text: str) -> str:
    """Rust's `{:?}` of a string: quotes, with quotes, backslashes and control characters escaped."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\0":
            out.append("\\0")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{{{code:x}}}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def invalid_type(value: Any, expected: str) -> BodyError:
    return BodyError(f"invalid type: {unexpected(value)}, expected {expected}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Type:
    expecting = "a value"

    def read(self, value: Any) -> Any:
        raise NotImplementedError


class _Str(Type):
    expecting = "a string"

    def read(self, value: Any) -> str:
        if not isinstance(value, str):
            raise invalid_type(value, self.expecting)
        return value


class _Bool(Type):
    expecting = "a boolean"

    def read(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise invalid_type(value, self.expecting)
        return value


class _Any(Type):
    def read(self, value: Any) -> Any:
        return value


Str, Bool, Any_ = _Str(), _Bool(), _Any()


class UInt(Type):
    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.expecting = f"u{bits}"

    def read(self, value: Any) -> int:
        if not is_int(value):
            raise invalid_type(value, self.expecting)
        if not 0 <= value < 1 << self.bits:
            raise BodyError(f"invalid value: integer `{value}`, expected {self.expecting}")
        return value


class _F32(Type):
    """A 32-bit float: ranges are checked on the rounded value, as the reference's f32 fields do."""

    expecting = "f32"

    def read(self, value: Any) -> float:
        if not is_number(value):
            raise invalid_type(value, self.expecting)
        return to_f32(float(value))


def to_f32(x: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return float("inf") if x > 0 else float("-inf")


def f32_display(x: float) -> float:
    """The shortest decimal that reads back as the same f32, as the reference prints an f32 in JSON
    (0.30000001192092896 -> 0.3)."""
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        if to_f32(candidate) == x:
            return candidate
    return x


class Opt(Type):
    def __init__(self, inner: Type) -> None:
        self.inner = inner
        self.expecting = inner.expecting

    def read(self, value: Any) -> Any:
        return None if value is None else self.inner.read(value)


class Seq(Type):
    expecting = "a sequence"

    def __init__(self, item: Type) -> None:
        self.item = item

    def read(self, value: Any) -> list[Any]:
        if not isinstance(value, list):
            raise invalid_type(value, self.expecting)
        return [self.item.read(v) for v in value]


class Enum(Type):
    """A string enum. `expecting` is how the reference words a non-string: "variant identifier" for a tag,
    "string or map" for a field of enum type."""

    def __init__(self, variants: Sequence[str], expecting: str = "string or map") -> None:
        self.variants = tuple(variants)
        self.expecting = expecting

    def read(self, value: Any) -> str:
        if isinstance(value, dict) and self.expecting == "string or map":
            raise BodyError("invalid value: map, expected map with a single key")
        if not isinstance(value, str):
            raise invalid_type(value, self.expecting)
        if value not in self.variants:
            raise unknown_variant(value, self.variants)
        return value


def unknown_variant(value: str, variants: Sequence[str]) -> BodyError:
    if len(variants) == 1:
        return BodyError(f"unknown variant `{value}`, expected `{variants[0]}`")
    if len(variants) == 2:
        return BodyError(f"unknown variant `{value}`, expected `{variants[0]}` or `{variants[1]}`")
    names = ", ".join(f"`{v}`" for v in variants)
    return BodyError(f"unknown variant `{value}`, expected one of {names}")


@dataclass(frozen=True)
class Field:
    name: str
    type: Type
    required: bool = False  # absent -> "missing field" (else None, or `default`)
    default: Any = None
    seq_default: bool = False  # serde(default): in the sequence form of the struct, a missing element is default


class Struct(Type):
    """A JSON object read into a dict of the declared fields. serde also accepts a JSON array for a struct,
    filling the fields in order; that form is read too, so a client sending one gets serde's answer."""

    def __init__(self, name: str, fields: Sequence[Field], *, kind: str = "struct") -> None:
        self.name = name
        self.fields = tuple(fields)
        self.by_name = {f.name: f for f in self.fields}
        self.expecting = f"{kind} {name}"

    def read(self, value: Any) -> dict[str, Any]:
        if isinstance(value, list):
            return self._read_seq(value)
        if not isinstance(value, dict):
            raise invalid_type(value, self.expecting)
        out: dict[str, Any] = {}
        for key, item in value.items():
            field = self.by_name.get(key)
            if field is not None:
                out[key] = field.type.read(item)
        return self._complete(out)

    def _complete(self, out: dict[str, Any]) -> dict[str, Any]:
        for field in self.fields:
            if field.name not in out:
                if field.required:
                    raise BodyError(f"missing field `{field.name}`")
                out[field.name] = field.default
        return out

    def _read_seq(self, items: list[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, field in enumerate(self.fields):
            if i >= len(items):
                if field.seq_default:
                    out[field.name] = field.default
                    continue
                n = len(self.fields)
                raise BodyError(f"invalid length {i}, expected {self.expecting} with {n} element{'s' * (n != 1)}")
            out[field.name] = field.type.read(items[i])
        if len(items) > len(self.fields):
            raise BodyError(f"invalid length {len(items)}, expected fewer elements in array")
        return out


R = TypeVar("R")


def json_field(type: Type, *, required: bool = False, default: Any = None, seq_default: bool = False) -> Any:
    """A `Record` field read with `type` (the JSON key is the attribute's name); the dataclass default is
    `default` too, as the reader fills every field."""
    serde = {"type": type, "required": required, "default": default, "seq_default": seq_default}
    return dataclasses.field(default=default, metadata={"serde": serde})


class Record(Type, Generic[R]):
    """A `Struct` read into the frozen dataclass `cls` (its name is the struct's, as serde's messages say it):
    the fields are the dataclass's, in declaration order, each declared with `json_field`."""

    def __init__(self, cls: type[R], *, kind: str = "struct") -> None:
        fields = [Field(f.name, **f.metadata["serde"]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        self.cls = cls
        self.struct = Struct(cls.__name__, fields, kind=kind)
        self.expecting = self.struct.expecting

    def read(self, value: Any) -> R:
        return self.cls(**self.struct.read(value))


class Tagged(Type):
    """An internally tagged enum: a JSON object whose `tag` key names the variant, e.g. {"role": "user", ...}.
    Reads to (variant, fields)."""

    def __init__(
        self, name: str, tag: str, variants: dict[str, Struct | None], *, int_tags: bool = False,
        unlisted: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.tag = tag
        self.variants = variants
        # Variants we accept beyond the reference's: left out of its "expected one of" list, so its errors stay
        # word for word.
        self.listed = [v for v in variants if v not in unlisted]
        self.expecting = f"internally tagged enum {name}"
        # An enum nested two levels deep is read from serde's buffered content, where a tag may also be the
        # variant's index.
        self.int_tags = int_tags

    def read(self, value: Any) -> tuple[str, dict[str, Any]]:
        if isinstance(value, list):  # serde's seq form: the tag first, then the variant's fields in order
            if not value:
                raise BodyError(f"missing field `{self.tag}`")
            variant = self._variant(value[0])
            body = self.variants[variant]
            return variant, ({} if body is None else body.read(value[1:]))
        if not isinstance(value, dict):
            raise invalid_type(value, self.expecting)
        if self.tag not in value:
            raise BodyError(f"missing field `{self.tag}`")
        variant = self._variant(value[self.tag])
        body = self.variants[variant]
        if body is None:
            return variant, {}
        return variant, body.read({k: v for k, v in value.items() if k != self.tag})

    def _variant(self, tag: Any) -> str:
        if self.int_tags and is_int(tag) and tag >= 0:
            names = list(self.variants)
            if not 0 <= tag < len(names):
                raise BodyError(f"invalid value: integer `{tag}`, expected variant index 0 <= i < {len(names)}")
            return names[tag]
        if not isinstance(tag, str):
            raise invalid_type(tag, "variant identifier")
        if tag not in self.variants:
            raise unknown_variant(tag, self.listed)
        return tag


class Custom(Type):
    """A type with a hand-written reader (untagged enums whose errors the reference words itself)."""

    def __init__(self, reader: Callable[[Any], Any], expecting: str = "a value") -> None:
        self._reader = reader
        self.expecting = expecting

    def read(self, value: Any) -> Any:
        return self._reader(value)


F32 = _F32()
