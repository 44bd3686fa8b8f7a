"""Numbered JSON Lines -> parsed records, with the line number in every error, and the
checks of the fields both trace formats share (numbers, sessions).

Python's json reads more than JSON: NaN, Infinity and numbers past a float's range
(1e400 -> inf), integers of any length up to a digit limit, and nesting up to the
recursion limit. A trace is a user's file, so each of these is a TraceError naming the
line, never a ValueError, OverflowError or RecursionError from deep inside a replay.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Any, Iterable, Iterator

from kvtier.errors import TraceError


def json_records(lines: Iterable[tuple[int, str]], path: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each numbered line; a line that is not JSON is a TraceError."""
    for line, text in lines:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(path, line, f"not valid JSON ({e.msg} at column {e.colno}): traces are "
                             "JSON Lines, one request object per line") from None
        except ValueError:   # the only other one: an integer literal past Python's digit limit
            raise TraceError(path, line, f"not a trace record: an integer of more than "
                             f"{sys.get_int_max_str_digits()} digits") from None
        except RecursionError:
            raise TraceError(path, line, "not a trace record: JSON arrays or objects nested too deeply; "
                             "a trace has one flat request object per line") from None
        yield line, obj


def _shown(v: Any) -> str:
    """A field's value for an error message: short, in JSON's words, and safe on any parsed
    value (a repr of a long or deeply nested list could be huge or raise RecursionError)."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, float) and math.isinf(v):
        sign = "-" if v < 0 else ""
        return f"{sign}Infinity (or a number past a float's range, like {sign}1e400)"
    if isinstance(v, (int, float, str)):
        r = repr(v) if not isinstance(v, int) or v.bit_length() < 128 else f"an integer of {len(str(v))} digits"
        return r if len(r) <= 60 else r[:57] + "..."
    return "a JSON array" if isinstance(v, list) else "a JSON object"


def non_negative_number(v: Any, name: str, path: str, line: int) -> int | float:
    """`v` itself when it is a finite number >= 0 (an int or a float); anything else, NaN, an
    infinity and an integer too large for a float included, is a TraceError naming the line,
    so no int() or float() of it can fail later."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if ok:
        try:
            ok = math.isfinite(v) and v >= 0
        except OverflowError:   # an int past a float's range (about 1.8e308)
            ok = False
    if not ok:
        raise TraceError(path, line, f"field {name!r} must be a finite, non-negative number, got {_shown(v)}")
    return v


#: The most tokens a trace's length field may give: far past any model's context, and small
#: enough that every count derived from it (blocks, simulated decode steps) stays sane.
MAX_TOKEN_COUNT = 1 << 31


def token_count(v: Any, name: str, path: str, line: int) -> int:
    """A length field (input_length, output_length) as a whole number of tokens (a float is
    truncated); anything but a number in [0, MAX_TOKEN_COUNT] is a TraceError naming the line."""
    n = non_negative_number(v, name, path, line)
    if n > MAX_TOKEN_COUNT:
        raise TraceError(path, line, f"field {name!r} is {_shown(v)} tokens, more than the "
                         f"{MAX_TOKEN_COUNT:,} a trace may give: check the field's unit (tokens)")
    return int(n)


def session_field(obj: dict[str, Any], path: str, line: int) -> str | None:
    """The record's 'session' as a string (None when absent or null). It must be a string or
    an integer, and a string must be valid Unicode (JSON's "\\ud800" is not), since routers
    hash and send it as UTF-8."""
    v = obj.get("session")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise TraceError(path, line, f"field 'session' must be a string or an integer, got {_shown(v)}")
    s = str(v)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise TraceError(path, line, "field 'session' is not valid Unicode (a lone surrogate such as "
                         "\\ud800): give the session id as plain text") from None
    return s
