"""meshjobs.jsonbody: a request body means exactly what the standard library makes of it.

Rule 1 and Rule 2 of the module: orjson answers only where it cannot differ, and whatever it
refuses gets the standard library's answer (value, or error type and message). Each case is
checked against `loads_std`, the meaning bodies have had since the first release.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjobs import jsonbody, limits


def _outcome(fn, raw: bytes):
    """What a reader makes of `raw`: ("value", v) or ("error", type, message)."""
    try:
        v = fn(raw)
    except (ValueError, RecursionError) as e:
        return ("error", type(e), str(e))
    return ("value", _canon(v))


def _canon(v):
    """A comparable form, as a flat list of tokens (walked without recursion, so that deeply
    nested values compare too): NaN-safe, and ints told from floats (1 == 1.0 in Python)."""
    out: list = []
    todo = [v]
    while todo:
        x = todo.pop()
        if isinstance(x, float):
            out.append(("float", "nan" if math.isnan(x) else repr(x)))
        elif isinstance(x, bool) or x is None:
            out.append(("const", x))
        elif isinstance(x, int):
            out.append(("int", x))
        elif isinstance(x, list):
            out.append(("list", len(x)))
            todo.extend(reversed(x))
        elif isinstance(x, dict):
            out.append(("dict", len(x)))
            for k, y in reversed(list(x.items())):
                todo.append(y)
                todo.append(("key", k))
        elif isinstance(x, tuple):
            out.append(x)
        else:
            out.append((type(x).__name__, x))
    return out


CASES = [
    # ordinary bodies
    b'{"argv": ["true"], "hold": true}', b'{"items": ["a", {"b64": "YQ=="}], "env": {"A": "1"}}',
    b'[]', b'{}', b'null', b'0', b'-0', b'-0.0', b'0.1', b'1E5', b'1.5e-324', b'  {"a": 1}\n',
    b'"\\u00e9\\ud83d\\ude00"', '"é😀"'.encode(), b'"\\u0000"',
    # duplicate keys: the last one wins
    b'{"a": 1, "a": 2}', b'{"a": {"x": 1}, "a": [2]}',
    # huge numbers: exact integers of any size, infinity past the float range
    b'9223372036854775807', b'-9223372036854775808', b'18446744073709551615',
    b'18446744073709551616', b'-9223372036854775809', b'123456789012345678901234567890',
    b'{"runtime_s": 100000000000000000000}', b'[1e400]', b'-1e400', b'1.7976931348623157e309',
    b'0.12345678901234567890123', b'1' * 400,
    # refused constants
    b'NaN', b'Infinity', b'-Infinity', b'{"a": NaN}', b'[Infinity]',
    # other encodings, BOM, bad UTF-8, lone surrogates
    b'\xef\xbb\xbf{"a": 1}', '{"a": "b"}'.encode("utf-16"), '{"a": "b"}'.encode("utf-32-le"),
    b'"\xff"', b'{"a": "\xc3"}', b'"\\ud800"', b'{"\\udfff": 1}', b'\xed\xa0\x80',
    # malformed
    b'', b' ', b'{not json', b'{"a": 1', b'{"a": 1}x', b'[1,]', b'{"a" 1}', b"{'a': 1}", b'01',
    b'1.', b'.5', b'+1', b'"\t"', b'"\\x41"', b'[1 2]', b'tru', b'nul', b'{"a":1,}',
    b'\x00', b'[' * 10,
]


@pytest.mark.parametrize("raw", CASES, ids=range(len(CASES)))
def test_same_meaning_as_the_standard_library(raw: bytes) -> None:
    """Rules 1 and 2: a value, or the same error type and message, exactly as json.loads."""
    assert _outcome(jsonbody.loads, raw) == _outcome(jsonbody.loads_std, raw)


@pytest.mark.parametrize("depth", [10, limits.json_fast_brackets_max - 1,
                                   limits.json_fast_brackets_max, 900, 990, 1000, 1023, 1100,
                                   5000, 100_000])
@pytest.mark.parametrize("opening", [b"[", b'{"a":'])
def test_deep_nesting_as_before(depth: int, opening: bytes) -> None:
    """Rule 1: nesting near either parser's depth limit is the standard library's to judge
    (a RecursionError where it gave one, a value where it gave one)."""
    closing = b"]" if opening == b"[" else b"}"
    raw = opening * depth + b"1" + closing * depth
    assert _outcome(jsonbody.loads, raw) == _outcome(jsonbody.loads_std, raw)


def test_oversized_and_long_numbers_go_the_standard_way() -> None:
    """Rule 1: a body past json_fast_bytes_max, or with a run of more digits than
    json_fast_digits_max, is not orjson's to read."""
    big = b'{"items": [' + b",".join([b'"x"'] * (limits.json_fast_bytes_max // 4)) + b"]}"
    assert len(big) > limits.json_fast_bytes_max
    assert not jsonbody.fast_ok(big)
    assert jsonbody.loads(big) == json.loads(big)
    assert not jsonbody.fast_ok(b"1" * (limits.json_fast_digits_max + 1))
    assert jsonbody.fast_ok(b"1" * limits.json_fast_digits_max)
    assert jsonbody.fast_ok(b'{"argv": ["true"]}')


def test_refusals_keep_their_words() -> None:
    """Rule 2: the error a client's 400 quotes is the standard library's own."""
    with pytest.raises(ValueError, match="NaN is not JSON"):
        jsonbody.loads(b'{"a": NaN}')
    with pytest.raises(json.JSONDecodeError, match="Expecting property name"):
        jsonbody.loads(b"{not json")
    with pytest.raises(UnicodeDecodeError):
        jsonbody.loads(b'"\xff"')


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=5), children,
                                                                      max_size=5),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_json_values, st.booleans())
def test_any_json_value_reads_back_the_same(value, ascii_only: bool) -> None:
    """Rules 1 and 2 over generated values: ints of any size, floats, text of any code point."""
    raw = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert _outcome(jsonbody.loads, raw) == _outcome(jsonbody.loads_std, raw)


@settings(max_examples=300, deadline=None)
@given(_json_values, st.data())
def test_damaged_bodies_fail_or_read_the_same(value, data) -> None:
    """Hostile input: a valid body with bytes cut, changed or inserted reads the same (or
    fails the same way) as with the standard library."""
    raw = bytearray(json.dumps(value).encode("utf-8", "surrogatepass"))
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.integers(0, len(raw)))
        what = data.draw(st.sampled_from(["cut", "set", "insert"]))
        byte = data.draw(st.sampled_from(list(b'[]{}",:0123456789.eE+-\\untrfals \xff\xc3\x00')))
        if what == "cut" and where < len(raw):
            del raw[where]
        elif what == "set" and where < len(raw):
            raw[where] = byte
        else:
            raw.insert(where, byte)
    assert _outcome(jsonbody.loads, bytes(raw)) == _outcome(jsonbody.loads_std, bytes(raw))
