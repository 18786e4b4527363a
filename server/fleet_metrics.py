"""The run and its fleet as Prometheus metrics: what ``--metrics HOST:PORT`` serves (server/metrics_endpoint.py).

Devices behind MQTT cannot be scraped, so the server re-exports what they report (the mqtt2prometheus pattern). Two
sources, the dashboard's own: every finished round's metrics row (this object is the orchestrator's round observer
and hands each call on to the console's), and ``live.json`` (server/live_state.py: who is online, last seen,
registered, rejected by reason), read when Prometheus scrapes. Each scrape builds the families afresh from that state
(a custom collector, as an exporter of another system's numbers does), so a series exists only while its label set
is current.

Labels are bounded whatever devices send: ``device`` is a registered device's id (``CLIENT_ID_RE``; at most
``MAX_DEVICES`` of them, the rest count as ``other``; rejections of senders that never registered as
``unregistered``), ``device_class`` is the server's ``fleet_summary.device_class`` (a checked name or the machine and
core count), ``reason`` one of the refusal reasons the code declares (``ProtocolError`` subclasses, the codecs'),
``flag`` one of ``THROTTLE_BITS``' names; anything else is ``other``. Values a device sent pass ``json_safe`` (the
dashboard's sanitisation): only finite numbers are kept, counters only grow.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge_client.loop.device import THROTTLE_BITS
from edge_client.wire import codecs
from edge_client.wire.protocol import ProtocolError
from edge_client.wire.topics import CLIENT_ID_RE
from server.fleet_summary import device_class
from server.live_state import LIVE_FILE
from server.strict_json import json_safe
from server.target import Target

if TYPE_CHECKING:
    from server.orchestrator import RoundObserver

#: Devices exported one by one; past this many (a broker open to anyone), the rest are summed as ``other``.
MAX_DEVICES = 1000
OTHER, UNREGISTERED = "other", "unregistered"
#: Free-form map entries a decoder dropped are counted as ``dropped_<why>`` (edge_client/wire/schema.py: FreeMap).
_DROPPED_RE = re.compile(r"dropped_[a-z_]{1,24}")
_CODEC_RE = re.compile(r"[a-z0-9:+.]{1,32}")

DEVICE = ("device", "device_class")
RUN = ("algorithm",)
#: Every metric served: name -> (type, help, labels). The Grafana dashboard and the alerting rules may use these.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "edgefl_device_online": ("gauge", "1 while the device is online (registered, no last will since)", DEVICE),
    "edgefl_device_last_seen_timestamp_seconds": (
        "gauge", "When the server last heard from the device (any message), Unix time on the server's clock", DEVICE,
    ),
    "edgefl_device_rounds_reported_total": ("counter", "Rounds whose update the server admitted", DEVICE),
    "edgefl_device_rounds_missed_total": (
        "counter", "Rounds the device was selected for whose update did not arrive by the deadline", DEVICE,
    ),
    "edgefl_device_rounds_since_update": (
        "gauge", "Rounds finished since the device's last admitted update (all of them if it has sent none)", DEVICE,
    ),
    "edgefl_device_compute_seconds_total": (
        "counter", "Seconds of local training the device reported, on its own clock (uploads and compute reports)",
        DEVICE,
    ),
    "edgefl_device_local_steps_total": ("counter", "Local optimisation steps the device reported", DEVICE),
    "edgefl_device_upload_seconds_total": (
        "counter", "Seconds the device's updates travelled up, measured by the server (arrival minus compute)", DEVICE,
    ),
    "edgefl_device_download_seconds_total": (
        "counter", "Seconds from the server's assignment to the device's start of training", DEVICE,
    ),
    "edgefl_device_upload_bytes_total": ("counter", "Bytes of the device's updates on the server's link", DEVICE),
    "edgefl_device_download_bytes_total": (
        "counter", "Bytes the device's link carried down: assignments, the round's model, models it asked for", DEVICE,
    ),
    "edgefl_device_codec_info": ("gauge", "1 for the upload codec the device was last told to use", (*DEVICE, "codec")),
    "edgefl_device_cpu_temperature_celsius": ("gauge", "CPU temperature after the device's last round", DEVICE),
    "edgefl_device_cpu_frequency_hertz": ("gauge", "CPU frequency after the device's last round", DEVICE),
    "edgefl_device_throttled": (
        "gauge", "1 if the device's last round reported this throttling flag (Raspberry Pi get_throttled), else 0",
        (*DEVICE, "flag"),
    ),
    "edgefl_device_peak_rss_bytes": ("gauge", "Peak resident memory of the device's client process", DEVICE),
    "edgefl_rejected_messages_total": (
        "counter", "Messages the server refused, by sender and reason",
        ("device", "reason"),
    ),
    "edgefl_run_round": ("gauge", "The last finished round", RUN),
    "edgefl_run_rounds_planned": ("gauge", "The rounds the run is configured for (run.rounds)", RUN),
    "edgefl_run_rounds_total": ("counter", "Rounds finished by this server process", RUN),
    "edgefl_run_finished": ("gauge", "1 once the run has ended", RUN),
    "edgefl_run_elapsed_seconds": ("gauge", "The run's clock (elapsed_s) at the last finished round", RUN),
    "edgefl_run_accuracy": ("gauge", "Accuracy of the last evaluated round's model (of the target's evaluation)", RUN),
    "edgefl_run_target_metric": ("gauge", "The target metric of the last evaluated round", (*RUN, "metric")),
    "edgefl_run_target_value": ("gauge", "The value of the target metric counted as reached", (*RUN, "metric")),
    "edgefl_run_time_to_target_seconds": (
        "gauge", "The run's clock when the target was first reached (absent until then)", (*RUN, "metric"),
    ),
    "edgefl_run_round_seconds_total": ("counter", "Wall seconds of the rounds, assignment to aggregate", RUN),
    "edgefl_run_aggregation_seconds_total": ("counter", "Wall seconds the server spent aggregating updates", RUN),
    "edgefl_run_evaluation_seconds_total": ("counter", "Wall seconds of the server's test-set evaluations", RUN),
    "edgefl_run_dp_epsilon": ("gauge", "Differential privacy budget spent so far (only when DP is on)", RUN),
    "edgefl_run_dp_delta": ("gauge", "The delta at which edgefl_run_dp_epsilon is spent (only when DP is on)", RUN),
}  # fmt: skip


def declared_reasons() -> frozenset[str]:
    """Every refusal reason the code declares: the ``reason`` of each ``ProtocolError`` class and the codecs'."""
    reasons, todo = set(codecs.REASONS), [ProtocolError]
    while todo:
        cls = todo.pop()
        reasons.add(cls.reason)
        todo.extend(cls.__subclasses__())
    return frozenset(reasons)


def _finite(value: Any) -> float | None:
    """A finite number of what a device sent (``json_safe`` drops the rest), or None."""
    value = json_safe(value, depth=0)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _amount(value: Any) -> float:
    """What a counter may add: a finite number >= 0, else 0."""
    number = _finite(value)
    return number if number is not None and number > 0 else 0.0


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


@dataclass
class _Device:
    """One device's totals over the rounds observed, and what its last round said."""

    totals: Counter[str] = field(default_factory=Counter)  # metric name -> sum
    device_class: str = ""
    last_update_round: int = 0
    codec: str | None = None
    temperature_c: float | None = None
    frequency_mhz: float | None = None
    peak_rss_mb: float | None = None
    throttled: list[str] | None = None  # None: the device reports no throttling state (not a Raspberry Pi)


class FleetMetrics(Collector):
    """A round observer (it hands each call on to ``inner``) and a Prometheus collector of the run in ``run_dir``."""

    def __init__(self, run_dir: Path, target: Target, algorithm: str, inner: RoundObserver) -> None:
        self.live_path = Path(run_dir) / LIVE_FILE
        self.target = target
        self.algorithm = algorithm
        self.inner = inner
        self.created = time.time()  # a live.json written before this is an earlier run's
        self.reasons = declared_reasons()
        self._lock = threading.Lock()
        self._devices: dict[str, _Device] = {}
        self._run: Counter[str] = Counter()
        self._last: dict[str, float] = {"edgefl_run_round": 0.0}  # the run's gauges from the last row

    # -- the observer (orchestrator thread) --------------------------------------------------------------------------
    def waiting(self, text: str) -> None:
        self.inner.waiting(text)

    def round_done(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._take(row)
        self.inner.round_done(row)

    def _take(self, row: dict[str, Any]) -> None:
        round_ = int(row["round"])
        self._run.update(
            edgefl_run_rounds_total=1,
            edgefl_run_round_seconds_total=_amount(row.get("round_s")),
            edgefl_run_aggregation_seconds_total=_amount(row.get("aggregate_s")),
            edgefl_run_evaluation_seconds_total=_amount(row.get("eval_s")),
        )
        gauges = {
            "edgefl_run_round": float(round_),
            "edgefl_run_elapsed_seconds": _finite(row.get("elapsed_s")),
            "edgefl_run_accuracy": self.target.of(row, "accuracy"),
            "edgefl_run_target_metric": self.target.of(row),
            "edgefl_run_dp_epsilon": _finite(row.get("epsilon")),
            "edgefl_run_dp_delta": _finite(row.get("delta")),
        }
        self._last.update({k: v for k, v in gauges.items() if v is not None and math.isfinite(v)})
        if "edgefl_run_time_to_target_seconds" not in self._last and self.target.reached(self.target.of(row)):
            self._last["edgefl_run_time_to_target_seconds"] = _finite(row.get("elapsed_s")) or 0.0
        told = _map(row.get("instructions"))
        for cid, report in _map(row.get("clients")).items():
            d = self._device(cid)
            if d is None:
                continue
            report = _map(report)
            d.last_update_round = round_
            d.device_class = self._class(report.get("device_class")) or d.device_class
            d.totals.update(
                edgefl_device_rounds_reported_total=1,
                edgefl_device_compute_seconds_total=_amount(report.get("compute_s")),
                edgefl_device_local_steps_total=_amount(report.get("local_steps")),
                edgefl_device_upload_seconds_total=_amount(report.get("upload_s")),
                edgefl_device_download_seconds_total=_amount(report.get("download_s")),
                edgefl_device_upload_bytes_total=_amount(report.get("bytes_up")),
                edgefl_device_download_bytes_total=_amount(report.get("bytes_down")),
            )
            self._device_round(d, _map(_map(report.get("device")).get("round")))
            codec = _map(told.get(cid)).get("codec")
            d.codec = codec if isinstance(codec, str) and _CODEC_RE.fullmatch(codec) else OTHER
        for entry in row.get("train_only") or []:  # trained without uploading: its compute counts all the same
            entry = _map(entry)
            d = self._device(entry.get("client"))
            if d is not None:
                d.totals.update(
                    edgefl_device_compute_seconds_total=_amount(entry.get("compute_s")),
                    edgefl_device_local_steps_total=_amount(entry.get("local_steps")),
                )
        for cid in row.get("missing") or []:
            d = self._device(cid)
            if d is not None:
                d.totals["edgefl_device_rounds_missed_total"] += 1

    def _device_round(self, d: _Device, facts: dict[str, Any]) -> None:
        """The device's own account of its last round (``edge_client.loop.device.summarise``), untrusted."""
        d.temperature_c = _finite(facts.get("temperature_c_after"))
        d.frequency_mhz = _finite(facts.get("cpu_freq_mhz_after"))
        d.peak_rss_mb = _finite(facts.get("peak_rss_mb"))
        flags = facts.get("throttled_flags")
        d.throttled = [f if f in THROTTLE_BITS.values() else OTHER for f in flags] if isinstance(flags, list) else None

    def _device(self, cid: Any) -> _Device | None:
        """The record of device ``cid``: None for an id no device may have, ``other``'s past ``MAX_DEVICES``."""
        if not isinstance(cid, str) or not CLIENT_ID_RE.fullmatch(cid):
            return None
        if cid not in self._devices and len(self._devices) >= MAX_DEVICES:
            cid = OTHER
        return self._devices.setdefault(cid, _Device())

    @staticmethod
    def _class(value: Any) -> str | None:
        """A device class as ``fleet_summary.device_class`` makes it (it checks what the device named)."""
        return value[:64] if isinstance(value, str) and value else None

    # -- the collector (a scrape's thread) ---------------------------------------------------------------------------
    def _live(self) -> dict[str, Any]:
        """This run's ``live.json``, or {} (none yet, an earlier run's, or unreadable)."""
        try:
            live = json.loads(self.live_path.read_text())
        except (OSError, ValueError):
            return {}
        started = _finite(_map(_map(live).get("run")).get("started_at"))
        return live if started is not None and started >= self.created - 1.0 else {}

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families are built per scrape; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        live = self._live()
        with self._lock:
            families = self._families(live)
        yield from families.values()

    def _families(self, live: dict[str, Any]) -> dict[str, Metric]:
        fams: dict[str, Metric] = {}
        for name, (kind, text, labels) in METRICS.items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fams[name] = cls(name, text, labels=labels)

        def add(name: str, labels: tuple[str, ...], value: float | None) -> None:
            if value is not None:
                fams[name].add_metric(list(labels), value)

        run = _map(live.get("run"))
        algo = (self.algorithm,)
        for name, value in self._run.items():
            add(name, algo, value)
        for name, value in self._last.items():
            add(name, (*algo, self.target.metric) if len(METRICS[name][2]) == 2 else algo, value)
        add("edgefl_run_target_value", (*algo, self.target.metric), self.target.value)
        add("edgefl_run_rounds_planned", algo, _finite(run.get("rounds")))
        add("edgefl_run_finished", algo, 1.0 if run.get("finished") is True else 0.0)

        clients = {cid: _map(c) for cid, c in _map(live.get("clients")).items()}
        for cid, state in clients.items():  # registered devices this server has not had a round row of yet
            if "registered_at" in state:
                d = self._device(cid)
                if d is not None and not d.device_class:
                    d.device_class = device_class(_map(state.get("device")))
        finished = int(self._last.get("edgefl_run_round", 0))
        for cid, d in self._devices.items():
            labels = (cid, d.device_class or "unknown")
            state = clients.get(cid, {})
            add("edgefl_device_online", labels, 1.0 if state.get("online") is True else 0.0)
            add("edgefl_device_last_seen_timestamp_seconds", labels, _finite(state.get("last_seen")))
            add("edgefl_device_rounds_since_update", labels, float(finished - min(d.last_update_round, finished)))
            for name in ("rounds_reported", "rounds_missed", "compute_seconds", "local_steps", "upload_seconds",
                         "download_seconds", "upload_bytes", "download_bytes"):  # fmt: skip
                add(f"edgefl_device_{name}_total", labels, d.totals[f"edgefl_device_{name}_total"])
            if d.codec is not None:
                add("edgefl_device_codec_info", (*labels, d.codec), 1.0)
            add("edgefl_device_cpu_temperature_celsius", labels, d.temperature_c)
            add("edgefl_device_cpu_frequency_hertz", labels, d.frequency_mhz * 1e6 if d.frequency_mhz else None)
            add("edgefl_device_peak_rss_bytes", labels, d.peak_rss_mb * 2**20 if d.peak_rss_mb else None)
            if d.throttled is not None:
                for flag in (*THROTTLE_BITS.values(), OTHER):
                    add("edgefl_device_throttled", (*labels, flag), 1.0 if flag in d.throttled else 0.0)

        rejected: Counter[tuple[str, str]] = Counter()
        for cid, state in clients.items():
            sender = cid if cid in self._devices else OTHER if "registered_at" in state else UNREGISTERED
            for reason, count in _map(state.get("rejected")).items():
                rejected[sender, self._reason(reason)] += _amount(count)
        for reason, count in _map(live.get("unattributed_rejections")).items():
            rejected[UNREGISTERED, self._reason(reason)] += _amount(count)
        for labels, count in rejected.items():
            add("edgefl_rejected_messages_total", labels, count)
        return fams

    def _reason(self, reason: Any) -> str:
        ok = isinstance(reason, str) and (reason in self.reasons or _DROPPED_RE.fullmatch(reason))
        return reason if ok else OTHER
