"""Every JSON file a run writes (metrics.jsonl, summary.json, live.json, the dashboard's state) is strict JSON.

Python's ``json`` writes NaN and Infinity, which no strict parser (``JSON.parse``, jq, pandas' default) reads: one
device's NaN loss or absurd compute time made ``metrics.jsonl`` unreadable and stopped the live page for everyone.
``strict_json`` serialises with ``allow_nan=False`` and, when a value does not fit, writes its ``json_safe`` copy
(non-finite numbers, bytes and other types left out of maps, null in lists) and logs what happened: a record is never
lost.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from typing import Any

log = logging.getLogger("edgefl.server")

#: What a device-given value may hold once stored: texts cut to this many characters, maps and lists to this many
#: entries, nesting to this depth; anything else (bytes, NaN, Inf, other types) is dropped.
MAX_TEXT, MAX_ENTRIES, MAX_DEPTH = 256, 32, 3


def json_safe(value: Any, depth: int = MAX_DEPTH, entries: int = MAX_ENTRIES) -> Any:
    """``value`` as strict JSON can carry it: finite numbers, booleans, None, texts cut short, and maps (text keys) and
    lists of those, at most ``entries`` long and ``depth`` deep; what does not fit is dropped (None in a list, left
    out of a map)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**53 else None  # beyond that a browser's number is not the value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value[:MAX_TEXT]
    if depth <= 0:
        return None
    if isinstance(value, list | tuple):
        return [json_safe(v, depth - 1, entries) for v in value[:entries]]
    if not isinstance(value, dict):
        return None
    kept: dict[str, Any] = {}
    for k, v in value.items():
        if len(kept) == entries:
            break
        safe = json_safe(v, depth - 1, entries)
        if isinstance(k, str) and safe is not None:
            kept[k[:MAX_TEXT]] = safe
    return kept


def strict_json(value: Any, indent: int | None = None) -> str:
    """``value`` as strict JSON (no NaN or Infinity); when it cannot be, its ``json_safe`` copy, and a warning."""
    try:
        return json.dumps(value, allow_nan=False, indent=indent)
    except (TypeError, ValueError) as exc:
        log.warning("record not strict JSON (%s); writing it without the offending values", exc)
        return json.dumps(json_safe(value, depth=16, entries=sys.maxsize), allow_nan=False, indent=indent)
