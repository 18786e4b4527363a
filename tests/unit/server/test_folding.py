"""Aggregation folded as updates arrive (issue 16): every strategy's ``begin``/``fold``/``finish``, the store that
keeps a round's uploads for the algorithms that need all of them, and the orchestrator's drop of a round whose
aggregation failed. The formulas themselves are checked against hand-made vectors in
tests/unit/algorithms/test_algo_*.py."""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import numpy as np
import pytest

from edge_client.algorithms.contract import vector_norm
from edge_client.learning.data import ArrayDataset
from edge_client.learning.models import build_model, num_params
from edge_client.wire.messages import Update
from edge_client.wire.transport import LinkConfig
from edgefl_testkit.algorithms import admit
from edgefl_testkit.basics import spill_files
from edgefl_testkit.federation import Hooks, make_config
from edgefl_testkit.messages import make_update
from server.checkpoint import pack_state
from server.config import from_dict
from server.evaluation import Evaluator
from server.experiments.inprocess import run_inprocess
from server.experiments.simulate import client_ids, prepare_shards
from server.orchestrator import Orchestrator
from server.strategies import STRATEGIES, ServerContext, Strategy, TrainSettings, make_strategy
from server.strategies.store import UpdateStore

SETTINGS = TrainSettings(local_steps=3, lr=0.1, batch_size=4)
SPEC = {"name": "mlp", "in_features": 5, "num_classes": 3, "hidden": [4]}
D = num_params(build_model(SPEC))
CLIENTS = {f"c{i}": 10 + 3 * i for i in range(12)}
#: Algorithms that weight an upload only when all of a round's are in: they keep them in an UpdateStore.
STORED = {"taco", "foolsgold", "fedprox-taco", "scaffold-taco"}
STREAMING = sorted(set(STRATEGIES) - STORED)  # DRAG streams from its second round, once it has a reference


def strategy(name: str, tmp_path: Path, *, ram_bytes: int | None = None) -> Strategy:
    s = make_strategy(name, SETTINGS, seed=1, rounds=10)
    rng = np.random.default_rng(0)
    root = ArrayDataset(rng.standard_normal((16, 5), dtype=np.float32), rng.integers(0, 3, 16))
    ctx = ServerContext(SPEC, D, dict(CLIENTS), root, seed=1, run_dir=tmp_path)
    if ram_bytes is not None:
        ctx.store_ram_bytes = ram_bytes
    s.setup(ctx)
    return s


def updates(s: Strategy, round_: int, clients: list[str], seed: int) -> list[Update]:
    """Plausible admitted updates of ``round_``: a shared direction plus noise, the contract's arrays and values."""
    rng = np.random.default_rng(seed)
    common = rng.normal(size=D)
    return [
        make_update(
            cid,
            common + rng.normal(scale=0.8, size=D),
            round=round_,
            model_version=round_ - 1,
            num_samples=CLIENTS[cid],
            local_steps=SETTINGS.local_steps - i % 2,
            extras={v.name: 1.0 + 0.1 * i for v in s.contract.returns_values},
            arrays={a.name: rng.normal(size=D).astype(np.float32) for a in s.contract.returns},
        )
        for i, cid in enumerate(clients)
    ]


def play(s: Strategy, rounds: int, order: slice = slice(None)) -> list[np.ndarray]:
    """``rounds`` rounds of 6 clients each, their updates folded in ``order``; the models and the final state."""
    w = np.random.default_rng(5).normal(size=D).astype(np.float32)
    out = []
    for r in range(1, rounds + 1):
        chosen = sorted(CLIENTS)[:6]
        for cid in chosen:
            s.assign(r, cid)
        w = s.aggregate(r, w, updates(s, r, chosen, seed=r)[order])
        out.append(w)
    return out


def assert_close(a: object, b: object) -> None:
    """Equal up to float32 rounding: arrays and floats within 1e-5, containers element by element."""
    if isinstance(a, np.ndarray):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_close(a[key], b[key])
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    else:
        assert a == b


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_arrival_order_changes_only_rounding(name: str, tmp_path: Path) -> None:
    forward, backward = strategy(name, tmp_path), strategy(name, tmp_path)
    for a, b in zip(play(forward, 3), play(backward, 3, slice(None, None, -1)), strict=True):
        assert_close(a, b)
    assert_close(forward.state_dict(), backward.state_dict())
    assert_close(forward.round_metrics(), backward.round_metrics())


@pytest.mark.parametrize("name", STREAMING)
def test_a_streaming_strategy_keeps_no_update(name: str, tmp_path: Path) -> None:
    """Once folded, an update's vectors are the client's alone: nothing of the round holds them."""
    s = strategy(name, tmp_path)
    w = play(s, 1)[-1]  # DRAG has its reference from here on
    rnd = s.begin(2, w)
    alive = []
    for u in updates(s, 2, sorted(CLIENTS), seed=9):
        alive += [weakref.ref(u.delta), *(weakref.ref(a) for a in u.arrays.values())]
        s.fold(rnd, u)
        del u
    assert rnd.rows is None and not any(ref() is not None for ref in alive)
    assert [u.delta.size for u in rnd.reports] == [0] * len(CLIENTS)
    assert np.all(np.isfinite(s.finish(rnd)))


@pytest.mark.parametrize("name", sorted(STORED))
def test_a_stored_round_lets_go_of_its_updates_at_finish(name: str, tmp_path: Path) -> None:
    s = strategy(name, tmp_path)
    rnd = s.begin(1, np.zeros(D, dtype=np.float32))
    ups = updates(s, 1, sorted(CLIENTS)[:4], seed=2)
    refs = [weakref.ref(u.delta) for u in ups]
    for u in ups:
        s.fold(rnd, u)
    del ups, u
    assert all(ref() is not None for ref in refs) and len(rnd.store()) == 4  # kept: eq. 7 needs all of them
    s.finish(rnd)
    assert not any(ref() is not None for ref in refs)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_round_that_is_never_finished_changes_nothing(name: str, tmp_path: Path) -> None:
    """A round without an update (or one in progress when the server stops) is not in the strategy's state, so
    the checkpoint never holds it and the next round goes as if it had never begun."""
    s, plain = strategy(name, tmp_path), strategy(name, tmp_path)
    w = play(s, 1)[-1]
    play(plain, 1)
    before = pack_state(s)
    rnd = s.begin(2, w)
    for u in updates(s, 2, sorted(CLIENTS)[:3], seed=4):
        s.fold(rnd, u)
    after = pack_state(s)
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])
    ups = updates(s, 2, sorted(CLIENTS)[:5], seed=6)
    np.testing.assert_array_equal(s.aggregate(2, w, ups), plain.aggregate(2, w, ups))


def dots(store: UpdateStore, v: np.ndarray) -> np.ndarray:
    """``row_i . v`` for every row of ``store``."""
    return np.array([float(np.dot(row, v)) for row in store])


def test_store_spills_beyond_its_ram_bound_and_gives_the_same_numbers(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    rows = [rng.normal(size=1000).astype(np.float32) for _ in range(7)]
    in_ram, spilling = UpdateStore(1000), UpdateStore(1000, tmp_path, ram_bytes=3 * 4000)
    for store in (in_ram, spilling):
        for i, row in enumerate(rows):
            store.append(f"c{i}", row)
    assert (in_ram.spilled, spilling.spilled, spilling.held) == (0, 4, 3 * 4000)
    assert all(isinstance(r, np.memmap) for r in spilling.rows[3:]) and spilling.rows[0] is not rows[0]
    assert spilling.rows[0].base is rows[0]  # kept without a copy while within the bound
    assert spilling._spill is not None
    path = os.readlink(f"/proc/self/fd/{spilling._spill.file.fileno()}")
    assert path.startswith(str(tmp_path)) and os.listdir(tmp_path) == []  # in the run directory, and unnamed
    v = rng.normal(size=1000).astype(np.float32)
    coefs = [0.5, 0.0, -1.0, 2.0, 0.25, 0.0, 1.0]
    assert in_ram.norms == spilling.norms
    np.testing.assert_array_equal(in_ram.mean(), spilling.mean())
    np.testing.assert_array_equal(dots(in_ram, v), dots(spilling, v))
    np.testing.assert_array_equal(in_ram.weighted_sum(coefs), spilling.weighted_sum(coefs))
    want = sum(c * r.astype(np.float64) for c, r in zip(coefs, rows, strict=True))
    np.testing.assert_allclose(spilling.weighted_sum(coefs), want, rtol=1e-5, atol=1e-5)

    slots = len(spilling._spill.slots)
    spilling.clear()  # the next round reuses the mapped file
    for i, row in enumerate(rows):
        spilling.append(f"c{i}", row)
    assert spilling.spilled == 4 and len(spilling._spill.slots) == slots
    np.testing.assert_array_equal(in_ram.weighted_sum(coefs), spilling.weighted_sum(coefs))


def test_scores_fold_each_row_beside_its_dot_as_two_passes_would(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    rows = [rng.normal(size=1000).astype(np.float32) for _ in range(6)]
    v = rng.normal(size=1000).astype(np.float32)
    seen: list[tuple[int, float]] = []

    def rule(i: int, dot: float) -> float:  # a score of 0 for row 2: never added
        seen.append((i, dot))
        return 0.0 if i == 2 else dot / 100.0

    for ram_bytes in (1 << 30, 2 * 4000):  # in RAM, and mostly spilled
        store = UpdateStore(1000, tmp_path, ram_bytes)
        for i, row in enumerate(rows):
            store.append(f"c{i}", row)
        seen.clear()
        scores, total = store.scores(v, rule, fold=True)
        assert sorted(i for i, _ in seen) == list(range(6))  # each row's dot once
        want_scores = [0.0 if i == 2 else d / 100.0 for i, d in enumerate(dots(store, v))]
        np.testing.assert_allclose(scores, want_scores, rtol=1e-6)
        assert total is not None
        np.testing.assert_allclose(total, store.weighted_sum(want_scores), rtol=1e-5, atol=1e-6)
        assert store.scores(v, rule)[1] is None  # scores alone: no sum


def test_dots_with_a_reference_known_in_advance_are_taken_on_arrival(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    rows = [rng.normal(size=500).astype(np.float32) for _ in range(4)]
    ref = rng.normal(size=500).astype(np.float32)
    store = UpdateStore(500, tmp_path)
    store.clear(ref)
    for i, row in enumerate(rows):
        store.append(f"c{i}", row, norm=float(i))  # the norm admission measured is kept as given
    assert store.norms == [0.0, 1.0, 2.0, 3.0]
    np.testing.assert_allclose(store.reference_dots, [float(np.dot(r, ref)) for r in rows], rtol=1e-6)
    store.rows = [np.full(500, np.nan, np.float32)] * 4  # read nothing more: the dots come from arrival
    scores, _ = store.scores(ref, lambda i, dot: dot)
    np.testing.assert_allclose(scores, store.reference_dots)
    store.clear()
    assert store.reference is None and store.reference_dots == []


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_norm_admission_measured_is_the_norm_every_strategy_would_take(name: str, tmp_path: Path) -> None:
    given, measured = strategy(name, tmp_path), strategy(name, tmp_path)
    w = np.random.default_rng(6).normal(size=D).astype(np.float32)
    for r in (1, 2):
        chosen = sorted(CLIENTS)[:5]
        for s in (given, measured):
            for cid in chosen:
                s.assign(r, cid)
        ups = updates(given, r, chosen, seed=10 + r)
        a, b = given.begin(r, w), measured.begin(r, w)
        for u in ups:
            norm = admit(given, u)
            assert norm == vector_norm(u.delta)
            given.fold(a, u, norm)
            measured.fold(b, u)
        new = given.finish(a)
        np.testing.assert_array_equal(new, measured.finish(b))
        w = new


@pytest.mark.parametrize("name", sorted(STORED))
def test_spilling_changes_no_result(name: str, tmp_path: Path) -> None:
    in_ram, spilling = strategy(name, tmp_path), strategy(name, tmp_path, ram_bytes=2 * 4 * D)
    for a, b in zip(play(in_ram, 3), play(spilling, 3), strict=True):
        np.testing.assert_array_equal(a, b)
    assert in_ram.round_metrics() == spilling.round_metrics()
    assert spilling._store is not None and spilling._store._spill is not None  # it really spilled


def orchestrator(algorithm: str, digits, tmp_path: Path) -> Orchestrator:
    """Constructed, not connected: its aggregation path alone."""
    config = from_dict(
        {"run": {"out": str(tmp_path)}, "data": {"dataset": "digits"}, "train": {"algorithm": algorithm}}
    )
    orch = Orchestrator(config, LinkConfig("mqtt://127.0.0.1:1"), Evaluator(digits.model, digits.test), digits.model,
                        tmp_path)  # fmt: skip
    orch.strategy.setup(ServerContext(digits.model, orch.num_params, dict.fromkeys(("a", "b"), 10), run_dir=tmp_path))
    return orch


def test_a_failed_fold_drops_the_round_and_restores_the_state(digits, tmp_path: Path) -> None:
    orch = orchestrator("scaffold", digits, tmp_path)
    d, w = orch.num_params, np.ones(orch.num_params, dtype=np.float32)
    good = make_update("a", np.full(d, 0.5), arrays={"delta_c": np.ones(d, dtype=np.float32)})
    rnd = orch.strategy.begin(1, w)
    orch.strategy.fold(rnd, good)
    orch.strategy.fold(rnd, make_update("b", np.full(d, 0.5)))  # no delta_c: admission would have refused it
    before = pack_state(orch.strategy)
    assert orch._aggregate(1, w, rnd) == (w, "aggregation_error")
    for key, value in pack_state(orch.strategy).items():
        np.testing.assert_array_equal(value, before[key])
    rnd = orch.strategy.begin(1, w)  # the next round is not affected
    orch.strategy.fold(rnd, good)
    new, dropped = orch._aggregate(1, w, rnd)
    assert dropped is None
    np.testing.assert_allclose(new, 0.5)


def test_a_non_finite_aggregate_drops_the_round(digits, tmp_path: Path) -> None:
    orch = orchestrator("fedavg", digits, tmp_path)
    d, w = orch.num_params, np.zeros(orch.num_params, dtype=np.float32)
    rnd = orch.strategy.begin(1, w)
    for cid in ("a", "b"):  # each finite; their float32 sum is not
        orch.strategy.fold(rnd, make_update(cid, np.full(d, 3e38)))
    new, dropped = orch._aggregate(1, w, rnd)
    assert dropped == "non_finite_aggregate" and new is w


def test_a_run_spills_to_its_run_directory_at_train_store_ram_mb_and_trains_the_same(digits, tmp_path: Path) -> None:
    """A whole in-process TACO run with ``train.store_ram_mb = 0``: every upload is in the memory-mapped file in the
    run's --out while it runs, and the run's accuracies are those of the run that kept them in RAM."""
    accuracies, open_files = {}, {}
    for ram_mb in (0, 1024):
        config = make_config(tmp_path, f"taco-{ram_mb}", 3, 2, train={"algorithm": "taco", "store_ram_mb": ram_mb})
        out = Path(config.run.out)
        shards, _ = prepare_shards(digits, client_ids(3), config.data.partition, 0, out / "shards")
        seen: list[str] = []

        class Spy(Hooks):  # the open spill files when a row is written (the run still going)
            def round_done(self, row: dict[str, object], o: Path = out, s: list[str] = seen) -> None:
                s.extend(spill_files(o))

        summary = run_inprocess(config, shards, digits, out, observer=Spy())
        assert summary["rounds"] == 2
        accuracies[ram_mb] = [json.loads(line)["accuracy"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        open_files[ram_mb] = seen
    assert len(set(open_files[0])) == 1 and open_files[1024] == []  # one file (its mapping holds a second descriptor)
    assert accuracies[0] == accuracies[1024]
