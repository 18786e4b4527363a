"""What the dashboard shows, built from the run directory alone: ``live.json`` (the orchestrator's recorder,
server/live_state.py), ``metrics.jsonl`` (one row per finished round), ``summary.json`` and ``timeline.png``.

``metrics.jsonl`` is read incrementally (only appended bytes, only complete lines) and read again from the start when
a new or resumed run rewrites it. Every value a client sent (its hello's device facts, the metrics of its updates) is
untrusted: numbers are kept only when they are finite numbers, texts are cut short, and the page sets them as text,
never as markup. The state goes out as strict JSON (no NaN: ``JSON.parse`` refuses it, and the page would stop).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.live_state import LIVE_FILE
from server.strict_json import strict_json

TIMELINE_FILE = "timeline.png"
#: Hello fields that name a device's class (a fleet profile); without one, the class is told by its hardware.
DEVICE_CLASS_KEYS = ("device_class", "profile")


def _num(value: Any) -> float | None:
    """A finite number, or None (metrics.jsonl keeps what devices sent, NaN and Infinity included)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        return None
    return number if math.isfinite(number) else None


def _text(value: Any, limit: int = 64) -> str | None:
    return None if value is None else str(value)[:limit]


def _device_class(device: dict[str, Any]) -> str | None:
    """``pi4`` when the hello names a class, else e.g. ``aarch64, 4 cores, 3.7 GiB`` from what it says it is."""
    named = next((device[k] for k in DEVICE_CLASS_KEYS if device.get(k)), None)
    if named is not None:
        return _text(named)
    cores, memory = _num(device.get("cpu_count")), _num(device.get("memory_mb"))
    parts = [
        _text(device.get("machine"), 16),
        f"{cores:.0f} cores" if cores else None,
        f"{memory / 1024:.1f} GiB" if memory else None,
    ]
    return ", ".join(p for p in parts if p) or None


def _counts(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    return {_text(k, 32) or "": int(v) for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)}


@dataclass
class _ClientRounds:
    """One client's figures over the rows read so far."""

    compute_s: list[float] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)
    missed: int = 0


def _client_report(report: Any) -> dict[str, Any]:
    """The dashboard's columns from one client's entry in a metrics row."""
    report = report if isinstance(report, dict) else {}
    device = report.get("device") if isinstance(report.get("device"), dict) else {}
    rnd = device.get("round") if isinstance(device.get("round"), dict) else {}
    upload = device.get("last_upload") if isinstance(device.get("last_upload"), dict) else {}
    flags = rnd.get("throttled_flags")
    return {
        "compute_s": _num(report.get("compute_s")),
        "cpu_s": _num(report.get("cpu_s")),
        "bytes_up": _num(report.get("bytes_up")),  # measured by the server's link
        "upload_s": _num(upload.get("upload_s")),  # the client's previous upload: it travels with the next update
        "temperature_c": _num(rnd.get("temperature_c_after")),
        "cpu_freq_mhz": _num(rnd.get("cpu_freq_mhz_after")),
        "throttled": [_text(f, 32) for f in flags] if isinstance(flags, list) else None,
    }


class RunView:
    """The page's state for one run directory; rebuilt only when one of its files changed."""

    def __init__(self, run_dir: Path, facts: dict[str, Any] | None = None) -> None:
        """``facts``: the run facts the command knows before its server writes ``live.json`` (``run_facts``)."""
        self.run_dir = Path(run_dir)
        self.facts = dict(facts or {})
        self._offset = 0
        self._points: list[list[float]] = []  # [round, elapsed_s, accuracy]
        self._rejected: dict[str, int] = {}
        self._clients: dict[str, _ClientRounds] = {}
        self._epsilon: float | None = None  # the privacy budget spent so far ([privacy]; None: no DP)
        self._stamp: tuple[Any, ...] | None = None
        self._cached: bytes = b"{}"

    def snapshot(self) -> bytes:
        """The state as JSON; the same object (``is``) while no file changed."""
        stamp = tuple(self._stat(name) for name in (LIVE_FILE, "metrics.jsonl", "summary.json", TIMELINE_FILE))
        if stamp != self._stamp:
            self._stamp = stamp
            self._cached = strict_json(self.build()).encode()
        return self._cached

    def build(self) -> dict[str, Any]:
        self._read_metrics()
        live = self._read_json(LIVE_FILE)
        summary = self._read_json("summary.json")
        run = {**self.facts, **(live.get("run") or {})}
        # summary.json may be left from an earlier run in the same directory: only a run without live.json (one from
        # before the dashboard) is judged by it
        run["finished"] = bool(run.get("finished")) if live else bool(summary)
        if not live and summary:
            run.update(algorithm=summary.get("algorithm"), dataset=summary.get("dataset"))
            run.update(target=summary.get("target_accuracy"), rounds=summary.get("rounds"))
        target = _num(run.get("target"))
        reached = next((p for p in self._points if target is not None and p[2] >= target), None)
        timeline = self._stat(TIMELINE_FILE)
        return {
            "run": run,
            "rounds_done": len(self._points),
            "elapsed_s": self._points[-1][1] if self._points else None,
            "points": self._points,
            "best_accuracy": max((p[2] for p in self._points), default=None),
            "reached": {"round": reached[0], "elapsed_s": reached[1]} if reached else None,
            "rejected": self._rejected,  # in finished rounds, all clients
            "clients": self._client_rows(live),
            "timeline": timeline[0] if timeline else None,  # its mtime: the page reloads the image when it changes
            "updated_at": live.get("updated_at"),
            "epsilon": self._epsilon,
        }

    # -- files -------------------------------------------------------------------------------------------------------
    def _stat(self, name: str) -> tuple[int, int] | None:
        try:
            st = (self.run_dir / name).stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _read_json(self, name: str) -> dict[str, Any]:
        try:
            data = json.loads((self.run_dir / name).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _read_metrics(self) -> None:
        """Take the rows appended since the last read; start over when the file was rewritten under us (a new run,
        or a resumed one that dropped rows): then its rows no longer continue the ones read."""
        for _ in range(2):
            rows, consumed = self._appended()
            if all(row.get("round") == len(self._points) + 1 + i for i, row in enumerate(rows)):
                for row in rows:
                    self._add_row(row)
                self._offset += consumed
                return
            self._reset()

    def _appended(self) -> tuple[list[dict[str, Any]], int]:
        """Complete rows after ``_offset`` and their length in bytes (a line still being written waits)."""
        try:
            with (self.run_dir / "metrics.jsonl").open("rb") as fh:
                if fh.seek(0, 2) < self._offset:
                    self._reset()
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            self._reset()
            return [], 0
        complete = data[: data.rfind(b"\n") + 1]
        rows = []
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            rows.append(row if isinstance(row, dict) else {})
        return rows, len(complete)

    def _reset(self) -> None:
        self._offset, self._points, self._rejected, self._clients, self._epsilon = 0, [], {}, {}, None

    def _add_row(self, row: dict[str, Any]) -> None:
        self._points.append([row["round"], _num(row.get("elapsed_s")) or 0.0, _num(row.get("accuracy")) or 0.0])
        self._epsilon = _num(row.get("epsilon"))
        for reason, count in _counts(row.get("rejected")).items():
            self._rejected[reason] = self._rejected.get(reason, 0) + count
        reports = row.get("clients") if isinstance(row.get("clients"), dict) else {}
        for cid, report in reports.items():
            c = self._clients.setdefault(_text(cid) or "", _ClientRounds())
            c.last = {"round": row["round"], **_client_report(report)}
            if c.last["compute_s"] is not None:
                c.compute_s.append(c.last["compute_s"])
        for cid in row.get("missing") or []:
            self._clients.setdefault(_text(cid) or "", _ClientRounds()).missed += 1

    # -- the page's figures ------------------------------------------------------------------------------------------
    def _client_rows(self, live: dict[str, Any]) -> list[dict[str, Any]]:
        live_clients = live.get("clients") if isinstance(live.get("clients"), dict) else {}
        rows = []
        for cid in sorted(set(live_clients) | set(self._clients)):
            state = live_clients.get(cid) if isinstance(live_clients.get(cid), dict) else {}
            device = state.get("device") if isinstance(state.get("device"), dict) else {}
            rounds = self._clients.get(cid, _ClientRounds())
            told = state.get("told") if isinstance(state.get("told"), dict) else {}
            rows.append(
                {
                    "id": _text(cid),
                    "online": state.get("online") if isinstance(state.get("online"), bool) else None,
                    "last_seen": _num(state.get("last_seen")),
                    "device_class": _device_class(device),
                    "host": _text(device.get("hostname")),
                    "rounds_reported": len(rounds.compute_s),
                    "rounds_missed": rounds.missed,
                    "median_compute_s": statistics.median(rounds.compute_s) if rounds.compute_s else None,
                    "last": rounds.last,
                    "rejected": _counts(state.get("rejected")),
                    "told": {k: _num(v) for k, v in told.items()},
                }
            )
        return rows
