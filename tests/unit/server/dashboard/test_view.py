"""The dashboard's view of a run directory (server/dashboard/view.py): what the page is sent, from what the server
wrote, whatever clients reported. The page served and in a browser: tests/integration/test_dashboard.py."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from edgefl_testkit.runs import client_report, metrics_row, write_run
from server.dashboard.view import TIMELINE_FILE, RunView
from server.live_state import LiveState


def test_view_from_the_run_directory(tmp_path: Path) -> None:
    live = LiveState(tmp_path, {"algorithm": "fedveca", "dataset": "digits", "rounds": 3, "target": 0.8})
    live.start()
    live.registered("a", {"device_class": "pi4", "hostname": "<b>pi</b>"})
    live.registered("b", {"machine": "aarch64", "cpu_count": 4, "memory_mb": 3796})
    live.rejected("b", "norm")
    live.round_started(3, 3.0, {"a": {"local_steps": 12, "settings": {"alpha_i": 0.25}}})
    live.presence("b", False)
    live.close()
    flags = ["under_voltage"]
    write_run(
        tmp_path,
        [
            metrics_row(
                1,
                0.5,
                {"a": client_report(1.0, temperature_c_after=61.5, cpu_freq_mhz_after=1500.0), "b": client_report(3.0)},
            ),
            metrics_row(2, 0.85, {"a": client_report(2.0, throttled_flags=flags)}, missing=["b"]),
            metrics_row(3, 0.9, {"a": client_report(4.0)}, missing=["b"]),
        ],
    )
    state = json.loads(RunView(tmp_path).snapshot())
    assert state["run"]["algorithm"] == "fedveca" and state["run"]["finished"]
    assert state["points"] == [[1, 1.5, 0.5], [2, 3.0, 0.85], [3, 4.5, 0.9]]
    assert state["reached"] == {"round": 2, "elapsed_s": 3.0}  # first round at or above the target 0.8
    a, b = state["clients"]
    assert (a["id"], a["device_class"], a["host"]) == ("a", "pi4", "<b>pi</b>")  # the page sets it as text
    assert a["median_compute_s"] == 2.0 and a["last"]["compute_s"] == 4.0 and a["rounds_missed"] == 0
    assert a["told"] == {"round": 3.0, "local_steps": 12.0, "alpha": 0.25}
    assert b["device_class"] == "aarch64, 4 cores, 3.7 GiB" and b["online"] is False
    assert b["rounds_missed"] == 2 and b["rejected"] == {"norm": 1} and b["last"]["round"] == 1


def test_view_shows_the_timeline_once_the_run_writes_it(tmp_path: Path) -> None:
    view = RunView(tmp_path)
    assert json.loads(view.snapshot())["timeline"] is None
    Image.new("RGB", (4, 4)).save(tmp_path / TIMELINE_FILE)
    assert json.loads(view.snapshot())["timeline"] is not None  # its mtime: the page reloads the image by it


def test_view_reads_appended_rounds_and_notices_a_new_run(tmp_path: Path) -> None:
    view = RunView(tmp_path)
    write_run(tmp_path, [metrics_row(1, 0.5, {}), metrics_row(2, 0.6, {})])
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"round": 3, "accur')  # a row still being written
    assert json.loads(view.snapshot())["rounds_done"] == 2
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('acy": 0.7, "elapsed_s": 4.0, "clients": {}, "missing": []}\n')
    assert [p[0] for p in json.loads(view.snapshot())["points"]] == [1, 2, 3]
    write_run(
        tmp_path, [metrics_row(1, 0.1, {}), metrics_row(2, 0.2, {}), metrics_row(3, 0.3, {}), metrics_row(4, 0.4, {})]
    )  # a new run
    assert [p[2] for p in json.loads(view.snapshot())["points"]] == [0.1, 0.2, 0.3, 0.4]


def test_view_keeps_only_well_typed_values_from_clients(tmp_path: Path) -> None:
    report = {
        "compute_s": "fast",
        "cpu_s": True,
        "device": {"round": {"throttled_flags": "all", "temperature_c_after": []}},
    }
    write_run(tmp_path, [metrics_row(1, 0.5, {"x" * 500: report})])
    (client,) = json.loads(RunView(tmp_path).snapshot())["clients"]
    assert len(client["id"]) == 64 and client["median_compute_s"] is None
    assert client["last"]["compute_s"] is None and client["last"]["cpu_s"] is None
    assert client["last"]["throttled"] is None and client["last"]["temperature_c"] is None


def test_nan_in_metrics_reaches_the_page_as_strict_json(tmp_path: Path) -> None:
    """Issue 23: NaN in an update's metrics went out as a bare NaN, which JSON.parse refuses: the page stopped."""
    nan = float("nan")
    report = {**client_report(nan, temperature_c_after=nan, cpu_freq_mhz_after=float("inf")), "bytes_up": 10**400}
    write_run(tmp_path, [{**metrics_row(1, nan, {"c0": report}), "elapsed_s": float("inf")}])

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    state = json.loads(RunView(tmp_path).snapshot(), parse_constant=refuse)
    (client,) = state["clients"]
    assert state["points"] == [[1, 0.0, 0.0]] and client["median_compute_s"] is None
    assert client["last"]["temperature_c"] is None and client["last"]["cpu_freq_mhz"] is None
    assert client["last"]["bytes_up"] is None
