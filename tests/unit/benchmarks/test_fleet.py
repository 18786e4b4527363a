"""The fleet benchmark's verdict (benchmarks/fleet.py): the deadline policy against FedAvg. The benchmark run:
tests/integration/benchmarks/test_fleet.py."""

from __future__ import annotations

import pytest

from benchmarks.fleet import verdict


def test_the_verdict_compares_the_deadline_policy_with_fedavg() -> None:
    base = {"time_to_target_s": 100.0, "final_accuracy": 0.975}
    assert verdict({"fedavg": base, "fednova": {"time_to_target_s": 55.0, "final_accuracy": 0.972}}) == {
        "time_ratio": 0.55, "accuracy_gap": pytest.approx(0.003), "pass": True,
    }  # fmt: skip
    assert not verdict({"fedavg": base, "fednova": {"time_to_target_s": 70.0, "final_accuracy": 0.975}})["pass"]
    assert not verdict({"fedavg": base, "fednova": {"time_to_target_s": 50.0, "final_accuracy": 0.96}})["pass"]
    assert not verdict({"fedavg": base, "fednova": {"time_to_target_s": None, "final_accuracy": 0.975}})["pass"]
    assert verdict({"fedavg": base}) is None
