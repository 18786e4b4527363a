"""The load benchmark's aggregate check (benchmarks/load.py) catches a lost or doubled update, else "exact" would
prove nothing. The benchmark run: tests/integration/benchmarks/test_load.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import load


class _NoSampler:
    def take(self) -> dict[str, float]:
        return {"server": 0.0, "broker": 0.0}


@pytest.mark.parametrize(("counted", "exact"), [(range(5), True), (range(4), False), ([0, 1, 2, 3, 4, 4], False)])
def test_checker_detects_a_lost_or_doubled_update(tmp_path: Path, counted: list[int], exact: bool) -> None:
    clients, size = 5, 1000
    w0 = np.random.default_rng(0).normal(0, 0.05, size).astype(np.float32)
    checker = load.Checker(tmp_path, w0, clients, _NoSampler())  # type: ignore[arg-type]
    base = load.base_vector(size)
    deltas = [load.delta_for(base, i, clients, 1) for i in counted]
    np.savez(tmp_path / "checkpoint.npz", weights=w0 - np.mean(deltas, axis=0, dtype=np.float32))
    row = {"round": 1, "round_s": 0.0, "aggregate_s": 0.0, "eval_s": 0.0, "clients_selected": clients}
    row |= {
        "clients_reported": clients,
        "missing": [],
        "rejected": {},
        "clients": {},
        "instructions": {},
        "bytes_out": 0,
    }
    checker.round_done(row)
    assert checker.rounds[0]["aggregate_exact"] is exact
