"""Numbered JSON Lines -> parsed records, with the line number in every error."""
from __future__ import annotations

import json
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
        yield line, obj
