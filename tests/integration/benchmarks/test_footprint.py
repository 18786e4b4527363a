"""benchmarks.footprint in --quick mode: every command really ran, predict and fetch-model never imported torch.

The peaks themselves are judged in docs/benchmarks.md, not here (no thresholds on measured figures in tests).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefl_testkit.benchmarks import run_benchmark_quick
from edgefl_testkit.mqtt import require_mosquitto


@pytest.mark.integration
def test_quick_run_measures_each_command_in_its_own_process(tmp_path: Path) -> None:
    require_mosquitto()
    data, md = run_benchmark_quick("footprint", tmp_path, timeout=900)

    rows = data["footprint"]["rows"]
    assert set(rows) == {
        "interpreter",
        "baseline",
        "baseline + one training step",
        "run",
        "predict",
        "fetch-model",
    }
    assert all(row["exit"] == 0 and row["peak_rss_mb"] > 0 for row in rows.values())
    assert rows["run"]["updates"] == 2 and rows["run"]["torch_imported"]  # two real rounds of edge-server run
    assert not rows["predict"]["torch_imported"] and not rows["fetch-model"]["torch_imported"]
    # each process reports its own peak: the inference commands stay far below a process that loaded torch
    assert rows["predict"]["peak_rss_mb"] < rows["baseline"]["peak_rss_mb"]
    assert "## Device footprint" in md and "| `edge-client predict` |" in md and "Machine:" in md
