"""benchmarks/aggregation.py in --quick mode: the result files exist and have the expected structure."""

from __future__ import annotations

from pathlib import Path

from conftest import run_benchmark_quick

from server.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
TARGETED = {"fedavg", "fednova", "taco", "drag"}


def test_aggregation_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    data, md = run_benchmark_quick("aggregation", out, timeout=120)

    assert data["benchmark"] == "aggregation" and data["quick"] is True
    assert {"cpu", "cores", "numpy", "torch"} <= set(data["machine"])
    assert len(data["runs"]) == 1
    block = data["runs"][0]
    assert (block["n"], block["d"]) == (10, 10_000)
    assert block["floor_s"] > 0
    assert set(block["algorithms"]) == set(STRATEGIES)  # every registered algorithm is measured
    for name, row in block["algorithms"].items():
        assert row["seconds"] > 0 and row["ratio"] > 0
        if name in TARGETED:
            assert row["target"] == 2.0 and row["verdict"] in {"PASS", "MISS"}
        else:
            assert "verdict" not in row
    assert "server_training_s" in block["algorithms"]["drag-br"]
    assert set(block["memory"]) == {"fedavg", "fednova"}
    for m in block["memory"].values():
        assert m["peak_extra_bytes"] > 0 and m["update_bytes"] == 4 * 10_000
        assert m["verdict"] in {"PASS", "MISS"}

    assert md.startswith("## Server aggregation")
    assert "python -m benchmarks.aggregation --quick" in md
    assert "Machine:" in md
    for name in STRATEGIES:
        assert f"| {name} |" in md
