"""The wire codec: encode and decode time per message, the hand-written codec ("before") versus msgspec (now).

"Before" is `shared/codec.py` as it was until 2026-12-01 (msgpack-python, then a walk over the dataclass's type
hints), kept below verbatim as the reference that `tests/unit/test_codec.py` checks the wire bytes against.
"Now" is `shared.codec`. Both see the same messages: the ones a request and its tokens pass through, with a
2K-token prompt and 700 KB KV blobs. Runs pinned to one core. Per-token cost = encode + decode of every message a
generated token rides in (decode worker -> recipe, recipe -> gateway); per-request cost = the messages a request
crosses once (recipe -> balancer -> prefill -> balancer -> decode).

    .venv/bin/python bench/codec.py [--seconds 0.02] [--rounds 15] [--out bench/results/2026-12-01-codec-cpu.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import types
import typing
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared import codec  # noqa: E402
from shared.codec import SchemaError  # noqa: E402
from shared.schemas.gateway import ApiEvent  # noqa: E402
from shared.schemas.generate import DecodeJob, GenerateRequest, PrefillJob, SamplingParams, TokenEvent  # noqa: E402
from shared.schemas.kv import KvGet, KvGetReply, KvPut  # noqa: E402
from shared.schemas.workers import Heartbeat  # noqa: E402

T = TypeVar("T")

# --- before: the hand-written codec (shared/codec.py at 9db2526); only the names changed, an unused list dropped ---


def before_encode(message: Any) -> bytes:
    return msgpack.packb(_to_wire(message), use_bin_type=True)


def before_decode(cls: type[T], data: bytes) -> T:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise SchemaError(f"{cls.__name__}: not msgpack ({exc})") from None
    return _from_wire(cls, raw)


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


def _from_wire(cls: type[T], raw: Any, path: str = "") -> T:
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
        for option in typing.get_args(tp):
            try:
                return _check(option, value, where)
            except SchemaError:
                pass
        raise SchemaError(f"{where}: {value!r:.80} matches none of {tp}")
    if tp is type(None):
        if value is None:
            return None
        raise SchemaError(f"{where}: expected nil")
    if dataclasses.is_dataclass(tp):
        return _from_wire(tp, value, where)
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise SchemaError(f"{where}: {value!r:.80} is none of {typing.get_args(tp)}")
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


# --- the messages ------------------------------------------------------------------------------------------------

PROMPT_TOKENS = 2048
BLOCK_TOKENS = 16  # SmolLM2's KV block
KV_BLOB_BYTES = 700 * 1024
RID = "chatcmpl-5f0c1a9e3b7d4c2a8e6f1b0d9c7a5e3f"
FRAME = (b'data: {"id":"' + RID.encode() + b'","object":"chat.completion.chunk","created":1764590000,'
         b'"model":"SmolLM2-135M-Instruct","choices":[{"index":0,"delta":{"content":" lighthouse"},'
         b'"logprobs":null,"finish_reason":null}]}\n\n')


def messages() -> dict[str, Any]:
    """One realistic instance of each message on the request's and the tokens' path."""
    rng = random.Random(0)
    request = GenerateRequest(
        request_id=RID,
        model="SmolLM2-135M-Instruct",
        prompt_ids=[rng.randrange(49152) for _ in range(PROMPT_TOKENS)],
        sampling=SamplingParams(max_tokens=512, temperature=0.7, top_p=0.95, seed=7, stop_token_ids=[2]),
        cache_salt="tenant-3f9a",
        arrival=1764590000.123,
    )
    hashes = [rng.randbytes(16) for _ in range(PROMPT_TOKENS // BLOCK_TOKENS)]
    blob = rng.randbytes(KV_BLOB_BYTES)
    return {
        "TokenEvent": TokenEvent(RID, index=17, token_ids=[16390]),
        "ApiEvent": ApiEvent(RID, seq=17, frames=[FRAME]),
        "Heartbeat": Heartbeat("decode-0", "decode", "SmolLM2-135M-Instruct", 0, 8, 3900, 4096, 1764590000.5,
                               cache_id="smollm2-135m/16/bf16", block_tokens=BLOCK_TOKENS),
        "GenerateRequest": request,
        "PrefillJob": PrefillJob(request, worker_id="prefill-0"),
        "DecodeJob": DecodeJob(request, 16390, hashes, rng.randbytes(16), 1024, "prefill-0", "decode-0"),
        "KvGet": KvGet(hashes[:1]),
        "KvPut": KvPut(hashes[0], blob),
        "KvGetReply": KvGetReply([blob]),
    }


# each message a generated token rides in, and the messages a request crosses once, with how many times
PER_TOKEN = {"TokenEvent": 1, "ApiEvent": 1}
PER_REQUEST = {"GenerateRequest": 1, "PrefillJob": 1, "DecodeJob": 2}


# --- timing ------------------------------------------------------------------------------------------------------


CELLS = ("enc before", "enc now", "dec before", "dec now")


def batch_size(fn: Callable[[], Any], seconds: float) -> int:
    """Calls of fn that last about `seconds` (one call of a small message is far below the clock's resolution)."""
    n = 1
    while True:
        t = timed(fn, n)
        if t >= seconds or n >= 1 << 20:
            return n
        n = max(n * 2, int(n * seconds / max(t, 1e-9)))


def timed(fn: Callable[[], Any], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t


@dataclasses.dataclass
class Row:
    name: str
    size: int
    times: dict[str, float]  # CELLS -> median seconds per call


def measure(seconds: float, rounds: int) -> list[Row]:
    """Each round times one batch of every cell in turn, so before and now share whatever else the machine is
    doing (bench/timing.py's median timer times one function's batches back to back, so it does not fit)."""
    rows = []
    for name, msg in messages().items():
        wire = codec.encode(msg)
        assert wire == before_encode(msg), f"{name}: the bytes on the wire changed"
        cls = type(msg)
        assert codec.decode(cls, wire) == before_decode(cls, wire) == msg
        fns = dict(zip(CELLS, (lambda: before_encode(msg), lambda: codec.encode(msg),
                               lambda: before_decode(cls, wire), lambda: codec.decode(cls, wire))))
        sizes = {cell: batch_size(fn, seconds) for cell, fn in fns.items()}
        samples: dict[str, list[float]] = {cell: [] for cell in CELLS}
        for _ in range(rounds):
            for cell, fn in fns.items():
                samples[cell].append(timed(fn, sizes[cell]) / sizes[cell])
        rows.append(Row(name, len(wire), {cell: statistics.median(samples[cell]) for cell in CELLS}))
    return rows


def us(s: float) -> str:
    return f"{s * 1e6:.2f}" if s < 1e-4 else f"{s * 1e6:.0f}"


def table(rows: list[Row]) -> list[str]:
    lines = ["| message | bytes | encode before us | encode now us | x | decode before us | decode now us | x |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = r.times
        lines.append(f"| {r.name} | {r.size:,} | {us(t['enc before'])} | {us(t['enc now'])} | "
                     f"{t['enc before'] / t['enc now']:.1f} | {us(t['dec before'])} | {us(t['dec now'])} | "
                     f"{t['dec before'] / t['dec now']:.1f} |")
    return lines


def path_cost(rows: list[Row], counts: dict[str, int], label: str) -> str:
    by = {r.name: r.times for r in rows}
    before = sum(n * (by[m]["enc before"] + by[m]["dec before"]) for m, n in counts.items())
    now = sum(n * (by[m]["enc now"] + by[m]["dec now"]) for m, n in counts.items())
    what = " + ".join(f"{n} x {m}" if n > 1 else m for m, n in counts.items())
    return (f"| {label} ({what}, encode + decode each) | {us(before)} | {us(now)} | {before / now:.1f} |")


def hardware() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores (pinned to one), Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=0.02, help="length of one timed batch")
    parser.add_argument("--rounds", type=int, default=15, help="timed batches per cell; the median counts")
    parser.add_argument("--out", type=Path, help="also write the report (markdown) here")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    load = os.getloadavg()[0]
    rows = measure(args.seconds, args.rounds)
    versions = f"msgpack {'.'.join(map(str, msgpack.version))}, msgspec {msgspec.__version__}"
    report = [
        f"# Wire codec: hand-written (before) vs msgspec (now), {datetime.date.today().isoformat()}",
        "",
        f"`bench/codec.py --seconds {args.seconds} --rounds {args.rounds}`; {hardware()}; {versions}; load average"
        f" {load:.1f} at the start (a shared machine: read the ratios, not the absolute times). Median of the rounds,"
        " before and now interleaved; the bytes on the wire are identical for every message (checked before"
        " timing). x = before / now.",
        "",
        *table(rows),
        "",
        "| path | before us | now us | x |",
        "|---|---:|---:|---:|",
        path_cost(rows, PER_TOKEN, "per generated token"),
        path_cost(rows, PER_REQUEST, f"per request, {PROMPT_TOKENS}-token prompt"),
    ]
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
