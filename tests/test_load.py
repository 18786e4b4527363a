"""The load benchmark (issues 7 and 16): its quick mode end to end at three sizes, and that its aggregate check
catches a lost or doubled update (else "exact" would prove nothing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import require_mosquitto, run_benchmark_quick

from benchmarks import load


@pytest.mark.integration
def test_quick_load_nothing_lost_or_doubled_one_model_per_round(tmp_path: Path) -> None:
    require_mosquitto()
    data, md = run_benchmark_quick("load", tmp_path)
    cfg = data["config"]
    assert (cfg["sizes"], cfg["rounds"]) == ([5, 10, 20], 3)
    assert (
        data["fd_limit"]["soft"] >= data["fd_limit"]["needed"] or data["fd_limit"]["soft"] == data["fd_limit"]["hard"]
    )
    for run in data["runs"]:
        n, model = run["clients"], run["model_message_bytes"]
        assert len(run["per_round"]) == 3
        for r in run["per_round"]:
            assert r["clients_reported"] == r["clients_selected"] == n, r
            assert r["missing"] == [] and "duplicate" not in r["rejected"], r
            assert r["aggregate_exact"], r
            assert r["bytes_up"] >= n * cfg["update_bytes"]  # every update crossed the broker whole
            # the model went out once, whatever the number of clients; the rest are small assignments
            assert model <= r["bytes_out"] <= model * 1.01 + 2048 * n, r
        assert run["updates_sent"] == 3 * n and run["client_errors"] == []
        assert run["models_received"] == 3 * n and run["model_requests"] == 0  # every device got every broadcast
        assert not run["broker_dropped_messages"]
    assert all(data["checks"].values()), data["checks"]
    assert "| server egress per round |" in md and "MISS" not in md


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
