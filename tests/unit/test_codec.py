"""The wire codec: the same bytes as the hand-written codec it replaced, for every schema, and SchemaError at the
boundary for everything a schema does not allow."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
import types
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shared.schemas
from bench.codec import before_decode, before_encode
from shared.codec import SchemaError, decode, encode
from shared.schemas.events import KvSnapshot
from shared.schemas.generate import DecodeJob, GenerateRequest, SamplingParams, TokenEvent
from shared.schemas.kv import KvGetReply, KvPut


def schema_types() -> list[type]:
    found = []
    for info in pkgutil.iter_modules(shared.schemas.__path__):
        module = importlib.import_module(f"shared.schemas.{info.name}")
        found += [obj for _, obj in inspect.getmembers(module, dataclasses.is_dataclass)
                  if obj.__module__ == module.__name__]
    return found


SCHEMAS = schema_types()

# ints the two packers could size differently: fixint, negative fixint, each uint/int width's edges
INTS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1, -1, -32, -33, -129,
        -32769, -(2**31) - 1, -(2**63)]


def sample(tp: Any, i: int) -> Any:
    """A value of type `tp`, varied by `i` so each field and list item exercises a different width."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return None if i % 3 == 2 else sample(options[i % len(options)], i)
    if dataclasses.is_dataclass(tp):
        return full(tp, i)
    if origin is typing.Literal:  # one of its values (a constraint's kind)
        return args[i % len(args)]
    if origin in (list, tuple):
        items = [sample(args[0], i + k) for k in range(3)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        return {sample(args[0], i + k): sample(args[1], i + k) for k in range(2)}
    if tp is int:
        return INTS[i % len(INTS)]
    if tp is float:
        return [0.0, 0.5, -1.25, 1e300, 1764590000.123][i % 5]
    if tp is bool:
        return i % 2 == 0
    if tp is str:
        return ["", "s", "é" * 40, "x" * 300, "日本"][i % 5] + str(i)  # fixstr, str8, str16, non-ASCII
    if tp is bytes:
        return [b"", b"\x00\xff", bytes(range(256)) * 300][i % 3]  # bin8, bin16, bin32
    raise AssertionError(f"no sample for {tp}")


def full(cls: type, i: int = 0) -> Any:
    """Every field set, defaults included."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: sample(hints[f.name], i + k) for k, f in enumerate(dataclasses.fields(cls))})


def minimal(cls: type) -> Any:
    """Only the required fields set: the defaults go on the wire as the schema declares them."""
    hints = typing.get_type_hints(cls)
    required = [f for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    return cls(**{f.name: sample(hints[f.name], k) for k, f in enumerate(required)})


def test_every_schema_is_found() -> None:
    names = {cls.__name__ for cls in SCHEMAS}
    assert {"TokenEvent", "ApiEvent", "Heartbeat", "GenerateRequest", "DecodeJob", "KvPut", "KvGetReply",
            "KvSnapshot", "KvStats", "HealthRequest"} <= names
    assert len(SCHEMAS) >= 25


@pytest.mark.parametrize("cls", SCHEMAS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("build", [full, minimal])
def test_same_bytes_as_before_and_both_read_each_other(cls: type, build: Any) -> None:
    value = build(cls)
    wire = encode(value)
    assert wire == before_encode(value)
    assert decode(cls, wire) == value
    assert before_decode(cls, wire) == value


def test_tuples_go_out_as_lists() -> None:
    event = TokenEvent("r", 0, (1, 2))  # type: ignore[arg-type]  # engines hand over tuples
    assert encode(event) == encode(TokenEvent("r", 0, [1, 2]))
    assert decode(TokenEvent, encode(event)).token_ids == [1, 2]


def test_plain_maps_encode_too() -> None:
    assert decode(TokenEvent, encode({"request_id": "r", "index": 3, "token_ids": []})) == TokenEvent("r", 3, [])


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def test_unknown_fields_are_skipped_at_every_depth() -> None:
    wire = pack({"request_id": "r", "model": "m", "prompt_ids": [1], "new_field": {"any": [1, b"x", None]},
                 "sampling": {"max_tokens": 5, "later": 1.5}})
    assert decode(GenerateRequest, wire) == GenerateRequest("r", "m", [1], SamplingParams(max_tokens=5))


def test_an_int_is_accepted_for_a_float_and_becomes_one() -> None:
    got = decode(SamplingParams, pack({"temperature": 0, "top_p": 1}))
    assert got == SamplingParams(temperature=0.0, top_p=1.0)
    assert type(got.temperature) is float and type(got.top_p) is float


def test_missing_optional_fields_take_their_defaults() -> None:
    event = decode(TokenEvent, pack({"request_id": "r", "index": 0, "token_ids": []}))
    assert event == TokenEvent("r", 0, [])
    assert decode(KvGetReply, pack({"blobs": [b"x", None]})).blobs == [b"x", None]


def test_default_lists_are_not_shared_between_messages() -> None:
    a, b = (decode(SamplingParams, pack({})) for _ in range(2))
    a.stop_token_ids.append(1)
    assert b.stop_token_ids == []


REQUEST = {"request_id": "r", "model": "m", "prompt_ids": [1, 2], "sampling": {}}


@pytest.mark.parametrize(("cls", "wire", "message"), [
    (GenerateRequest, pack([1, 2]), "GenerateRequest: expected a map, got `array`"),
    (GenerateRequest, pack("r"), "GenerateRequest: expected a map, got `str`"),
    (GenerateRequest, pack({"request_id": "r"}), "GenerateRequest: missing field 'model'"),
    (DecodeJob, pack({"request": {"request_id": "r"}}), "DecodeJob.request: missing field 'model'"),
    (GenerateRequest, pack({**REQUEST, "prompt_ids": [1, "2"]}),
     "GenerateRequest.prompt_ids[1]: expected `int`, got `str`"),
    (GenerateRequest, pack({**REQUEST, "sampling": {"max_tokens": True}}),
     "GenerateRequest.sampling.max_tokens: expected `int`, got `bool`"),
    (GenerateRequest, pack({**REQUEST, "sampling": {"max_tokens": 1.0}}),
     "GenerateRequest.sampling.max_tokens: expected `int`, got `float`"),
    (GenerateRequest, pack({**REQUEST, "sampling": {"seed": "7"}}),
     "GenerateRequest.sampling.seed: expected `int | null`, got `str`"),
    (GenerateRequest, pack({**REQUEST, "sampling": []}), "GenerateRequest.sampling: expected a map, got `array`"),
    (KvPut, pack({"key": b"k", "data": "text"}), "KvPut.data: expected `bytes`, got `str`"),
    (KvGetReply, pack({"blobs": [b"x", 3]}), "KvGetReply.blobs[1]: expected `bytes | null`, got `int`"),
    (KvSnapshot, pack({"source": "s", "epoch": "e", "seq": 1, "snapshot_id": "", "hashes": {1: []}}),
     "KvSnapshot.hashes (a map key): expected `str`, got `int`"),
    (TokenEvent, b"\xc1", "TokenEvent: not msgpack ("),
    (TokenEvent, pack({"request_id": "r"})[:-1], "TokenEvent: not msgpack ("),
    (TokenEvent, pack({"request_id": "r", "index": 0, "token_ids": []}) + b"\x00", "TokenEvent: not msgpack ("),
    (TokenEvent, b"", "TokenEvent: not msgpack ("),
])
def test_bad_payloads_fail_with_the_type_and_the_field_path(cls: type, wire: bytes, message: str) -> None:
    with pytest.raises(SchemaError, match="^" + re.escape(message)):
        decode(cls, wire)


@dataclasses.dataclass(frozen=True)
class Checked:
    n: int = 0

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must not be negative")


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Checked


def test_a_schemas_own_check_fails_at_the_boundary_too() -> None:
    assert decode(Outer, pack({"inner": {"n": 2}})) == Outer(Checked(2))
    with pytest.raises(SchemaError, match=r"^Outer\.inner: n must not be negative$"):
        decode(Outer, pack({"inner": {"n": -1}}))


def test_a_schema_error_is_a_value_error() -> None:
    assert issubclass(SchemaError, ValueError)


MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=12) | st.integers(-(2**63), 2**63 - 1), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=64) | MSGPACK_VALUES.map(pack))
def test_any_bytes_decode_or_fail_as_a_schema_error(data: bytes) -> None:
    for cls in (GenerateRequest, TokenEvent, KvSnapshot):
        try:
            assert isinstance(decode(cls, data), cls)
        except SchemaError:
            pass
