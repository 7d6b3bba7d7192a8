"""msgpack on the wire, typed dataclasses in the code.

Every bus message is a frozen dataclass declared in `shared/schemas/`. `encode` packs one as a msgpack map keyed
by field name (every field, in declaration order); `decode(Type, data)` unpacks and validates it against the
dataclass's annotations, so a bad payload fails here, once, at the boundary, as a `SchemaError` (never deep inside
a handler). No pickle, ever.

Both directions are msgspec's (C, one pass, no intermediate dicts). What it accepts is what the schemas say,
strictly: int for a float field (made a float), but no bool for an int, no str for bytes (bytes are msgpack bin),
no float for an int. Map keys a dataclass does not declare are skipped, so an older reader accepts a newer
writer's message (but such a key must be a string, as every field name is).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()

# msgspec's ValidationError text: "<what> - at `$.a.b[3]`", or "<what> - at `key` in `$.a`" for a bad map key;
# nothing after <what> when the fault is the message itself.
_AT = re.compile(r"^(?P<what>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")


class SchemaError(ValueError):
    """A payload that does not match its declared schema."""


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


def decode(cls: type[T], data: bytes) -> T:
    try:
        return _decoder(cls).decode(data)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: test it first
        raise SchemaError(_explain(cls, str(exc))) from None
    except (msgspec.DecodeError, OverflowError) as exc:  # OverflowError: an integer no Python int field can hold
        raise SchemaError(f"{cls.__name__}: not msgpack ({exc})") from None


@cache
def _decoder(cls: type[T]) -> msgspec.msgpack.Decoder[T]:
    return msgspec.msgpack.Decoder(cls)


def _explain(cls: type, text: str) -> str:
    """'Expected `int`, got `str` - at `$.sampling.top_k`' -> 'GenerateRequest.sampling.top_k: expected `int`, got
    `str`': the type and the field path first, as every SchemaError reads."""
    at = _AT.match(text)
    assert at is not None  # the pattern's tail is optional: it matches any text
    where = cls.__name__ + at["path"] if at["path"] is not None else cls.__name__
    if at["key"]:
        where += " (a map key)"
    what = at["what"]
    if missing := _MISSING.match(what):
        return f"{where}: missing field {missing['name']!r}"
    what = what.replace("`object`", "a map")
    return f"{where}: {what[:1].lower()}{what[1:]}"
