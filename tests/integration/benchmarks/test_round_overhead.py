"""benchmarks.round_overhead in quick mode: the result files and their structure (the numbers are not judged)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefl_testkit.benchmarks import run_benchmark_quick
from edgefl_testkit.mqtt import require_mosquitto

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.integration


def test_quick_run_writes_json_and_markdown(tmp_path: Path) -> None:
    require_mosquitto()
    out = tmp_path / "results"
    data, md = run_benchmark_quick("round_overhead", out, timeout=240)

    assert data["quick"] is True
    assert data["config"]["clients"] == 3 and data["config"]["rounds"] == 2
    assert {"cpu", "cores", "torch", "numpy"} <= set(data["machine"])
    rounds = data["per_round"]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        for key in ("round_s", "slowest_compute_s", "overhead_s", "fraction", "aggregate_s", "eval_s", "assign_s"):
            assert isinstance(r[key], float), key
        assert r["overhead_s"] == pytest.approx(r["round_s"] - r["slowest_compute_s"])
        assert r["clients"] == 3 and len(r["per_client"]) == 3
    s = data["summary"]
    assert s["rounds_used"] == [2]  # round 1 is warm-up
    assert isinstance(s["fraction_median"], float) and isinstance(s["fraction_max"], float)
    assert set(data["pass"]) == {"fraction_median", "fraction_max"}

    assert md.startswith("## 5. Round overhead")
    assert "python -m benchmarks.round_overhead --quick" in md
    assert "Machine:" in md
    assert "| overhead fraction of a round, median over rounds 2-2 |" in md
    assert md.count("| < 5% |") == 2
    assert ("PASS" in md) or ("MISS" in md)
    assert "warm-up" in md
    if not all(data["pass"].values()):
        assert "**Cause (measured).**" in md and "**Next step.**" in md
