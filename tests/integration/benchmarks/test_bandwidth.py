"""benchmarks/bandwidth.py in --quick mode: every run and speed row is recorded and rendered (numbers not judged,
except what the codecs guarantee whatever the machine: fewer bytes than fp32)."""

from __future__ import annotations

from pathlib import Path

from edgefl_testkit.benchmarks import run_benchmark_quick


def test_bandwidth_quick(tmp_path: Path) -> None:
    data, md = run_benchmark_quick("bandwidth", tmp_path / "results", timeout=600)

    assert data["quick"] is True and data["plan"]["codecs"] == ["fp32", "topk:0.01+int8"]
    runs = {r["codec"]: r for r in data["runs"]}
    assert set(runs) == {"fp32", "topk:0.01+int8"} and all(r["rejected"] == {} for r in runs.values())
    assert runs["fp32"]["codec_mix"] == {"fp32": 6} and runs["topk:0.01+int8"]["codec_mix"] == {"topk:0.01+int8": 6}
    assert runs["topk:0.01+int8"]["bytes_ratio"] < 0.1  # 1% of the entries, a byte each, plus indices and header
    assert [s["codec"] for s in data["speed"]] == ["fp32", "int8", "topk:0.01+int8", "fp16", "topk:0.01"]
    assert all(s["decode_gbs"] > 0 and s["encode_gbs"] > 0 for s in data["speed"])
    assert "| fedavg iid topk:0.01+int8 |" in md and "wall clock (`time.perf_counter`)" in md
