"""`edge-server bench --suite smoke` end to end, as a command: every table and plot written, then resumed. The
suites, the grid and the tables themselves: tests/unit/server/experiments/test_bench.py."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgefl_testkit.basics import full_size
from server.experiments.suites import load_suite

pytestmark = pytest.mark.integration


def test_smoke_suite_end_to_end_and_resumed(tmp_path: Path) -> None:
    """What CI runs: every table and plot is written; a second invocation keeps the finished runs. The suite's two
    seeds with EDGEFL_FULL set; its first seed in the test suite (both partitions and algorithms: every column, row,
    table and plot)."""
    out = tmp_path / "bench"
    suite = load_suite("smoke")
    seeds = suite.seeds if full_size() else suite.seeds[:1]
    cmd = [sys.executable, "-m", "server.cli", "bench", "--suite", "smoke", "--out", str(out)]
    cmd += ["--seeds", ",".join(map(str, seeds))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads((out / "records.json").read_text())
    assert len(records) == len(suite.runs()) // len(suite.seeds) * len(seeds)
    assert {r["seed"] for r in records} == set(seeds)
    assert {r["algorithm"] for r in records} == set(suite.algorithms)
    for name in ("accuracy", "time_to_accuracy", "compute", "freeloaders"):
        rows = list(csv.reader((out / f"{name}.csv").open()))
        assert [r[0] for r in rows[1:]] == suite.algorithms, name
        assert (out / f"{name}.md").read_text().startswith("| Method |")
    assert len(rows[0]) == 1 + 2 * len(suite.partitions)  # TPR and FPR per column
    for partition in suite.partitions:
        png = out / f"accuracy-{partition}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every algorithm of a column saw the identical partition.
    for partition in suite.partitions:
        hists = {
            (r["algorithm"], r["seed"]): [c["num_samples"] for c in _first_round(out, r)]
            for r in records
            if r["partition"] == partition
        }
        for seed in seeds:
            assert hists[("fedavg", seed)] == hists[("taco", seed)]
        for seed in seeds:  # and each run keeps the label histograms of its clients
            run = out / "runs" / "default" / partition / "taco" / f"seed-{seed}"
            assert "client-09" in (run / "label_histograms.txt").read_text()
    report = (out / "report.md").read_text()
    assert "TACO Table V" in report and "accuracy-iid.png" in report
    rows = list(csv.reader((out / "alpha.csv").open()))  # Table II: TACO's alphas by group, freeloaders apart
    assert [r[0] for r in rows[1:]] == ["taco"] and "taco-groups alpha Freeloaders" in rows[0]
    for record in records:  # alpha per client over rounds, for the runs that compute alphas
        png = out / "runs" / record["path"] / "alpha.png"
        assert png.exists() == (record["algorithm"] == "taco")
        assert all(("alpha" in p) == (record["algorithm"] == "taco") for p in record["curve"])

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("done before, kept") == len(records)


def _first_round(out: Path, record: dict) -> list[dict]:
    path = out / "runs" / "default" / record["partition"] / record["algorithm"] / f"seed-{record['seed']}"
    first = json.loads((path / "metrics.jsonl").read_text().splitlines()[0])
    return [first["clients"][c] for c in sorted(first["clients"])]
