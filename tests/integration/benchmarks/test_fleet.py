"""benchmarks.fleet in quick mode: the result files, both algorithms on the parallel clock (the numbers are not
judged). The verdict's arithmetic: tests/unit/benchmarks/test_fleet.py."""

from __future__ import annotations

from pathlib import Path

from benchmarks.__main__ import targets
from edgefl_testkit.benchmarks import run_benchmark_quick


def test_quick_run_writes_the_parallel_clock_table(tmp_path: Path) -> None:
    data, md = run_benchmark_quick("fleet", tmp_path / "results", timeout=300)
    assert data["quick"] is True and data["config"]["fleet"] == "pi5:1,pi4:1,pi3:1"
    per_algorithm = data["modes"]["inprocess"]
    assert set(per_algorithm) == {"fedavg", "fednova"}
    assert per_algorithm["fednova"]["steps_policy"] == "deadline" and per_algorithm["fedavg"]["steps_policy"] == "fixed"
    for f in per_algorithm.values():
        assert 0.0 < f["final_accuracy"] <= 1.0
        assert set(f["rounds_missed"]) == {"pi3", "pi4", "pi5"}
    assert md.startswith("## Heterogeneous fleet (fleet-mnist)")
    assert "| fednova | deadline |" in md and "parallel clock (s, in-process)" in md
    [(figure, _, result)] = targets(md)  # the summary of docs/benchmarks.md picks the verdict up
    assert figure.startswith("time to 97% on the parallel clock") and result in ("PASS", "MISS")
