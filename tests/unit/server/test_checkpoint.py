"""Checkpoints (server/checkpoint.py): every strategy's state survives one exactly, and a fresh run in a finished
run's directory does not inherit its clients' state. A server killed mid-run and resumed from its checkpoint:
tests/integration/test_faults.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_client.learning.data import ArrayDataset
from edge_client.learning.models import build_model, get_flat
from edge_client.wire.plan import Plan
from edgefl_testkit.messages import make_update
from server.checkpoint import pack_state, resumes, unpack_state
from server.experiments.simulate import client_state_dirs
from server.strategies import STRATEGIES, ServerContext, Strategy, TrainSettings, make_strategy

SPEC = {"name": "mlp", "in_features": 4, "num_classes": 3, "hidden": [5]}
CLIENTS = ["a", "b", "c"]
PARAMS: dict[str, dict[str, Any]] = {"drag-br": {"root_size": 12}, "taco": {"lambda_expel": 1, "gamma": 0.5}}


def fresh(name: str) -> Strategy:
    strategy = make_strategy(name, TrainSettings(5, 0.1, 8, fraction=0.67), PARAMS.get(name), seed=3, rounds=6)
    torch.manual_seed(0)
    rng = np.random.default_rng(5)
    root = ArrayDataset(rng.normal(size=(12, 4)).astype(np.float32), rng.integers(0, 3, size=12))
    n = get_flat(build_model(SPEC)).size
    strategy.setup(ServerContext(dict(SPEC), n, dict.fromkeys(CLIENTS, 10), root, seed=3))
    return strategy


def play_round(strategy: Strategy, round_: int, weights: np.ndarray, seed: int) -> tuple[np.ndarray, list[Any]]:
    """One round as the orchestrator drives it, with deterministic hand-made updates; what was decided on the way."""
    rng = np.random.default_rng(seed)
    selected = strategy.select(round_, CLIENTS)
    told = [selected, strategy.train_only(round_, CLIENTS, selected)]
    told += [strategy.assign(round_, cid) for cid in selected]
    n = weights.size
    updates = [
        make_update(
            cid,
            rng.normal(scale=0.1, size=n),
            round=round_,
            num_samples=10 + i,
            extras={"beta": 0.5 + i, "delta": 0.2 + i},
            arrays={k: rng.normal(size=n).astype(np.float32) for k in ("delta_c", "v", "grad", "G")},
        )
        for i, cid in enumerate(selected)
    ]
    new = strategy.aggregate(round_, weights, updates)
    told += [strategy.excluded(), strategy.round_metrics(), strategy.outputs(new)]
    return new, told


def assert_same(a: Any, b: Any) -> None:
    """Deep equality where arrays (and plans holding them) must match bit for bit."""
    if isinstance(a, Plan):  # every field
        assert_same(vars(a), vars(b))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b or (a != a and b != b)  # NaN == NaN for this purpose


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_continues_identically_after_a_checkpoint(name: str, tmp_path: Path) -> None:
    """Two rounds, checkpoint through npz, restore into a fresh strategy: round 3 decides and aggregates the same."""
    original = fresh(name)
    weights = get_flat(build_model(SPEC))
    for round_ in (1, 2):
        weights, _ = play_round(original, round_, weights, seed=round_)
    np.savez(tmp_path / "ck.npz", **pack_state(original))
    restored = fresh(name)
    with np.load(tmp_path / "ck.npz") as saved:
        assert not any(isinstance(v, list) and len(v) == weights.size for v in json.loads(str(saved["strategy"])))
        unpack_state(restored, saved)
    assert_same(restored.state_dict(), original.state_dict())
    assert_same(play_round(restored, 3, weights, seed=3), play_round(original, 3, weights, seed=3))


def test_client_state_is_kept_only_when_the_run_resumes(tmp_path: Path) -> None:
    """A fresh run in a finished run's directory must not hand its clients the old run's c_i; a resumed one must."""
    stale = tmp_path / "clients" / "client-00.state"
    stale.mkdir(parents=True)
    (stale / "scaffold.npz").write_bytes(b"old")
    np.savez(tmp_path / "checkpoint.npz", finished=False)
    assert resumes(tmp_path)
    assert (client_state_dirs(tmp_path, ["client-00"])["client-00"] / "scaffold.npz").exists()
    np.savez(tmp_path / "checkpoint.npz", finished=True)
    assert not resumes(tmp_path)
    assert not client_state_dirs(tmp_path, ["client-00"])["client-00"].exists()
