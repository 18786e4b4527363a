"""The in-process execution mode against the broker mode: same code, same seed, one thread per client, same result.
The in-process bus itself: tests/unit/server/experiments/test_inprocess.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgefl_testkit.federation import make_config, run_simulated
from server.broker import Broker
from server.datasets import load_dataset


def _accuracies(out: Path) -> list[float]:
    return [json.loads(line)["accuracy"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.parametrize("algorithm", ["scaffold", "fedveca"])
def test_inprocess_equals_broker_mode_after_three_rounds(broker: Broker, tmp_path: Path, algorithm: str) -> None:
    """SCAFFOLD carries client state between rounds, FedVeca adapts every client's tau: both must agree exactly."""
    bundle = load_dataset("digits", seed=0)
    results = {}
    for mode in ("broker", "inprocess"):
        config = make_config(
            tmp_path, f"eq-{algorithm}-{mode}", 3, 3, train={"algorithm": algorithm}, simulation={"threads": 1}
        )
        summary, _, _ = run_simulated(mode, config, bundle, broker)
        assert summary["mode"] == mode and summary["rounds"] == 3
        results[mode] = _accuracies(Path(config.run.out))
    assert results["inprocess"] == pytest.approx(results["broker"], abs=1e-4)
    assert results["inprocess"][-1] > 0.3  # it trained: ten classes, chance is 0.1
