"""msgpack on the wire, typed dataclasses in the code.

Every bus message is a frozen dataclass declared in `shared/schemas/`. `encode` packs one as a msgpack map;
`decode(Type, data)` unpacks and validates it against the dataclass's annotations, so a bad payload fails here,
once, at the boundary, as a `SchemaError` (never deep inside a handler). No pickle, ever.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


class SchemaError(ValueError):
    """A payload that does not match its declared schema."""


def encode(message: Any) -> bytes:
    return msgpack.packb(_to_wire(message), use_bin_type=True)


def decode(cls: type[T], data: bytes) -> T:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise SchemaError(f"{cls.__name__}: not msgpack ({exc})") from None
    return from_wire(cls, raw)


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_wire(cls: type[T], raw: Any, path: str = "") -> T:
    where = path or cls.__name__
    if not isinstance(raw, dict):
        raise SchemaError(f"{where}: expected a map, got {type(raw).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in raw:
            kwargs[f.name] = _check(hints[f.name], raw[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SchemaError(f"{where}: missing field {f.name!r}")
    return cls(**kwargs)


def _check(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _check(option, value, where)
            except SchemaError as exc:
                errors.append(str(exc))
        raise SchemaError(f"{where}: {value!r:.80} matches none of {tp}")
    if tp is type(None):
        if value is None:
            return None
        raise SchemaError(f"{where}: expected nil")
    if dataclasses.is_dataclass(tp):
        return from_wire(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise SchemaError(f"{where}: expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise SchemaError(f"{where}: expected {len(args)} items")
            return tuple(_check(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        checked = [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(checked) if origin is tuple else checked
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected a map, got {type(value).__name__}")
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {_check(kt, k, where): _check(vt, v, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise SchemaError(f"{where}: expected a number, got {type(value).__name__}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SchemaError(f"{where}: expected an integer, got {type(value).__name__}")
    if tp is bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        raise SchemaError(f"{where}: expected bytes, got {type(value).__name__}")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise SchemaError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    raise SchemaError(f"{where}: unsupported schema type {tp}")
