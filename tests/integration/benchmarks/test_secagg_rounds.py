"""``python -m benchmarks.secagg_rounds --quick``: secure aggregation against plain in whole rounds, in-process and with
real ``edge-client`` processes over mosquitto."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefl_testkit.benchmarks import run_benchmark_quick

pytestmark = pytest.mark.integration


def test_benchmark_quick(tmp_path: Path) -> None:
    """Every secure run aggregated every round securely and learned what the plain run learned (digits' deltas are
    far below the clip norm, so only 32-bit quantisation separates them); the plain runs had no secure round; the
    devices' stage messages are counted in the secure runs' bytes; the table has both modes."""
    data, md = run_benchmark_quick("secagg_rounds", tmp_path)
    runs = [(p["plain"], p["secure"]) for p in [*data["inprocess"], data["broker"]]]
    assert len(runs) == 3
    for plain, secure in runs:
        assert plain["secure_rounds"] == 0 and secure["secure_rounds"] == secure["rounds"] == plain["rounds"] == 2
        assert secure["final_accuracy"] == pytest.approx(plain["final_accuracy"], abs=0.02)
        assert secure["bytes_down_per_device"] > plain["bytes_down_per_device"]  # the roster, relay and unmask
    assert all(p["secure"]["stage_s"]["masked"] > 0 and p["secure"]["device_secagg_s"] > 0 for p in data["inprocess"])
    assert "| plain |" in md and "| secure |" in md and "| 4 | 2 |" in md
