"""benchmarks.memory in --quick mode: the output files exist and have the expected structure (no judging)."""

from __future__ import annotations

from pathlib import Path

from edgefl_testkit.benchmarks import run_benchmark_quick

REPO = Path(__file__).resolve().parents[3]


def test_quick_run_writes_peak_rss_table(tmp_path: Path) -> None:
    data, md = run_benchmark_quick("memory", tmp_path, timeout=900)

    assert data["quick"] is True
    assert {"cpu", "cores", "torch", "numpy"} <= set(data["machine"])
    mem = data["memory"]
    assert mem["d"] > 0
    assert {"bare", "fedavg", "fedavg@tau2", "fedveca@tau2", "fedavg@tau50", "fedveca@tau50"} <= set(mem["rows"])
    for row in mem["rows"].values():
        assert row["peak_mb"] > 0 and row["ratio_to_bare"] > 0 and row["runs"]
    assert mem["rows"]["fedavg"]["status"] in {"PASS", "MISS"}
    assert set(mem["fedveca"]) == {"2", "50"}
    for row in mem["fedveca"].values():
        assert {"diff_mb", "diff_in_d_vectors", "status"} <= set(row)
    assert isinstance(mem["fedveca_tau_independent"], bool)
    assert "## Client memory" in md and "| bare |" in md and "Machine:" in md
