"""Running a benchmark of benchmarks/ as its users do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_benchmark_quick(name: str, out: Path, timeout: float = 600) -> tuple[dict[str, Any], str]:
    """Run ``python -m benchmarks.<name> --quick --out OUT`` from the repository root; its JSON and Markdown."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / f"{name}.json").read_text()), (out / f"{name}.md").read_text()
