"""DRAG and DRAG-BR (ALGORITHMS.md 2.8): server formulas vs independent numpy recomputations, client = FedAvg.

The reference formulas below are written from the spec in the paper's increment convention (``g = -delta``) and
float64; they never call the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.drag import DragClient
from edge_client.algorithms.drag_br import DragBRClient
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.learning.models import build_model, get_flat, set_flat
from edge_client.wire.messages import Update
from edgefl_testkit.algorithms import reference_sgd, toy_data, toy_model, train_assignment
from edgefl_testkit.messages import assignment, make_update
from server.strategies.base import ServerContext, TrainSettings
from server.strategies.drag import Drag
from server.strategies.drag_br import DragBR

SETTINGS = TrainSettings(local_steps=3, lr=0.1, batch_size=4)
SPEC = {"name": "mlp", "in_features": 4, "num_classes": 3, "hidden": [5]}


def upd(cid: str, delta: np.ndarray) -> Update:
    return make_update(cid, delta, local_steps=3)


def incs(gs: dict[str, np.ndarray]) -> list[Update]:
    """Updates whose DRAG increments are ``gs`` (the wire carries delta = -g)."""
    return [upd(cid, -np.asarray(g, dtype=np.float64)) for cid, g in gs.items()]


# --- independent reference formulas (ALGORITHMS.md 2.8, eq. 10, 11, 14) ---------------------------------------------


def ref_cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = np.sqrt(a @ a), np.sqrt(b @ b)
    return 0.0 if na < 1e-12 or nb < 1e-12 else float(a @ b / (na * nb))


def ref_lambda(g: np.ndarray, r: np.ndarray, c: float) -> float:
    return c * (1.0 - ref_cos(g, r))


def ref_v11(g: np.ndarray, r: np.ndarray, c: float) -> np.ndarray:
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    if np.linalg.norm(r) < 1e-12:
        return g
    lam = ref_lambda(g, r, c)
    return (1 - lam) * g + lam * np.linalg.norm(g) / np.linalg.norm(r) * r


def ref_v14(g: np.ndarray, r: np.ndarray, c: float) -> np.ndarray:
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    lam = ref_lambda(g, r, c)
    if np.linalg.norm(g) < 1e-12:
        return lam * r
    return (1 - lam) * np.linalg.norm(r) / np.linalg.norm(g) * g + lam * r


def drag_with_reference(r: np.ndarray, **params: object) -> Drag:
    s = Drag(SETTINGS, dict(params))
    s.load_state_dict({"r": np.asarray(r, np.float32).tolist()})
    return s


# --- DRAG ---------------------------------------------------------------------------------------------------------


def test_defaults_and_validation() -> None:
    s = Drag(SETTINGS)
    assert s.name == "drag"
    assert s.params == {"c": 0.1, "alpha": 1.0, "angle_approx": "linear_pi_over_2"}
    with pytest.raises(ValueError, match="c"):
        Drag(SETTINGS, {"c": 1.5})
    with pytest.raises(ValueError, match="alpha"):
        Drag(SETTINGS, {"alpha": -0.1})
    with pytest.raises(ValueError, match="angle_approx"):
        Drag(SETTINGS, {"angle_approx": "cubic"})


def test_round0_single_client_is_fedavg_with_increment_sign() -> None:
    """r^0 = mean of the current uploads; a lone update is parallel to it, so theta_1 = theta_0 + g = w - delta."""
    w = np.array([1.0, -2.0, 0.5], np.float32)
    delta = np.array([0.3, -0.1, 0.2], np.float32)
    s = Drag(SETTINGS)
    out = s.aggregate(1, w, [upd("a", delta)])
    np.testing.assert_allclose(out, w - delta, atol=1e-7)
    assert s.round_metrics() == {"lambda": {"a": pytest.approx(0.0, abs=1e-7)}}


def test_parallel_update_is_unchanged() -> None:
    r = np.array([1.0, 2.0, -1.0, 0.5])
    w = np.zeros(4, np.float32)
    s = drag_with_reference(r, c=0.3)
    out = s.aggregate(2, w, incs({"a": 2.5 * r}))
    np.testing.assert_allclose(out, 2.5 * r, rtol=1e-6)
    assert s.round_metrics()["lambda"]["a"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("c", [0.1, 0.25, 0.4])
def test_reversed_update_maps_to_4c_minus_1_times_reference(c: float) -> None:
    """g = -k r: lambda = 2c and eq. 11 gives (4c - 1)(|g|/|r|) r (2.8 (e))."""
    r = np.array([0.5, -1.0, 2.0])
    g = -3.0 * r
    s = drag_with_reference(r, c=c)
    out = s.aggregate(2, np.zeros(3, np.float32), incs({"m": g}))
    expected = (4 * c - 1) * (np.linalg.norm(g) / np.linalg.norm(r)) * r
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert s.round_metrics()["lambda"]["m"] == pytest.approx(2 * c)


def test_lambda_values_on_hand_made_vectors() -> None:
    r = np.array([1.0, 0.0, 0.0])
    gs = {"45deg": [1.0, 1.0, 0.0], "90deg": [0.0, 2.0, 0.0], "180deg": [-3.0, 0.0, 0.0], "135deg": [-1.0, 1.0, 0.0]}
    c = 0.25
    cosines = {"45deg": 1 / math.sqrt(2), "90deg": 0.0, "180deg": -1.0, "135deg": -1 / math.sqrt(2)}
    angles = {"45deg": math.pi / 4, "90deg": math.pi / 2, "180deg": math.pi, "135deg": 3 * math.pi / 4}
    expected = {
        "linear_pi_over_2": {k: c * (1 - x) for k, x in cosines.items()},
        "linear_unit": {k: c * (1 - 2 / math.pi * x) for k, x in cosines.items()},
        "exact_arccos": {k: c * a / (math.pi / 2) for k, a in angles.items()},
    }
    for approx, lam in expected.items():
        s = drag_with_reference(r, c=c, angle_approx=approx)
        out = s.aggregate(2, np.zeros(3, np.float32), incs(gs))
        got = s.round_metrics()["lambda"]
        assert got == pytest.approx(lam, abs=1e-6), approx
        # and the aggregate uses those lambdas in eq. 11
        v = [(1 - lam[k]) * np.asarray(g) + lam[k] * np.linalg.norm(g) / np.linalg.norm(r) * r for k, g in gs.items()]
        np.testing.assert_allclose(out, np.mean(v, axis=0), rtol=1e-5, atol=1e-6)


def test_dragged_update_never_longer_than_raw() -> None:
    rng = np.random.default_rng(3)
    r = rng.normal(size=20)
    for _ in range(20):
        g = rng.normal(size=20) * rng.uniform(0.1, 10)
        s = drag_with_reference(r, c=0.5)
        v = s.aggregate(2, np.zeros(20, np.float32), incs({"a": g}))
        assert np.linalg.norm(v) <= np.linalg.norm(g) * (1 + 1e-5)
        np.testing.assert_allclose(v, ref_v11(g, r, 0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("c", "alpha"), [(0.25, 0.6), (0.1, 1.0), (0.1, 0.2)])
def test_reference_recursion_over_three_rounds(c: float, alpha: float) -> None:
    """Eq. 6 (r^0 = mean g^0; r^t = (1-alpha) r^{t-1} + alpha Delta^{t-1}), eq. 8, 10, 11, theta += Delta; with a
    changing set of participants (partial participation)."""
    rng = np.random.default_rng(7)
    d = 9
    w = rng.normal(size=d).astype(np.float32)
    rounds = [
        {"a": rng.normal(size=d), "b": rng.normal(size=d), "c": rng.normal(size=d)},
        {"a": rng.normal(size=d), "c": rng.normal(size=d)},
        {"b": rng.normal(size=d), "c": rng.normal(size=d), "d": rng.normal(size=d)},
    ]
    s = Drag(SETTINGS, {"c": c, "alpha": alpha})
    theta, r = w.astype(np.float64), None
    weights = w
    for t, gs in enumerate(rounds, start=1):
        gs32 = {k: np.asarray(g, np.float32).astype(np.float64) for k, g in gs.items()}
        if r is None:
            r = np.mean(list(gs32.values()), axis=0)
        lam = {k: ref_lambda(g, r, c) for k, g in gs32.items()}
        v = [ref_v11(g, r, c) for g in gs32.values()]
        big_delta = np.mean(v, axis=0)
        theta = theta + big_delta
        r = (1 - alpha) * r + alpha * big_delta
        weights = s.aggregate(t, weights, incs(gs32))
        np.testing.assert_allclose(weights, theta, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(s.state_dict()["r"]), r, rtol=1e-5, atol=1e-6)
        assert s.round_metrics()["lambda"] == pytest.approx(lam, abs=1e-6)


def test_degenerate_norms() -> None:
    """(f)5: |g| = 0 -> v = 0; |r| = 0 -> no dragging (v = g), reported lambda 0."""
    r = np.array([1.0, 1.0, 0.0])
    s = drag_with_reference(r, c=0.25)
    g = np.array([0.0, 2.0, 1.0])
    out = s.aggregate(2, np.zeros(3, np.float32), incs({"zero": np.zeros(3), "g": g}))
    np.testing.assert_allclose(out, ref_v11(g, r, 0.25) / 2, rtol=1e-5, atol=1e-7)  # the zero update adds 0
    assert np.all(np.isfinite(out))

    s = drag_with_reference(np.zeros(3), c=0.25)
    out = s.aggregate(2, np.zeros(3, np.float32), incs({"a": g, "b": -0.5 * g}))
    np.testing.assert_allclose(out, (g - 0.5 * g) / 2, rtol=1e-6)
    assert s.round_metrics()["lambda"] == {"a": 0.0, "b": 0.0}

    # round 0 whose uploads cancel: r^0 = 0 -> plain averaging, then r^1 = Delta^0 = 0 as well
    s = Drag(SETTINGS, {"c": 0.25, "alpha": 1.0})
    out = s.aggregate(1, np.ones(3, np.float32), incs({"a": g, "b": -g}))
    np.testing.assert_allclose(out, np.ones(3), atol=1e-7)
    assert np.all(np.isfinite(out))


def test_state_dict_round_trip_through_json() -> None:
    rng = np.random.default_rng(11)
    w = rng.normal(size=6).astype(np.float32)
    s = Drag(SETTINGS, {"c": 0.25, "alpha": 0.6})
    assert s.state_dict() == {"r": None}
    w = s.aggregate(1, w, incs({"a": rng.normal(size=6), "b": rng.normal(size=6)}))
    w = s.aggregate(2, w, incs({"a": rng.normal(size=6), "b": rng.normal(size=6)}))
    restored = Drag(SETTINGS, {"c": 0.25, "alpha": 0.6})
    restored.load_state_dict(s.state_dict())
    nxt = incs({"a": rng.normal(size=6), "b": rng.normal(size=6)})
    np.testing.assert_array_equal(s.aggregate(3, w, nxt), restored.aggregate(3, w, nxt))
    np.testing.assert_array_equal(np.asarray(s.state_dict()["r"]), np.asarray(restored.state_dict()["r"]))


# --- client halves: FedAvg under their own names ------------------------------------------------------------------


@pytest.mark.parametrize("cls", [DragClient, DragBRClient])
def test_client_half_is_plain_sgd(cls: type[FedAvgClient]) -> None:
    assert issubclass(cls, FedAvgClient)
    assert cls.contract.name == {"DragClient": "drag", "DragBRClient": "drag-br"}[cls.__name__]
    flat = FlatModel(toy_model())
    w0 = flat.numpy()
    data = toy_data(10, seed=0)
    a = assignment(w0, 4, 0.2, round=1, algorithm=cls.contract.name)
    res = train_assignment(flat, data, BatchSampler(10, 4, 5, "c0"), a, cls())
    manual = reference_sgd(w0, data, BatchSampler(10, 4, 5, "c0"), 4, 0.2)
    np.testing.assert_allclose(res.delta, w0 - manual, atol=1e-6)
    assert res.extras == {} and res.arrays == {}


# --- DRAG-BR ------------------------------------------------------------------------------------------------------


def root_data(n: int = 12, seed: int = 2) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, size=n))


def make_br(settings: TrainSettings = SETTINGS, root: ArrayDataset | None = None, **params: object) -> DragBR:
    s = DragBR(settings, dict(params), seed=0)
    torch.manual_seed(0)
    n = get_flat(build_model(SPEC)).size
    s.setup(ServerContext(dict(SPEC), n, {}, root if root is not None else root_data(), seed=4))
    return s


def initial_weights() -> np.ndarray:
    torch.manual_seed(1)
    return get_flat(build_model(SPEC))


def manual_root_reference(w: np.ndarray, root: ArrayDataset, settings: TrainSettings, indices: list[np.ndarray]):
    """U plain SGD steps by autograd on a separate model (eq. 12-13): r = theta^{t,U} - theta^t."""
    model = build_model(SPEC)
    set_flat(model, w)
    for idx in indices[: settings.local_steps]:
        model.zero_grad()
        F.cross_entropy(model(torch.from_numpy(root.x[idx])), torch.from_numpy(root.y[idx])).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= settings.lr * p.grad
    return get_flat(model).astype(np.float64) - w.astype(np.float64)


def test_br_defaults_root_size_and_missing_root() -> None:
    s = DragBR(SETTINGS)
    assert s.name == "drag-br"
    assert s.params == {"c": 0.1, "angle_approx": "linear_pi_over_2", "root_size": 0}
    # 0: the paper's 3000 samples where they are at most a tenth of the training set, else a tenth of it
    assert s.root_size(60000) == s.root_size(30000) == 3000
    assert s.root_size(14360) == 1436
    assert DragBR(SETTINGS, {"root_size": 500}).root_size(60000) == 500
    with pytest.raises(ContractError, match=r"drag-br.root_size = -1: expected an integer >= 0"):
        DragBR(SETTINGS, {"root_size": -1})
    with pytest.raises(ValueError, match=r"\[algorithm\.drag-br\] root_size"):
        s.setup(ServerContext(dict(SPEC), 43, {}, None))


def test_br_full_batch_reference_is_u_manual_sgd_steps() -> None:
    """Batch >= root size: every step uses the whole root set, so no sampler order is involved."""
    root = root_data(10)
    settings = TrainSettings(local_steps=4, lr=0.3, batch_size=64)
    s = make_br(settings, root)
    w = initial_weights()
    everything = [np.arange(10)] * 4
    r = manual_root_reference(w, root, settings, everything)
    np.testing.assert_allclose(s.reference(1, w), r, atol=1e-6)
    # a client update parallel to r is re-scaled to |r| (eq. 14, lambda = 0): theta_1 = theta_0 + r
    out = s.aggregate(1, w, incs({"a": 7.0 * r}))
    np.testing.assert_allclose(out, w + r, atol=1e-6)
    assert s.round_metrics()["lambda"]["a"] == pytest.approx(0.0, abs=1e-6)
    assert s.round_metrics()["r_norm"] == pytest.approx(np.linalg.norm(r), rel=1e-5)


def test_br_minibatch_reference_uses_documented_root_stream() -> None:
    root = root_data(12)
    s = make_br(SETTINGS, root)
    w = initial_weights()
    for round_ in (1, 2):
        sampler = BatchSampler(12, SETTINGS.batch_size, 4, f"drag-br-root/{round_}")  # seed 4 = ServerContext.seed
        r = manual_root_reference(w, root, SETTINGS, [sampler.next() for _ in range(SETTINGS.local_steps)])
        np.testing.assert_allclose(s.reference(round_, w), r, atol=1e-6)
        np.testing.assert_allclose(s.reference(round_, w), r, atol=1e-6)  # reproducible (restart-safe)


def test_br_eq14_on_hand_made_vectors_and_degenerate_g() -> None:
    rng = np.random.default_rng(5)
    s = make_br(c=0.25)
    r = rng.normal(size=s.ctx.num_params)
    s.reference = lambda round_, weights: r.astype(np.float32)  # type: ignore[method-assign]
    gs = {f"m{i}": rng.normal(size=r.size) * rng.uniform(0.01, 100) for i in range(4)}
    gs["zero"] = np.zeros(r.size)
    w = np.zeros(r.size, np.float32)
    out = s.aggregate(1, w, incs(gs))
    expected = np.mean([ref_v14(g, r, 0.25) for g in gs.values()], axis=0)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-6)
    lam = s.round_metrics()["lambda"]
    assert lam["zero"] == pytest.approx(0.25)  # cos := 0 -> lambda = c, v = c r
    for k, g in gs.items():
        assert lam[k] == pytest.approx(ref_lambda(g, r, 0.25), abs=1e-6)


@pytest.mark.parametrize("c", [0.1, 0.25, 0.4])
def test_br_reversed_update_maps_to_4c_minus_1_times_r(c: float) -> None:
    s = make_br(c=c)
    w = initial_weights()
    r = s.reference(1, w).astype(np.float64)
    out = s.aggregate(1, w, incs({"m": -5.0 * r}))
    np.testing.assert_allclose(out - w, (4 * c - 1) * r, atol=1e-6)


def test_br_scaled_attacker_is_bounded_by_root_reference() -> None:
    """An attacker uploading p = -3 times an honest increment moves the model by at most |r| (eq. 14)."""
    s = make_br(c=0.1)
    w = initial_weights()
    root = s.ctx.root
    assert root is not None
    r = s.reference(1, w).astype(np.float64)
    # an honest increment: 3 SGD steps on different data from the same model
    other = root_data(12, seed=9)
    honest = manual_root_reference(w, other, TrainSettings(3, 0.5, 12), [np.arange(12)] * 3)
    attack = -3.0 * honest
    assert np.linalg.norm(attack) > 2 * np.linalg.norm(r)  # unbounded, the attack would dominate
    out = s.aggregate(1, w, incs({"attacker": attack}))
    step = out.astype(np.float64) - w
    assert np.linalg.norm(step) <= np.linalg.norm(r) * (1 + 1e-5)
    np.testing.assert_allclose(step, ref_v14(attack, r, 0.1), atol=1e-6)
    # with an honest client beside it the aggregate is the mean of the two eq.-14 vectors
    out = s.aggregate(1, w, incs({"attacker": attack, "honest": honest}))
    expected = (ref_v14(attack, r, 0.1) + ref_v14(honest, r, 0.1)) / 2
    np.testing.assert_allclose(out.astype(np.float64) - w, expected, atol=1e-6)
    assert np.linalg.norm(out.astype(np.float64) - w) <= np.linalg.norm(r) * (1 + 1e-5)
