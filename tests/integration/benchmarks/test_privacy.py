"""``python -m benchmarks.privacy --quick`` and ``python -m benchmarks.privacy_population --quick``: differential
privacy's accuracy against epsilon."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.__main__ import targets
from edgefl_testkit.benchmarks import run_benchmark_quick

pytestmark = pytest.mark.integration


def test_benchmark_quick(tmp_path: Path) -> None:
    """``python -m benchmarks.privacy --quick``: both variants ran, the budget was spent, the table and plot written."""
    data, md = run_benchmark_quick("privacy", tmp_path)
    by = {r["clipping"]: r for r in data["records"]}
    assert set(by) == {"none", "fixed"} and by["fixed"]["epsilon"] == pytest.approx(8.0, abs=0.01)
    assert by["none"]["epsilon"] is None and all(r["rounds"] == 2 for r in by.values())
    assert "| iid | fixed | 8 |" in md and ("PASS" in md or "MISS" in md)
    assert (tmp_path / "privacy.png").stat().st_size > 0


def test_population_benchmark_quick(tmp_path: Path) -> None:
    """``python -m benchmarks.privacy_population --quick``: a sampled population of 100 devices, the budget spent, its
    own results files, and the verdict as a table row the runner's summary reads."""
    data, md = run_benchmark_quick("privacy_population", tmp_path)
    assert data["config"]["devices"] == 100 and data["command"].startswith("python -m benchmarks.privacy_population")
    by = {r["clipping"]: r for r in data["records"]}
    assert by["fixed"]["epsilon"] == pytest.approx(8.0, abs=0.01) and all(r["rounds"] == 2 for r in by.values())
    assert md.startswith("## Differential privacy, 100 devices")
    assert [verdict for _, _, verdict in targets(md)] in (["PASS"], ["MISS"])
    assert (tmp_path / "privacy_population.png").stat().st_size > 0
