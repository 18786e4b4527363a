"""benchmarks.client_overhead in --quick mode: the output files exist and have the expected structure (no timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edge_client.algorithms import CLIENT_ALGORITHMS

REPO = Path(__file__).resolve().parent.parent


def test_quick_run_writes_table_for_every_algorithm(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.client_overhead", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "client_overhead.json").read_text())
    md = (tmp_path / "client_overhead.md").read_text()

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
        assert model["rows"]["fedumf"]["params"]["momentum"] > 0  # FedUmf's real local optimiser
    for row in data["fedveca_extra"].values():
        assert {"extra_s_median_paired", "full_pass_s_median", "ratio_extra_to_pass", "status"} <= set(row)
    assert "## Client step overhead" in md and "| taco |" in md and "FedVeca per-round extra" in md
    assert "Machine:" in md and "python -m benchmarks.client_overhead" in md
