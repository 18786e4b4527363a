"""The discrete-event clock of in-process buffered runs: updates are taken in the order a fleet would deliver them.

In-process, devices train one after another on this machine, so the order in which their updates reach the server is
the order they happened to run, not the order a fleet of those devices would finish in. The clock puts each device's
update at the time it would arrive: when its assignment went out, plus its download, its compute (already divided by
its profile's CPU share: ``server.experiments.fleet.slowed``) and its upload, each at its own link rates. The loop
releases updates earliest first, and only once every device training has had its update placed (in-process they all
have, as soon as the bus is idle), so a slow device's update waits behind the fast devices' later ones exactly as on a
real fleet. Over a broker there is no event clock: updates are taken as they arrive, on the wall clock.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass(order=True)
class Event:
    """An update's arrival on the event clock; ``started`` is when its assignment went out, ``phases`` its download,
    compute and upload seconds (the timeline's bars)."""

    at: float
    seq: int
    client_id: str = field(compare=False)
    started: float = field(compare=False)
    phases: dict[str, float] = field(compare=False, default_factory=dict)
    payload: Any = field(compare=False, default=None)


class EventClock:
    """Simulated seconds since the run began; advanced only by releasing the earliest event."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self._events: list[Event] = []
        self._started: dict[str, float] = {}
        self._seq = itertools.count()

    def started(self, client_id: str) -> None:
        """``client_id`` was sent an assignment now."""
        self._started[client_id] = self.now

    def advance(self, seconds: float) -> None:
        """Work the devices wait for (the server's aggregation, on its CPU seconds) moves the clock on."""
        self.now += max(0.0, seconds)

    def place(self, client_id: str, download_s: float, compute_s: float, upload_s: float, payload: Any = None) -> Event:
        """The update of ``client_id``'s assignment in progress arrives after these phases."""
        start = self._started.pop(client_id, self.now)
        phases = {"download_s": download_s, "compute_s": compute_s, "upload_s": upload_s}
        event = Event(start + download_s + compute_s + upload_s, next(self._seq), client_id, start, phases, payload)
        heapq.heappush(self._events, event)
        return event

    def waiting(self) -> set[str]:
        """Devices whose assignment went out and whose update has not been placed."""
        return set(self._started)

    def forget(self, client_id: str) -> None:
        """``client_id``'s assignment ended without an update (it failed, or went offline)."""
        self._started.pop(client_id, None)

    def __len__(self) -> int:
        return len(self._events)

    def pop(self) -> Event:
        """The earliest placed update; the clock moves to its arrival (never backwards)."""
        event = heapq.heappop(self._events)
        self.now = max(self.now, event.at)
        return event
