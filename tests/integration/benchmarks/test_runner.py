"""`python -m benchmarks`: runs the selected benchmarks in quick mode and assembles the Markdown document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import measured_at
from benchmarks.common import write_results
from edgefl_testkit.mqtt import require_mosquitto

ROOT = Path(__file__).resolve().parents[3]


def test_unknown_benchmark_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "nope", "--out", str(tmp_path), "--doc", str(tmp_path / "b.md")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown benchmark" in proc.stderr
    assert not (tmp_path / "b.md").exists()


@pytest.mark.integration
def test_quick_round_overhead_is_assembled(tmp_path: Path) -> None:
    require_mosquitto()
    out, doc = tmp_path / "results", tmp_path / "docs" / "benchmarks.md"
    cmd = ["--quick", "--only", "round_overhead", "--out", str(out), "--doc", str(doc)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "round_overhead.json").exists() and (out / "round_overhead.log").exists()
    text = doc.read_text()
    lines = text.splitlines()
    assert lines[0] == "# edgefl benchmarks"
    assert any(line.startswith("- Machine: ") and "cores" in line for line in lines)
    assert any(line.startswith("- Date: ") for line in lines)
    assert "`python -m benchmarks --quick --only round_overhead" in text
    assert "## Summary of targets" in text
    summary = [line for line in lines if line.startswith("| round overhead |")]
    assert len(summary) == 2 and all(line.rstrip().endswith(("| PASS |", "| MISS |")) for line in summary)
    assert "PASS, " in text and " MISS." in text
    assert "## 5. Round overhead" in text  # the fragment itself follows the summary
    assert text.index("## Summary of targets") < text.index("## 5. Round overhead")
    assert "FAILED" not in text


def test_a_kept_fragment_is_dated_when_it_was_measured_not_when_it_was_cloned(tmp_path: Path) -> None:
    fragment = tmp_path / "wire.md"
    fragment.write_text("## wire\n")
    write_results("wire", {"x": 1}, "## wire\n", tmp_path)
    recorded = json.loads((tmp_path / "wire.json").read_text())["measured_at"]
    os.utime(fragment, (0, 0))  # what a clone does to file times, in the other direction
    assert measured_at(fragment) == recorded
    (tmp_path / "wire.json").write_text("{}")  # an older fragment without the stamp: its last commit, else file time
    assert measured_at(fragment) == "1970-01-01 00:00:00 UTC"
    assert measured_at(ROOT / "benchmarks" / "results" / "wire.md").startswith("20")  # the commit that wrote it
