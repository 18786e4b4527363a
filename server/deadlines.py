"""Per-device deadlines: each round's deadline from what each selected client is predicted to need.

A client's prediction is its own last measured per-round overhead (``Update.overhead_s``: the work outside the local
steps, such as FedVeca's gradient pass) plus its seconds per local step (the rest of its compute over the steps it ran)
times the steps it is told this round, plus its last measured transfer time. Transfers are measured on the server's
clock (from publishing a client's assignment to its update's arrival, minus the compute the client reports; the
client's own timestamp before training splits that into download and upload when it is plausible), or, in-process,
modelled from the link rates of the client's device profile. A client keeps its estimate when it misses a round, so a
device that missed one (a reconnect is enough) is given a deadline it can meet in the next, never one sized by the
clients that happened to report (``clients.deadline_factor``, ``deadline_margin_s``, ``deadline_floor_s``,
``round_deadline_s``).

What a client reports is untrusted; a lie only moves its own prediction, which ``round_deadline_s`` bounds above and
``deadline_floor_s`` below, and the steps policy clamps to ``[tau_min, tau_max]``. Its times enter clamped to physical
ranges (``physical``): seconds in [0, ``MAX_DEVICE_S``], a step at least ``MIN_S_PER_STEP``, the overhead at most the
compute it is part of, so no reported value (``compute_s = 1e-310``) makes a prediction infinite.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from edge_client.wire.messages import Update
from server.config import ClientsSection

#: Shortest seconds a local step is taken to last: no model with a gradient steps in under a microsecond on a CPU.
MIN_S_PER_STEP = 1e-6
#: Longest seconds a device's compute, overhead or transfer of one round is taken to last (a day).
MAX_DEVICE_S = 86_400.0


def physical(seconds: float) -> float:
    """A reported duration within [0, ``MAX_DEVICE_S``] (0 for a non-finite one, which admission already refuses)."""
    return min(MAX_DEVICE_S, max(0.0, seconds)) if math.isfinite(seconds) else 0.0


class LinkModel(Protocol):
    """A device class's links (a fleet profile): seconds to move bytes down and up."""

    def transfer_s(self, bytes_down: int, bytes_up: int) -> tuple[float, float]: ...


@dataclass
class Estimate:
    """A client's last measurements: compute seconds per local step, its fixed compute per round (``overhead_s``)
    and seconds spent moving its model."""

    s_per_step: float
    transfer_s: float
    round: int
    overhead_s: float = 0.0


@dataclass(frozen=True)
class Prediction:
    steps: int
    s_per_step: float
    transfer_s: float
    overhead_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.overhead_s + self.s_per_step * self.steps + self.transfer_s

    def row(self) -> dict[str, Any]:
        return {"steps": self.steps, "s_per_step": self.s_per_step, "overhead_s": self.overhead_s,
                "transfer_s": self.transfer_s, "predicted_s": self.seconds}  # fmt: skip


def _finite(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


class DeviceTimes:
    """What each client took and is predicted to take.

    ``links`` (client -> its profile) makes the times modelled, for in-process runs where clients train one after
    another: transfers at the profile's rates (none for a client without one), nothing read from the server's clock.
    """

    def __init__(self, links: Mapping[str, LinkModel] | None = None) -> None:
        self.links = dict(links or {})
        self.modelled = links is not None
        self.estimates: dict[str, Estimate] = {}
        self._t0 = 0.0
        self._sent: dict[str, tuple[float, float]] = {}  # client -> (monotonic, wall) when its assignment went out
        self._arrived: dict[str, float] = {}

    # -- one round's stamps -------------------------------------------------------------------------------------------
    def round_started(self) -> None:
        self._t0 = time.monotonic()
        self._sent.clear()
        self._arrived.clear()

    def sent(self, client_id: str) -> None:
        self._sent[client_id] = (time.monotonic(), time.time())

    def arrived(self, client_id: str) -> None:
        self._arrived[client_id] = time.monotonic()

    # -- estimates -----------------------------------------------------------------------------------------------------
    def predict(self, client_id: str, steps: int) -> Prediction | None:
        """Its overhead, ``steps`` at its last measured speed and its last transfers; None before it was measured."""
        e = self.estimates.get(client_id)
        return None if e is None else Prediction(steps, e.s_per_step, e.transfer_s, e.overhead_s)

    def record(self, round_: int, update: Update, bytes_down: int, bytes_up: int) -> dict[str, float]:
        """Take an accepted update's times into the client's estimate; its phases for the metrics row."""
        cid = update.client_id
        if self.modelled:
            link = self.links.get(cid)
            down, up = link.transfer_s(bytes_down, bytes_up) if link else (0.0, 0.0)
            phases = {"download_s": down, "upload_s": up}
        else:
            phases = self._measured(cid, update)
        transfer = phases["download_s"] + phases["upload_s"]
        self._observe(cid, round_, update.compute_s, update.local_steps, transfer, update.overhead_s)
        return phases

    def record_compute(self, round_: int, client_id: str, compute_s: float, steps: int) -> None:
        """A compute report (training without upload, no overhead reported): a new speed, the last overhead and
        transfer estimates kept."""
        last = self.estimates.get(client_id)
        overhead = min(last.overhead_s, compute_s) if last else 0.0
        self._observe(client_id, round_, compute_s, steps, last.transfer_s if last else 0.0, overhead)

    def _observe(
        self, client_id: str, round_: int, compute_s: float, steps: int, transfer_s: float, overhead_s: float = 0.0
    ) -> None:
        """The estimate from reported times, each clamped to its physical range (module docstring)."""
        compute = physical(compute_s)
        overhead = min(physical(overhead_s), compute)
        per_step = max(MIN_S_PER_STEP, (compute - overhead) / max(1, steps))
        self.estimates[client_id] = Estimate(per_step, physical(transfer_s), round_, overhead)

    def _measured(self, cid: str, update: Update) -> dict[str, float]:
        """Publish-to-arrival on the server's clock minus the reported compute, split at the client's own 'before
        training' timestamp when it falls inside that span (a device's clock may be off: then all of it is upload)."""
        sent_mono, sent_wall = self._sent.get(cid, (self._t0, time.time()))
        arrived = self._arrived.get(cid, time.monotonic())
        other = max(0.0, arrived - sent_mono - update.compute_s)
        before = update.metrics.get("before") if isinstance(update.metrics, dict) else None
        started = _finite(before.get("time")) if isinstance(before, dict) else None
        download = started - sent_wall if started is not None else -1.0
        download = download if 0.0 <= download <= other else 0.0
        return {"sent_s": sent_mono - self._t0, "arrived_s": arrived - self._t0, "download_s": download,
                "upload_s": other - download}  # fmt: skip

    def replay(self, rows: Iterable[dict[str, Any]]) -> None:
        """Rebuild the estimates from a resumed run's metrics rows."""
        for row in rows:
            for cid, c in row.get("clients", {}).items():
                transfer = c.get("download_s", 0.0) + c.get("upload_s", 0.0)
                self._observe(cid, row["round"], c["compute_s"], c["local_steps"], transfer, c.get("overhead_s", 0.0))


def round_deadline(clients: ClientsSection, predictions: Mapping[str, Prediction | None]) -> float:
    """The fixed ``round_deadline_s``, or, with ``deadline_factor``, factor x the longest prediction + margin within
    [floor, round_deadline_s]; the fixed one while any selected client has not been measured yet."""
    c = clients
    if not c.deadline_factor or not predictions or any(p is None for p in predictions.values()):
        return c.round_deadline_s
    longest = max(p.seconds for p in predictions.values() if p is not None)
    return min(c.round_deadline_s, max(c.deadline_floor_s, c.deadline_factor * longest + c.deadline_margin_s))
