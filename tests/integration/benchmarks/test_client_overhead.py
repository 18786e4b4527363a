"""benchmarks.client_overhead in --quick mode: the output files exist and have the expected structure (no timing)."""

from __future__ import annotations

from pathlib import Path

from edge_client.algorithms import CLIENT_ALGORITHMS
from edgefl_testkit.benchmarks import run_benchmark_quick

REPO = Path(__file__).resolve().parents[3]


def test_quick_run_writes_table_for_every_algorithm(tmp_path: Path) -> None:
    data, md = run_benchmark_quick("client_overhead", tmp_path, timeout=600)

    assert data["quick"] is True
    assert {"cpu", "cores", "torch", "numpy"} <= set(data["machine"])
    assert set(data["table"]) == {"cnn-mnist", "mlp-adult"}
    for model in data["table"].values():
        assert set(model["rows"]) == set(CLIENT_ALGORITHMS)
        for _alg, row in model["rows"].items():
            assert row["s_per_100_median"] > 0 and row["ratio_median_paired"] > 0
            assert row["status"] in ({"PASS", "MISS"} if row["target_ratio"] is not None else {None})
            if row["status"] == "MISS":
                assert row["profile"]
        assert model["rows"]["fedavg"]["ratio_median_paired"] == 1.0
        assert model["rows"]["fedumf"]["optimiser"]["momentum"] > 0  # FedUmf's real local optimiser
    for row in data["fedveca_extra"].values():
        assert {"extra_s_median_paired", "full_pass_s_median", "ratio_extra_to_pass", "status"} <= set(row)
    assert "## Client step overhead" in md and "| taco |" in md and "FedVeca per-round extra" in md
    assert "Machine:" in md and "python -m benchmarks.client_overhead" in md
