"""What every answer carries on the wire: ids, timestamps, and server-sent event framing."""

from __future__ import annotations

import json
import time
import uuid


def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# Characters that JSON leaves raw (ensure_ascii=False) but that Python's str.splitlines breaks lines
# at, as clients reading a stream with httpx's or requests' iter_lines do: escaped in events.
_LINE_BREAKING = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})

DONE = "data: [DONE]\n\n"  # the end of a chat or completions stream


def sse(payload: dict, event: str | None = None) -> str:
    """One server-sent event: a single `data:` line (UTF-8 JSON), whatever text it carries, after an
    `event:` line where the event is named (the Responses API's)."""
    name = f"event: {event}\n" if event else ""
    return f"{name}data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKING)}\n\n"
