"""Helpers shared by the benchmark scripts: machine description, result files, timing."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gb() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """CPU model, cores, memory and the versions that matter for the numbers."""
    import numpy

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "mem_gb": _mem_total_gb(),
        "arch": platform.machine(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": numpy.__version__,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        info["torch"] = None
    return info


def machine_line(info: dict[str, Any] | None = None) -> str:
    """One Markdown line describing the machine."""
    m = info or machine()
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, {m.get('mem_gb')} GB RAM, {m['arch']}; "
        f"Python {m['python']}, numpy {m['numpy']}, torch {m.get('torch')}"
    )


def write_results(name: str, data: dict[str, Any], md: str, out: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``<out>/<name>.json`` (with ``measured_at``, when it was written: a clone resets file times) and
    ``<out>/<name>.md``; return both paths."""
    data = {**data, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    out_dir = Path(out) if out is not None else DEFAULT_OUT
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    md_path.write_text(md if md.endswith("\n") else md + "\n", encoding="utf-8")
    return json_path, md_path


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time (time.perf_counter) of ``repeats`` calls of ``fn``, in seconds."""
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
