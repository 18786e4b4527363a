"""Run reports: time-to-accuracy figures from metrics rows, the PNG report, and the metrics.jsonl log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from server.progress import clients_table, summary_table
from server.report import MetricsLog, client_summary, plot_report, summarize, write_summary
from server.target import Target

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(round_: int, accuracy: float, elapsed_s: float, slowest_compute_s: float, loss: float = 1.0) -> dict[str, Any]:
    return {
        "round": round_,
        "accuracy": accuracy,
        "loss": loss,
        "elapsed_s": elapsed_s,
        "slowest_compute_s": slowest_compute_s,
    }


# Accuracy crosses 0.9 first in round 3, dips below it in round 4 and crosses again in round 5.
ROWS = [
    row(1, 0.50, 2.5, 1.25, loss=2.0),
    row(2, 0.80, 5.0, 0.75, loss=1.5),
    row(3, 0.91, 8.0, 2.0, loss=0.9),
    row(4, 0.88, 11.5, 0.5, loss=1.0),
    row(5, 0.95, 14.0, 3.0, loss=0.4),
]


def test_summarize_counts_to_the_first_round_reaching_the_target() -> None:
    target = 0.9
    summary = summarize(ROWS, Target.accuracy(target))
    first = next(r for r in ROWS if r["accuracy"] >= target)
    assert first["round"] == 3  # the fixture is what the test says it is
    compute = 0.0
    for r in ROWS:
        compute += r["slowest_compute_s"]
        if r is first:
            break
    assert summary["rounds_to_target"] == 3
    assert summary["time_to_target_s"] == 8.0
    assert summary["client_compute_to_target_s"] == pytest.approx(compute)
    assert summary["client_compute_to_target_s"] == pytest.approx(1.25 + 0.75 + 2.0)
    assert summary["client_compute_total_s"] == pytest.approx(sum(r["slowest_compute_s"] for r in ROWS))


def test_summarize_final_and_best_figures() -> None:
    summary = summarize(ROWS, Target.accuracy(0.9), dataset="digits", seed=4)
    assert summary["final_accuracy"] == 0.95
    assert summary["final_loss"] == 0.4
    assert summary["best_accuracy"] == 0.95
    assert summary["rounds"] == 5
    assert summary["wall_clock_s"] == 14.0
    assert summary["target_accuracy"] == 0.9
    assert summary["dataset"] == "digits" and summary["seed"] == 4  # extras are carried through


def test_summarize_target_reached_in_the_first_round() -> None:
    summary = summarize(ROWS, Target.accuracy(0.5))
    assert summary["rounds_to_target"] == 1
    assert summary["time_to_target_s"] == 2.5
    assert summary["client_compute_to_target_s"] == pytest.approx(1.25)


def test_summarize_target_exactly_equal_counts_as_reached() -> None:
    summary = summarize(ROWS, Target.accuracy(0.8))
    assert summary["rounds_to_target"] == 2
    assert summary["client_compute_to_target_s"] == pytest.approx(1.25 + 0.75)


def test_summarize_target_never_reached_gives_none() -> None:
    summary = summarize(ROWS, Target.accuracy(0.99))
    assert summary["rounds_to_target"] is None
    assert summary["time_to_target_s"] is None
    assert summary["client_compute_to_target_s"] is None
    assert summary["best_accuracy"] == 0.95
    assert summary["rounds"] == 5


def test_summarize_no_rows() -> None:
    summary = summarize([], Target.accuracy(0.9))
    assert summary["rounds"] == 0
    assert summary["rounds_to_target"] is None and summary["time_to_target_s"] is None
    assert summary["client_compute_to_target_s"] is None
    assert summary["final_accuracy"] is None and summary["best_accuracy"] is None


def test_write_summary_is_json(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    summary = summarize(ROWS, Target.accuracy(0.9))
    write_summary(path, summary)
    assert json.loads(path.read_text()) == summary


@pytest.mark.parametrize("target", [0.9, 0.99])
def test_plot_report_writes_a_png(tmp_path: Path, target: float) -> None:
    path = tmp_path / "report.png"
    plot_report(ROWS, Target.accuracy(target), path, "digits, fedavg")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 100 and height > 100
    assert data.endswith(b"IEND\xaeB`\x82")  # complete file, not truncated


def test_metrics_log_appends_one_json_line_per_row(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for i, r in enumerate(ROWS[:3], start=1):
        log.append({**r, "clients": {"c0": {"local_steps": 5}}, "missing": []})
        lines = path.read_text().splitlines()
        assert len(lines) == i  # written immediately, so a crash keeps every finished round
    parsed = [json.loads(line) for line in path.read_text().splitlines()]
    assert [p["round"] for p in parsed] == [1, 2, 3]
    assert parsed[1]["accuracy"] == 0.80 and parsed[1]["clients"] == {"c0": {"local_steps": 5}}
    assert parsed == log.rows


def test_metrics_log_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    MetricsLog(path).append(ROWS[0])
    MetricsLog(path).append(ROWS[1])
    assert [json.loads(line)["round"] for line in path.read_text().splitlines()] == [1, 2]


def test_client_summary_aggregates_what_each_device_reported() -> None:
    def client(compute: float, temp_before: float | None, temp_after: float | None, rss: float, flags: list[str]):
        device = {"round": {"temperature_c_before": temp_before, "temperature_c_after": temp_after,
                            "cpu_freq_mhz_before": 1500.0, "cpu_freq_mhz_after": 600.0 if flags else 1500.0,
                            "peak_rss_mb": rss, "throttled_flags": flags}}  # fmt: skip
        return {"compute_s": compute, "cpu_s": compute / 2, "bytes_up": 10, "bytes_down": 20, "device": device}

    rows = [
        {"clients": {"pi-1": client(1.0, 50.0, 55.0, 300.0, []), "pi-2": client(3.0, None, None, 200.0, [])}},
        {"clients": {"pi-1": client(2.0, 56.0, 61.5, 320.0, ["throttled"])}},
    ]
    summary = client_summary(rows)
    assert summary["pi-1"] == {
        "rounds": 2, "bytes_up": 20, "bytes_down": 40, "peak_rss_mb": 320.0, "max_temperature_c": 61.5,
        "min_cpu_freq_mhz": 600.0, "throttled_flags": ["throttled"], "mean_compute_s": 1.5, "mean_cpu_s": 0.75,
        "evaluations": 0, "mean_eval_s": None,
    }  # fmt: skip
    assert summary["pi-2"]["max_temperature_c"] is None and summary["pi-2"]["rounds"] == 1


def test_devices_evaluations_are_counted_and_shown_apart_from_training() -> None:
    def evaluated(eval_s: dict[str, float]) -> dict[str, Any]:
        return {"devices": {cid: {"num_samples": 10, "loss": 0.5, "eval_s": s} for cid, s in eval_s.items()}}

    train = {"compute_s": 1.0, "cpu_s": 0.5, "bytes_up": 10, "bytes_down": 20, "device": {}}
    rows = [
        {"clients": {"pi-1": train, "pi-2": train}, "client_eval": evaluated({"pi-1": 0.25, "pi-2": 0.5})},
        {"clients": {"pi-1": train}, "client_eval": evaluated({"pi-1": 0.75})},
    ]
    per_client = client_summary(rows)
    assert (per_client["pi-1"]["evaluations"], per_client["pi-1"]["mean_eval_s"]) == (2, 0.5)
    assert (per_client["pi-2"]["evaluations"], per_client["pi-2"]["mean_eval_s"]) == (1, 0.5)
    assert per_client["pi-1"]["mean_compute_s"] == 1.0  # evaluation time is not training compute

    console = Console(width=200, record=True)
    console.print(clients_table(per_client))
    text = console.export_text()
    assert "evals" in text and "eval s" in text and "0.500" in text
    console = Console(width=200, record=True)
    console.print(clients_table(client_summary([{"clients": {"pi-1": train}}])))
    assert "eval" not in console.export_text()  # no device evaluated: no such columns


def test_summary_table_says_when_no_target_was_set() -> None:
    def rendered(target: float | None) -> str:
        console = Console(width=200, record=True)
        console.print(summary_table({"target_metric": "rmse", "target": target, "final_rmse": 0.25}))
        return console.export_text()

    assert "target rmse" in rendered(None) and "none set" in rendered(None)
    assert "0.5000" in rendered(0.5) and "none set" not in rendered(0.5)


def test_device_bytes_to_target_counts_every_devices_link_beside_the_servers() -> None:
    """Two devices each receive the 3000-byte broadcast the server sends once: their links carry it twice."""

    def row(round_: int, accuracy: float) -> dict[str, Any]:
        clients = {cid: {"bytes_up": 100, "bytes_down": 3000 + 50} for cid in ("a", "b")}  # broadcast + assignment
        return {"round": round_, "accuracy": accuracy, "loss": 1.0, "elapsed_s": round_, "slowest_compute_s": 0.1,
                "clients": clients, "bytes_out": 3000 + 2 * 50}  # fmt: skip

    s = summarize([row(1, 0.5), row(2, 0.95), row(3, 0.99)], Target.accuracy(0.9))
    assert s["bytes_to_target"] == 2 * (200 + 3100)  # the server's link: updates in, its egress out
    assert s["device_bytes_to_target"] == 2 * 2 * (100 + 3050)  # rounds 1 and 2, both devices, up and down
    assert summarize([row(1, 0.5)], Target.accuracy(0.9))["device_bytes_to_target"] is None


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_a_device_s_nan_or_inf_leaves_metrics_and_summary_strict_json(tmp_path: Path) -> None:
    """A diverged device's NaN loss and an absurd compute time (1e308 s per 100 steps overflow to inf) must not make
    the run's records unreadable: the offending values are left out, the rest of the record is kept."""
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"round": 1, "accuracy": 0.5, "clients": {"c0": {"train_loss": float("nan"), "compute_s": 1.0}}})
    (row,) = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["accuracy"] == 0.5 and row["clients"]["c0"] == {"compute_s": 1.0}
    write_summary(tmp_path / "summary.json", {"final_accuracy": 0.5, "per_class": {"x": {"s_per_100": float("inf")}}})
    assert _strict((tmp_path / "summary.json").read_text()) == {"final_accuracy": 0.5, "per_class": {"x": {}}}


def test_client_summary_tolerates_telemetry_of_the_wrong_shape() -> None:
    """``metrics.round`` is a map from honest devices; a device sending a number there must not end the summary."""
    rows = [{"round": 1, "clients": {"c0": {"compute_s": 1.0, "cpu_s": 1.0, "bytes_up": 1, "bytes_down": 1,
                                             "device": {"round": 5}}}}]  # fmt: skip
    assert client_summary(rows)["c0"]["rounds"] == 1
