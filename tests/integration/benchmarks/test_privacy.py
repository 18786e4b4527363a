"""``python -m benchmarks.privacy --quick``: differential privacy's accuracy against epsilon."""

from __future__ import annotations

from pathlib import Path

import pytest

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
