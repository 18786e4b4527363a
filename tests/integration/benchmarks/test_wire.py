"""benchmarks/wire.py in --quick mode: the result files exist and have the expected structure (numbers not judged)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefl_testkit.benchmarks import run_benchmark_quick
from edgefl_testkit.mqtt import require_mosquitto

ROOT = Path(__file__).resolve().parents[3]
VERDICTS = {"PASS", "MISS"}


@pytest.mark.integration
def test_wire_quick(tmp_path: Path) -> None:
    require_mosquitto()
    out = tmp_path / "results"
    data, md = run_benchmark_quick("wire", out, timeout=120)

    assert data["benchmark"] == "wire" and data["quick"] is True
    assert {"cpu", "cores", "numpy", "torch"} <= set(data["machine"])
    assert [r["params"] for r in data["codec"]] == [100_000]
    for r in data["codec"]:
        for key in ("encode_gbs", "decode_gbs", "ratio_unchunked", "ratio_chunked", "ratio_mqtt_chunked"):
            assert isinstance(r[key], float) and r[key] > 0
        assert isinstance(r["decode_zero_copy"], bool) and r["roundtrip_equal"] is True
        assert r["chunks"] >= 1
        for key in ("verdict_encode", "verdict_zero_copy", "verdict_ratio_unchunked", "verdict_ratio_chunked"):
            assert r[key] in VERDICTS
    assert [r["params"] for r in data["mqtt"]] == [100_000]
    for r in data["mqtt"]:
        for mode in ("chunked", "unchunked"):
            assert r[mode]["total_s"] > 0 and r[mode]["frames"] >= 1
        assert r["speedup_chunked"] > 0

    assert md.startswith("## Wire")
    assert "python -m benchmarks.wire --quick" in md
    assert "Machine:" in md
    assert "| 0.1M |" in md and ("PASS" in md or "MISS" in md)
