"""benchmarks/aggregation.py in --quick mode: the result files exist and have the expected structure."""

from __future__ import annotations

from pathlib import Path

from edgefl_testkit.benchmarks import run_benchmark_quick
from server.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[3]
TARGETED = {"fedavg", "fednova", "taco", "drag"}
STORED = {"taco", "foolsgold", "fedprox-taco", "scaffold-taco"}


def test_aggregation_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    data, md = run_benchmark_quick("aggregation", out, timeout=120)

    assert data["benchmark"] == "aggregation" and data["quick"] is True
    assert {"cpu", "cores", "numpy", "torch"} <= set(data["machine"])
    assert len(data["runs"]) == 1
    block = data["runs"][0]
    assert (block["n"], block["d"]) == (10, 10_000)
    assert block["floor_s"] > 0
    spilled = "taco (every row spilled)"
    assert set(block["algorithms"]) == {*STRATEGIES, spilled}  # every registered algorithm is measured
    for name, row in block["algorithms"].items():
        assert row["seconds"] > 0 and row["ratio"] > 0 and 0 < row["finish_s"] <= row["seconds"]
        if name in TARGETED:
            assert row["target"] == 2.0 and row["verdict"] in {"PASS", "MISS"}
        else:
            assert "verdict" not in row
        assert row["spilled_rows"] == (10 if name == spilled else 0)
    assert "server_training_s" in block["algorithms"]["drag-br"]

    memory = data["memory"]
    assert memory["ns"] == [3, 10] and memory["d"] == 10_000
    assert set(memory["algorithms"]) == (set(STRATEGIES) - STORED) | {"taco"}
    for name, row in memory["algorithms"].items():
        assert all(p["peak_bytes"] > 0 for p in row["by_n"].values())
        if name == "taco":  # its store holds the round's rows: more updates, more memory (within its bound)
            assert row["by_n"]["10"]["peak_bytes"] > row["by_n"]["3"]["peak_bytes"] + 6 * 4 * 10_000
        else:
            assert row["verdict"] in {"PASS", "MISS"}
    assert memory["algorithms"]["fedavg"]["verdict"] == "PASS"  # a running sum: flat by construction

    assert md.startswith("## Server aggregation")
    assert "python -m benchmarks.aggregation --quick" in md
    assert "Machine:" in md and "Server memory while a round is folded" in md
    for name in STRATEGIES:
        assert f"| {name} |" in md
    assert list(out.iterdir()) != [] and not any(p.name.startswith("edgefl-round-rows") for p in out.iterdir())
