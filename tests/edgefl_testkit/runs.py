"""A run directory as the server writes it, by hand: metrics rows and the clients' reports in them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def metrics_row(
    round_: int, accuracy: float, clients: dict[str, Any], missing: list[str] | None = None
) -> dict[str, Any]:
    """A round of ``metrics.jsonl``: 1.5 s a round, nothing rejected."""
    return {"round": round_, "elapsed_s": 1.5 * round_, "accuracy": accuracy, "clients": clients,
            "missing": missing or [], "rejected": {}}  # fmt: skip


def client_report(compute_s: float, **device_round: Any) -> dict[str, Any]:
    """A client's entry in a row: ``device_round`` is what its device measured around the round."""
    return {"compute_s": compute_s, "cpu_s": compute_s / 2, "bytes_up": 1000, "device": {"round": device_round}}


def write_run(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """``run_dir/metrics.jsonl`` holding ``rows`` (replaced: a new run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
