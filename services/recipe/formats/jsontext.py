"""JSON text exactly as the DeepSeek prompt formats print it (tool schemas, tool-call arguments, JSON schemas).

Three styles, all with non-ASCII kept as is and object keys in the client's order:

    python   `json.dumps(v, ensure_ascii=False)`: ", " and ": " separators, floats as Python's repr (1e-07)
    spaced   the same separators, floats as Rust's shortest form with an explicit exponent sign: 1e-7, 1.5e+20,
             0.00001 (a decimal point from 1e-5 up, where Python switches to exponents at 1e-4)
    compact  "," and ":" separators, floats as in `spaced` (the output-constraint strings)

V4 prints with `spaced`, V4.1 with `python`; integers and strings print the same in all three. Values come from
`orjson.loads`, so integers beyond 64 bits are already floats, as in the reference's JSON parser.
"""

from __future__ import annotations

import json
from typing import Any, Literal

Style = Literal["python", "spaced", "compact"]

_ENCODE_STRING = json.encoder.py_encode_basestring  # escapes '"', '\\' and control characters only


def dumps(value: Any, style: Style = "spaced") -> str:
    parts: list[str] = []
    _write(value, style, parts)
    return "".join(parts)


def _write(value: Any, style: Style, out: list[str]) -> None:
    item_sep, key_sep = (",", ":") if style == "compact" else (", ", ": ")
    if isinstance(value, str):
        out.append(_ENCODE_STRING(value))
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, float):
        out.append(repr(value) if style == "python" else shortest_float(value))
    elif isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            if i:
                out.append(item_sep)
            out.append(_ENCODE_STRING(str(key)))
            out.append(key_sep)
            _write(item, style, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(item_sep)
            _write(item, style, out)
        out.append("]")
    else:
        raise TypeError(f"not a JSON value: {type(value).__name__}")


def shortest_float(x: float) -> str:
    """The shortest round-trip digits of `x` (Python's repr finds the same ones), laid out as Rust's `ryu`
    does, plus a '+' on positive exponents. With `kk` the decimal exponent (x = 0.DIGITS * 10**kk):

        kk in (0, 16]   -> 123.45 / 1200.0      kk in (-5, 0] -> 0.00012      otherwise -> 1.2e+20 / 1e-7
    """
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError("JSON has no NaN or infinity")
    text = repr(x)
    sign = "-" if text.startswith("-") else ""
    text = text.lstrip("-")
    mantissa, _, exp_text = text.partition("e")
    whole, _, frac = mantissa.partition(".")
    frac = "" if frac == "0" else frac
    digits = (whole + frac).lstrip("0")
    kk = len(whole) + (int(exp_text) if exp_text else 0)
    if not digits:
        return sign + "0.0"
    if whole == "0":  # 0.000123 -> digits "123"; the point sits before the leading zeros of `frac`
        kk = -(len(frac) - len(frac.lstrip("0"))) + (int(exp_text) if exp_text else 0)
    digits = digits.rstrip("0") or "0"
    if 0 < kk <= 16:
        if kk >= len(digits):
            return f"{sign}{digits}{'0' * (kk - len(digits))}.0"
        return f"{sign}{digits[:kk]}.{digits[kk:]}"
    if -5 < kk <= 0:
        return f"{sign}0.{'0' * -kk}{digits}"
    exp = kk - 1
    head = digits[0] + (f".{digits[1:]}" if len(digits) > 1 else "")
    return f"{sign}{head}e{'+' if exp > 0 else '-'}{abs(exp)}"
