"""What a run tells its user says what it means (issue 25, "Tables and plots that mislead"): byte and second columns
name whose link and which sum they are, the timeline's legend and the report's title read plainly, the console shows
one level per line, a device logs each registration once, and the live page has the run's facts at once and says
when the run ended."""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
from rich.console import Console
from rich.logging import RichHandler

from edge_client.loop.session import Session
from edge_client.wire.messages import Ack
from server.cli import _setup_logging
from server.dashboard.server import Address, DashboardServer
from server.dashboard.view import RunView
from server.progress import classes_table, clients_table
from server.recorder import run_title
from server.timeline import MAX_ROWS, deadline_label, drawn_devices, plot_timeline


def rendered(table: Any) -> str:
    console = Console(width=250, record=True)
    console.print(table)
    return console.export_text()


def test_the_tables_name_their_sums_and_a_small_models_traffic_is_not_zero() -> None:
    client = {"rounds": 3, "mean_compute_s": 0.5, "mean_cpu_s": 0.25, "bytes_up": 42_000, "bytes_down": 61_500,
              "peak_rss_mb": 300.0, "max_temperature_c": None, "throttled_flags": []}  # fmt: skip
    text = rendered(clients_table({"c0": client}))
    assert "compute s / round" in text and "cpu s / round" in text and "MB down (its link)" in text
    assert "0.042" in text and "0.0615" in text  # kilobytes a round, not 0.0
    per_class = {"pi4": {"clients": 2, "rounds_reported": 6, "rounds_missed": 0, "compute_s": 12.0,
                         "train_only_compute_s": 0.0, "local_steps": 600, "s_per_100_steps": 2.0}}  # fmt: skip
    assert "compute s (total)" in rendered(classes_table(per_class))


def test_the_timeline_legend_and_the_title_say_what_they_show() -> None:
    assert deadline_label(30, 30) == "round deadline"
    label = deadline_label(30, 2)
    assert "2 of 30 drawn" in label and "ended early" in label and "not shown" not in label
    assert run_title("fedavg", "none", 3) == "fedavg · devices' own data, no server data set · 3 clients"
    assert run_title("fedavg", "digits", 3) == "fedavg · digits · 3 clients"


def test_a_timeline_of_thousands_of_devices_draws_those_in_the_most_rounds(tmp_path: Path) -> None:
    rows = []  # a sampled population: 30 new devices a round, and two that are chosen every round
    for r in range(1, 21):
        chosen = [f"d{r:02d}-{i:02d}" for i in range(30)] + ["often-a", "often-b"]
        clients = {cid: {"compute_s": 1.0, "device_class": "pi4"} for cid in chosen}
        rows.append({"round": r, "clients": clients, "missing": [], "assign_cpu_s": 0.01, "deadline_s": 1e9,
                     "parallel_round_s": 1.0, "parallel_elapsed_s": float(r)})  # fmt: skip
    order, classes = drawn_devices(rows, None)
    assert len(classes) == 602 and len(order) == MAX_ROWS
    assert {"often-a", "often-b"} <= set(order) and order == sorted(order)
    plot_timeline(rows, tmp_path / "timeline.png", "fedavg", None)
    height_px = matplotlib.image.imread(tmp_path / "timeline.png").shape[0]
    assert height_px <= 110 * (1.9 + 0.3 * MAX_ROWS) + 1  # 60 rows, not 602


def test_the_console_shows_the_level_once(tmp_path: Path) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        _setup_logging(tmp_path, verbose=False)
        console = next(h for h in root.handlers if isinstance(h, RichHandler))
        record = logging.LogRecord(
            "edge_client.wire.transport", logging.WARNING, __file__, 1, "broker gone", None, None
        )
        assert console.format(record) == "edge_client.wire.transport: broker gone"  # RichHandler prints WARNING itself
    finally:
        for handler in root.handlers:
            if handler not in saved[0]:
                handler.close()
        root.handlers[:], root.level = saved


def test_a_device_logs_a_registration_once_and_says_why_it_registered_again(caplog: pytest.LogCaptureFixture) -> None:
    s = Session()
    s.connected(session_present=False, hello="h1")
    with caplog.at_level(logging.DEBUG, logger="edge_client.loop.session"):
        for hello in ("h2", "h3"):  # the hellos answering the server's retained and its direct announcement
            s.sending(hello, "hello")
        for hello in ("h1", "h2", "h3"):
            s.acked(Ack(of=hello, accepted=True, run_id="r1", round=0))
        s.connected(session_present=True, hello="h4")
        s.acked(Ack(of="h4", accepted=True, run_id="r1", round=2))
        s.sending("h5", "hello")
        s.acked(Ack(of="h5", accepted=True, run_id="r2", round=0))
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "registered" in r.getMessage()]
    assert infos == [
        "registered with the server (run r1, round 0)",
        "registered with the server again after reconnecting (run r1, round 2)",
        "registered with the server again for its new run r2 (was r1, round 0)",
    ]


def test_the_page_has_the_run_facts_at_once_and_is_told_when_the_run_ended(tmp_path: Path) -> None:
    facts = {"algorithm": "fedavg", "dataset": "digits", "partition": "iid", "job": "j", "rounds": 3, "target": 0.9}
    assert json.loads(RunView(tmp_path, facts).snapshot())["run"]["algorithm"] == "fedavg"  # before live.json
    server = DashboardServer(tmp_path, Address.parse("127.0.0.1:0"), facts).start()
    messages: list[dict[str, Any]] = []
    first = threading.Event()

    def read() -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/events", timeout=30) as stream:
            for line in stream:
                if line.startswith(b"data: "):
                    messages.append(json.loads(line[6:]))
                    first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert first.wait(30), "no event"
    finally:
        server.stop()
    reader.join(30)
    assert not reader.is_alive()
    assert messages[0]["state"]["run"]["rounds"] == 3 and messages[0]["ended"] is False
    assert messages[-1]["ended"] is True  # the last message before the dashboard server stopped with the run
