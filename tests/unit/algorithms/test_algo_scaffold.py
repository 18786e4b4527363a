"""SCAFFOLD (ALGORITHMS.md 2.4): the client's corrected steps and c_i update with the steps actually taken, the
server's c update with 1/N over all registered clients, round 1 == FedAvg, state round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.algorithms.base import LocalContext
from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.algorithms.scaffold import ScaffoldClient
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.loop.compression import Uplink
from edge_client.wire import codecs as C
from edge_client.wire.messages import Assignment, RoundFacts, Update
from edge_client.wire.protocol import MissingField, NonFiniteValues, ProtocolError, ShapeMismatch, decode, encode
from edgefl_testkit.algorithms import admit, flat_of, reference_sgd, set_up, toy_data, toy_model, train_toy
from edgefl_testkit.messages import assignment, make_update
from server.strategies.base import TrainSettings
from server.strategies.fedavg import FedAvg
from server.strategies.scaffold import Scaffold

LR, BATCH, D = 0.1, 4, 8  # nn.Linear(3, 2) has 8 parameters


def dataset(seed: int = 7) -> ArrayDataset:
    return toy_data(12, seed)


def scaffold_assignment(
    weights: np.ndarray, steps: int, c: np.ndarray, alpha: float = 1.0, round_: int = 1, **params: int
) -> Assignment:
    """``params``: e.g. ``last_aggregated`` as the server sends it (absent: the client commits c_i at once)."""
    settings = {"alpha": alpha, **params}
    return assignment(weights, steps, LR, BATCH, settings=settings, arrays={"c": c.copy()}, round=round_)


def run_client(client, start: np.ndarray, steps: int, c: np.ndarray, alpha: float = 1.0, cid: str = "c0", **kw: int):
    task = scaffold_assignment(start, steps, c, alpha, **kw)
    if isinstance(client, FedAvgClient):  # the same round for FedAvg, whose contract sends nothing else
        task.plan.settings, task.plan.arrays = {}, {}
    return train_toy(client, task, dataset(seed=len(cid) * 7 + ord(cid[-1])), cid)


def manual_sgd(start: np.ndarray, steps: int, constant: np.ndarray, cid: str = "c0") -> np.ndarray:
    """``steps`` SGD steps along autograd's CE gradient plus a constant vector (the spec's v = g + alpha (c - c_i))."""
    data = dataset(seed=len(cid) * 7 + ord(cid[-1]))
    extra = torch.from_numpy(constant)
    return reference_sgd(start, data, BatchSampler(len(data), BATCH, 0, cid), steps, LR, lambda w: extra)


def test_client_round_matches_the_formulas() -> None:
    rng = np.random.default_rng(0)
    start = flat_of(toy_model(seed=1))
    c, c_i = rng.normal(size=D).astype(np.float32), rng.normal(size=D).astype(np.float32)
    client = ScaffoldClient()
    client.load_state_dict({"c_i": c_i.copy()})
    alpha, steps = 0.5, 6
    result = run_client(client, start, steps, c, alpha)
    end = manual_sgd(start, steps, alpha * (c - c_i))
    np.testing.assert_allclose(start - result.delta, end, rtol=0, atol=1e-5)
    delta = start - end
    new_c_i = c_i - c + delta / (steps * LR)  # 2.4 (a)
    np.testing.assert_allclose(client.state_dict()["c_i"], new_c_i, rtol=0, atol=1e-4)
    np.testing.assert_allclose(result.arrays["delta_c"], new_c_i - c_i, rtol=0, atol=1e-4)
    assert result.arrays["delta_c"].dtype == np.float32


def test_alpha_is_read_every_round() -> None:
    rng = np.random.default_rng(1)
    start = flat_of(toy_model(seed=1))
    c, c_i = rng.normal(size=D).astype(np.float32), rng.normal(size=D).astype(np.float32)
    for alpha in (0.0, 2.0):
        client = ScaffoldClient()
        client.load_state_dict({"c_i": c_i.copy()})
        result = run_client(client, start, 4, c, alpha)
        np.testing.assert_allclose(start - result.delta, manual_sgd(start, 4, alpha * (c - c_i)), atol=1e-5)
    with pytest.raises(ContractError, match=r"scaffold.alpha: missing from the assignment"):
        a = scaffold_assignment(start, 2, c)
        a.plan.settings = {}
        train_toy(ScaffoldClient(), a, dataset())


def drive_hooks(client: ScaffoldClient, start: np.ndarray, told: int, taken: int, c: np.ndarray) -> tuple:
    """The trainer's loop, stopped after ``taken`` of the ``told`` steps (a client that ran out of time)."""
    flat = FlatModel(toy_model(seed=3))
    flat.load(start)
    data = dataset()
    sampler = BatchSampler(len(data), BATCH, 0, "c0")
    a = scaffold_assignment(start, told, c)
    client.contract.check_plan(a.plan, flat.size)
    ctx = LocalContext(flat, flat.params.clone(), a.plan, a.facts, data, sampler)
    client.begin_round(ctx)
    for step in range(taken):
        idx = sampler.next()
        flat.loss_and_grad(torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx]))
        client.correct(ctx, step, None, None)
        flat.params.add_(flat.grad, alpha=-LR)
    delta = (ctx.start - flat.params).numpy()
    return delta, client.end_round(ctx, delta)[1]["delta_c"]


def test_c_i_uses_the_steps_actually_taken() -> None:
    rng = np.random.default_rng(2)
    start = flat_of(toy_model(seed=1))
    c = rng.normal(size=D).astype(np.float32)
    client = ScaffoldClient()
    delta, delta_c = drive_hooks(client, start, told=5, taken=3, c=c)
    np.testing.assert_allclose(delta_c, delta / (3 * LR) - c, rtol=0, atol=1e-4)  # K_i = 3, not tau = 5
    assert np.abs(delta / (5 * LR) - c - delta_c).max() > 1e-2
    np.testing.assert_allclose(client.state_dict()["c_i"], delta / (3 * LR) - c, atol=1e-4)
    # no step at all: c_i stays, delta_c = 0
    before = client.state_dict()["c_i"]
    delta, delta_c = drive_hooks(client, start, told=5, taken=0, c=c)
    assert not delta.any() and not delta_c.any()
    np.testing.assert_array_equal(client.state_dict()["c_i"], before)


def test_c_i_uses_a_per_client_tau() -> None:
    # The server may tell a client fewer steps than the run's K: the client's K_i is what it ran (reported).
    start = flat_of(toy_model(seed=1))
    c = np.full(D, 0.1, dtype=np.float32)
    client = ScaffoldClient()
    result = run_client(client, start, 3, c)
    assert result.local_steps == 3
    np.testing.assert_allclose(result.arrays["delta_c"], result.delta / (result.local_steps * LR) - c, atol=1e-4)


def test_round_one_is_fedavg() -> None:
    start = flat_of(toy_model(seed=1))
    zeros = np.zeros(D, dtype=np.float32)
    results = {}
    for cid in ("a", "b"):
        s = run_client(ScaffoldClient(), start, 5, zeros, cid=cid)
        f = run_client(FedAvgClient(), start, 5, zeros, cid=cid)
        np.testing.assert_array_equal(s.delta, f.delta)
        results[cid] = s
    server = make_server(["a", "b"])
    np.testing.assert_array_equal(server.assign(1, "a").arrays["c"], zeros)
    fedavg = FedAvg(TrainSettings(5, LR, BATCH))
    ups = [update(cid, r.delta, r.arrays["delta_c"]) for cid, r in results.items()]
    np.testing.assert_array_equal(server.aggregate(1, start, ups), fedavg.aggregate(1, start, ups))


def make_server(clients: list[str], params: dict | None = None, samples: dict | None = None) -> Scaffold:
    server = Scaffold(TrainSettings(local_steps=5, lr=LR, batch_size=BATCH), params)
    return set_up(server, D, {c: (samples or {}).get(c, 1) for c in clients})


def update(cid: str, delta: np.ndarray, delta_c: np.ndarray | None, samples: int = 1, steps: int = 5) -> Update:
    arrays = {} if delta_c is None else {"delta_c": np.asarray(delta_c, dtype=np.float32)}
    return make_update(cid, delta, num_samples=samples, local_steps=steps, arrays=arrays)


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_server_c_update_divides_by_all_registered_clients(weighting: str) -> None:
    """``c_mean_over = "registered"``: 2.4 (b)'s rule, N = every registered client."""
    rng = np.random.default_rng(3)
    samples = {"a": 2, "b": 6, "c": 1, "d": 1}
    server = make_server(list(samples), {"weighting": weighting, "c_mean_over": "registered"}, samples)
    w = rng.normal(size=D).astype(np.float32)
    c = np.zeros(D)
    for round_ in (1, 2):
        d = {k: rng.normal(size=D) for k in ("a", "b")}  # partial participation: 2 of 4
        dc = {k: rng.normal(size=D) for k in ("a", "b")}
        ups = [update(k, d[k], dc[k], samples[k]) for k in ("a", "b")]
        sent = server.assign(round_, "c").arrays["c"]
        np.testing.assert_allclose(sent, c, atol=1e-6)
        p = {"a": 0.5, "b": 0.5} if weighting == "uniform" else {"a": 2 / 8, "b": 6 / 8}
        expected_w = w - (p["a"] * d["a"] + p["b"] * d["b"])
        w = server.aggregate(round_, w, ups)
        np.testing.assert_allclose(w, expected_w, atol=1e-5)
        c = c + (dc["a"] + dc["b"]) / 4  # N = 4 registered clients, not the 2 that reported
        np.testing.assert_allclose(server.c, c, atol=1e-5)
        np.testing.assert_allclose(sent, c - (dc["a"] + dc["b"]) / 4, atol=1e-6)  # handed-out c not mutated


def mean_c_i(server: Scaffold, clients: dict[str, ScaffoldClient]) -> np.ndarray:
    """The mean of the c_i ``server.c`` must equal: over the clients aggregated so far (``c_mean_over`` default
    "contributors"), or over every registered one ("registered", whose c_i is 0 until it contributes)."""
    over = clients if server.params["c_mean_over"] == "registered" else server.aggregated
    return np.mean([clients[k].state_dict().get("c_i", np.zeros(D, dtype=np.float32)) for k in over], axis=0)


@pytest.mark.parametrize("c_mean_over", ["contributors", "registered"])
def test_server_c_equals_mean_of_all_c_i_under_partial_participation(c_mean_over: str) -> None:
    ids = ["a", "b", "c"]
    clients = {k: ScaffoldClient() for k in ids}
    server = make_server(ids, {"c_mean_over": c_mean_over})
    w = flat_of(toy_model(seed=4))
    for round_, chosen in enumerate((["a", "b"], ["b", "c"], ["a", "c"]), start=1):
        ups = []
        for k in chosen:
            told = server.assign(round_, k)
            r = run_client(clients[k], w, told.steps, told.arrays["c"], told.settings["alpha"], cid=k)
            ups.append(update(k, r.delta, r.arrays["delta_c"]))
        w = server.aggregate(round_, w, ups)
        np.testing.assert_allclose(server.c, mean_c_i(server, clients), atol=1e-5)
    assert np.abs(server.c).max() > 1e-3


def test_server_assignment() -> None:
    server = make_server(["a", "b"])
    told = server.assign(1, "a")
    assert told.settings == {"alpha": 1.0, "last_aggregated": 0}
    assert set(told.arrays) == {"c"} and told.arrays["c"].shape == (D,)
    assert [a.name for a in Scaffold.contract.returns] == ["delta_c"]
    assert make_server(["a"], {"alpha": 0.3}).assign(1, "a").settings["alpha"] == 0.3
    with pytest.raises(ContractError, match=r"scaffold.weighting = 'median': expected one of 'uniform', 'samples'"):
        Scaffold(TrainSettings(5, LR, BATCH), {"weighting": "median"})


def test_server_rejects_updates_without_a_valid_delta_c() -> None:
    server = make_server(["a"])
    with pytest.raises(MissingField, match="delta_c"):
        admit(server, update("a", np.zeros(D), None))
    with pytest.raises(ShapeMismatch, match="delta_c"):
        admit(server, update("a", np.zeros(D), np.zeros(D + 1)))
    bad = np.zeros(D)
    bad[2] = np.nan
    with pytest.raises(NonFiniteValues, match="delta_c"):
        admit(server, update("a", np.zeros(D), bad))
    admit(server, update("a", np.zeros(D), np.zeros(D)))


def test_state_round_trips() -> None:
    client = ScaffoldClient()
    assert client.state_dict() == {}
    run_client(client, flat_of(toy_model()), 3, np.full(D, 0.2, dtype=np.float32))
    saved = client.state_dict()
    restored = ScaffoldClient()
    restored.load_state_dict(saved)
    np.testing.assert_array_equal(restored.state_dict()["c_i"], saved["c_i"])
    start = flat_of(toy_model(seed=8))
    c = np.full(D, -0.1, dtype=np.float32)
    a, b = run_client(client, start, 3, c), run_client(restored, start, 3, c)
    np.testing.assert_array_equal(a.delta, b.delta)
    np.testing.assert_array_equal(a.arrays["delta_c"], b.arrays["delta_c"])

    server = make_server(["a", "b"])
    server.aggregate(1, np.zeros(D, dtype=np.float32), [update("a", np.ones(D), np.full(D, 0.5))])
    state = server.state_dict()
    other = make_server(["a", "b"])
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.c, server.c)
    np.testing.assert_allclose(other.c, np.full(D, 0.5))  # the mean of its one contributor's c_i


def test_c_i_is_committed_only_when_the_server_aggregated_that_round() -> None:
    """Round 1's c_i^new waits as pending; round 2's assignment says round 1 was aggregated: committed. Round 2's
    update is lost; round 3's assignment still says 1: round 2's c_i^new is discarded, round 3 corrects with round 1's.
    """
    start, c = flat_of(toy_model(seed=1)), np.full(D, 0.1, dtype=np.float32)
    client = ScaffoldClient()
    r1 = run_client(client, start, 4, c, round_=1, last_aggregated=0)
    assert "c_i" in client.state_dict() and not client.state_dict()["c_i"].any()  # nothing committed yet
    assert int(client.state_dict()["pending_round"]) == 1
    np.testing.assert_array_equal(client.state_dict()["pending_c_i"], r1.arrays["delta_c"])
    run_client(client, start, 4, c, round_=2, last_aggregated=1)  # commit round 1, train round 2 (lost)
    np.testing.assert_array_equal(client.state_dict()["c_i"], r1.arrays["delta_c"])
    assert int(client.state_dict()["pending_round"]) == 2
    restored = ScaffoldClient()  # the pending c_i survives a restart through the state file
    restored.load_state_dict(client.state_dict())
    for c_now in (client, restored):
        r3 = run_client(c_now, start, 4, c, round_=3, last_aggregated=1)  # round 2 was never aggregated
        # the correction used round 1's c_i: the step equals one from a client that never saw round 2
        fresh = ScaffoldClient()
        fresh.load_state_dict({"c_i": r1.arrays["delta_c"]})
        np.testing.assert_array_equal(r3.delta, run_client(fresh, start, 4, c).delta)
        np.testing.assert_array_equal(c_now.state_dict()["c_i"], r1.arrays["delta_c"])
        assert int(c_now.state_dict()["pending_round"]) == 3


@pytest.mark.parametrize("c_mean_over", ["contributors", "registered"])
def test_server_c_stays_the_mean_of_the_c_i_when_updates_are_lost(c_mean_over: str) -> None:
    """The server's assignments settle each client's pending c_i: updates it never aggregated leave c = mean(c_i)."""
    ids = ["a", "b", "c"]
    clients = {k: ScaffoldClient() for k in ids}
    server = make_server(ids, {"c_mean_over": c_mean_over})
    w = flat_of(toy_model(seed=4))
    lost = {1: {"b"}, 2: set(), 3: {"a", "c"}, 4: {"b"}}  # trained and uploaded, never aggregated
    for round_, dropped in lost.items():
        ups = []
        for k in ids:
            told = server.assign(round_, k)
            r = run_client(clients[k], w, told.steps, told.arrays["c"], cid=k, round_=round_, **told.settings)
            if k not in dropped:
                ups.append(update(k, r.delta, r.arrays["delta_c"]))
        w = server.aggregate(round_, w, ups)
        for k in ids:  # what the next assignment would make of each pending c_i
            clients[k].settle(server.assign(round_ + 1, k).settings["last_aggregated"])
        np.testing.assert_allclose(server.c, mean_c_i(server, clients), atol=1e-5)
    assert server.aggregated == {"a": 4, "b": 3, "c": 4}
    assert np.abs(server.c).max() > 1e-3
    restored = make_server(ids, {"c_mean_over": c_mean_over})  # the bookkeeping is checkpointed with c
    restored.load_state_dict(server.state_dict())
    assert restored.aggregated == server.aggregated


@pytest.mark.parametrize("codec", ["fp16", "int8:4", "topk:0.25+int8"])
def test_server_c_stays_the_mean_of_the_c_i_with_compressed_uploads(codec: str) -> None:
    """``delta_c`` is declared ``codec="commit"``: it may travel lossily, and each client then takes
    ``c_i^old + delta_c`` as the server decoded it, so c is still the mean of the c_i."""
    ids = ["a", "b", "c"]
    clients = {k: ScaffoldClient() for k in ids}
    uplinks = {k: Uplink(k) for k in ids}
    server = make_server(ids)
    w = flat_of(toy_model(seed=4))
    lossy = 0
    for round_ in range(1, 5):
        ups = []
        for k in ids:
            told, facts = server.assign(round_, k), RoundFacts(round=round_, codec=codec)
            r = run_client(clients[k], w, told.steps, told.arrays["c"], cid=k, round_=round_, **told.settings)
            delta, arrays = uplinks[k].encode(facts, clients[k], r.delta, r.arrays)
            received = decode(encode(Update(round_, 0, k, 1, 5, 0.0, 0.0, 0.0, delta, arrays=arrays)))  # a frame
            assert isinstance(received, Update)
            lossy += not np.array_equal(received.arrays["delta_c"], r.arrays["delta_c"])
            admit(server, received, codec=codec)
            ups.append(received)
        w = server.aggregate(round_, w, ups)
        for k in ids:
            clients[k].settle(server.assign(round_ + 1, k).settings["last_aggregated"])
        np.testing.assert_allclose(server.c, mean_c_i(server, clients), atol=1e-6)
    assert lossy >= 6 and np.abs(server.c).max() > 1e-3  # the codec did change delta_c, and c moved


def test_delta_c_compressed_against_the_assignment_is_refused() -> None:
    server = make_server(["a"])
    delta_c = C.encode(np.ones(D, np.float32), C.parse("int8"), np.random.default_rng(0))
    frame = decode(encode(Update(1, 0, "a", 1, 5, 0.0, 0.0, 0.0, np.zeros(D, np.float32), arrays={"delta_c": delta_c})))
    with pytest.raises(ProtocolError, match="delta_c") as info:
        admit(server, frame)  # told fp32
    assert info.value.reason == "codec"
    admit(server, frame, codec="int8")
