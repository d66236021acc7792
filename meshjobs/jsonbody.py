"""Request bodies as JSON: the standard library's meaning, orjson's speed where they agree.

Theory of operation. A request body means exactly what `json.loads(raw, parse_constant=...)`
makes of it (the contract of every route since the first release): NaN and Infinity refused,
any size of integer kept exact, 1e400 read as infinity, a UTF-8 BOM and UTF-16/32 bodies
accepted, a lone surrogate escape kept, duplicate keys won by the last, and a body nested
deeper than the interpreter's recursion limit refused (RecursionError). orjson parses the common
body several times faster, but differs on each of those points. So:

Rule 1: orjson answers only bodies where it cannot differ: at most `json_fast_bytes_max` bytes,
        with no run of `json_fast_digits_max` + 1 digits (orjson turns an integer past 64 bits
        into a float) and fewer than `json_fast_brackets_max` opening brackets in all (so no
        nesting near either parser's depth limit).
Rule 2: whatever orjson refuses goes to the standard library, whose answer (a value, or its own
        error and message) is the answer: NaN, Infinity, 1e400, a BOM, UTF-16, lone surrogates
        and broken bodies all behave exactly as before.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from meshjobs import limits

_LONG_NUMBER = re.compile(rb"[0-9]{%d}" % (limits.json_fast_digits_max + 1))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_std(raw: bytes) -> Any:
    """The meaning of a body: `json.loads` with NaN and Infinity refused (ValueError)."""
    return json.loads(raw, parse_constant=_no_constants)


def fast_ok(raw: bytes) -> bool:
    """Whether orjson reads `raw` exactly as `loads_std` does, if it reads it at all (Rule 1)."""
    return (len(raw) <= limits.json_fast_bytes_max
            and raw.count(b"[") + raw.count(b"{") < limits.json_fast_brackets_max
            and _LONG_NUMBER.search(raw) is None)


def loads(raw: bytes) -> Any:
    """A request body's value, exactly as `loads_std` gives it; raises what it raises
    (ValueError, including json.JSONDecodeError and UnicodeDecodeError, or RecursionError)."""
    if fast_ok(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # Rule 2: the standard library's answer, value or error, is the answer
    return loads_std(raw)
