"""TACO (ALGORITHMS.md 2.7): eq. 7 alphas, eq. 9 aggregation, eq. 10 expulsion, eq. 15 z, the eq. 8 client correction.

Every expected value is computed here from the spec with plain numpy / autograd, never by calling the code under test.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.algorithms.taco import TacoClient
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.loop.runtime import TrainFn
from edge_client.loop.trainer import TrainResult
from edge_client.wire.messages import Assignment, RoundFacts, Update
from edge_client.wire.plan import Plan
from edgefl_testkit import algorithms as kit
from edgefl_testkit import messages
from edgefl_testkit.algorithms import train_assignment
from edgefl_testkit.messages import make_update
from server.experiments.attacks import freeloader
from server.report import summarize
from server.strategies.base import TrainSettings
from server.strategies.taco import Taco, outliers, stabilised_weights, taco_alphas
from server.target import Target

K, LR = 4, 0.1
ETA_G = K * LR


# -- independent reference formulas (from ALGORITHMS.md 2.7, written without the code under test) ---------------------


def ref_alphas(deltas: list[np.ndarray], reference: np.ndarray | None = None) -> np.ndarray:
    """Eq. 7: (1 - |D_i| / sum_j |D_j|) * max(cos(D_i, r), 0), cos := 0 for a zero vector; r = mean_j D_j unless a
    ``reference`` (the previous global update) is given."""
    d = np.stack([np.asarray(x, dtype=np.float64) for x in deltas])
    norms = np.sqrt((d**2).sum(axis=1))
    if norms.sum() == 0:
        return np.zeros(len(d))
    mean = d.mean(axis=0) if reference is None else np.asarray(reference, dtype=np.float64)
    mnorm = np.sqrt((mean**2).sum())
    out = []
    for i in range(len(d)):
        cos = 0.0 if norms[i] < 1e-12 or mnorm < 1e-12 else float(d[i] @ mean) / (norms[i] * mnorm)
        out.append((1.0 - norms[i] / norms.sum()) * max(cos, 0.0))
    return np.array(out)


def ref_aggregate(w: np.ndarray, deltas: list[np.ndarray], alphas: np.ndarray) -> np.ndarray:
    """Eq. 9 with eta_g = K eta_l: w - sum_i alpha_i D_i / sum_j alpha_j; uniform when sum alpha = 0."""
    a = np.asarray(alphas, dtype=np.float64)
    p = a / a.sum() if a.sum() > 1e-12 else np.full(len(a), 1.0 / len(a))
    return w.astype(np.float64) - sum(pi * np.asarray(di, dtype=np.float64) for pi, di in zip(p, deltas, strict=True))


def upd(cid: str, delta: np.ndarray, round_: int = 1) -> Update:
    return make_update(cid, delta, local_steps=K, round=round_, model_version=round_ - 1)


def strategy(clients: tuple[str, ...] = (), **params: object) -> Taco:
    """A TACO server half; eqs. 9 and 10 as printed (``aggregation``, ``detection = "paper"``) unless the test asks
    for the stabilised ones."""
    literal = {"aggregation": "paper", "detection": "paper"}
    return kit.set_up(
        Taco(TrainSettings(local_steps=K, lr=LR, batch_size=4), {**literal, **params}), 0, dict.fromkeys(clients, 10)
    )


# -- eq. 7 ------------------------------------------------------------------------------------------------------------


def test_alphas_match_eq7_on_hand_made_vectors() -> None:
    deltas = [
        np.array([1.0, 0.0, 0.0], np.float32),
        np.array([0.8, 0.6, 0.0], np.float32),
        np.array([2.0, -1.0, 0.5], np.float32),
        np.array([-1.0, 0.1, 0.0], np.float32),  # against the mean: clipped to 0
    ]
    got = taco_alphas(deltas)
    want = ref_alphas(deltas)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got[3] == 0.0 and np.all(got[:3] > 0.1)
    # a by-hand value: norms 1, 1, sqrt(5.25), sqrt(1.01); mean = (2.8, -0.3, 0.5)/4
    norms = [1.0, 1.0, np.sqrt(5.25), np.sqrt(1.01)]
    mean = np.array([2.8, -0.3, 0.5]) / 4
    cos0 = mean[0] / np.linalg.norm(mean)
    assert got[0] == pytest.approx((1 - 1 / sum(norms)) * cos0, rel=1e-6)


def test_alphas_degenerate_cases() -> None:
    v = np.array([1.0, 2.0], np.float32)
    assert taco_alphas([v]).tolist() == [0.0]  # one client: magnitude factor 0
    assert taco_alphas([np.zeros(2, np.float32)] * 3).tolist() == [0.0, 0.0, 0.0]  # all norms 0
    assert taco_alphas([v, -v]).tolist() == [0.0, 0.0]  # zero mean: cosine 0
    zero_and_v = taco_alphas([np.zeros(2, np.float32), v, v])
    assert zero_and_v[0] == 0.0 and zero_and_v[1] == pytest.approx(0.5, rel=1e-6)  # cos 1, |v| / 2|v|
    assert taco_alphas([]).size == 0


def test_alphas_against_the_previous_global_update_on_hand_made_vectors() -> None:
    deltas = [
        np.array([1.0, 0.0, 0.0], np.float32),
        np.array([0.0, 2.0, 0.0], np.float32),
        np.array([-1.0, 0.5, 1.0], np.float32),  # against the reference: clipped to 0
    ]
    previous = np.array([3.0, 3.0, 0.0], np.float32)  # the global update the clients were sent
    got = taco_alphas(deltas, "previous_global", previous)
    np.testing.assert_allclose(got, ref_alphas(deltas, previous), rtol=1e-6)
    total = 1 + 2 + 1.5  # by hand: cos = 1/sqrt(2) for the first two, negative for the third
    np.testing.assert_allclose(got, [(1 - 1 / total) / np.sqrt(2), (1 - 2 / total) / np.sqrt(2), 0.0], rtol=1e-6)
    assert np.abs(got - taco_alphas(deltas)).max() > 0.1  # really another reference than the mean
    assert taco_alphas(deltas, "previous_global", None).tolist() == [0.0, 0.0, 0.0]  # round 0: no reference
    assert taco_alphas(deltas, "previous_global", np.zeros(3, np.float32)).tolist() == [0.0, 0.0, 0.0]
    # a freeloader uploading exactly the previous update: cos 1, alpha = 1 - its share of the norms
    free = taco_alphas([previous, deltas[0]], "previous_global", previous)
    assert free[0] == pytest.approx(1 - np.sqrt(18) / (np.sqrt(18) + 1), rel=1e-6)


def test_previous_global_reading_over_rounds() -> None:
    rng = np.random.default_rng(7)
    w0 = rng.normal(size=5).astype(np.float32)
    s = strategy(alpha_reference="previous_global")
    with pytest.raises(ValueError, match="alpha_reference"):
        strategy(alpha_reference="global")
    first = [rng.normal(size=5).astype(np.float32) + 1 for _ in range(3)]
    w1 = s.aggregate(1, w0, [upd(f"c{i}", d) for i, d in enumerate(first)])
    np.testing.assert_allclose(w1, w0 - np.mean(first, axis=0), rtol=1e-5)  # no reference: alphas 0, uniform
    assert s.round_metrics()["alpha"] == {"c0": 0.0, "c1": 0.0, "c2": 0.0}
    second = [rng.normal(size=5).astype(np.float32) + 1 for _ in range(3)]
    w2 = s.aggregate(2, w1, [upd(f"c{i}", d, 2) for i, d in enumerate(second)])
    alphas = ref_alphas(second, w0 - w1)
    assert np.abs(alphas - ref_alphas(second)).max() > 1e-3
    np.testing.assert_allclose([s.alpha[f"c{i}"] for i in range(3)], alphas, rtol=1e-5)
    np.testing.assert_allclose(w2, ref_aggregate(w1, second, alphas), rtol=1e-5, atol=1e-6)
    restored = strategy(alpha_reference="previous_global")
    restored.load_state_dict(s.state_dict())
    ups = [upd(f"c{i}", d, 3) for i, d in enumerate(first)]
    np.testing.assert_array_equal(restored.aggregate(3, w2, ups), s.aggregate(3, w2, ups))


# -- Table VI's ablation switches -------------------------------------------------------------------------------------


def test_without_tailored_aggregation_the_average_is_uniform_and_alphas_still_count() -> None:
    w = np.zeros(3, np.float32)
    f = np.array([1.0, 1.0, 0.0], np.float32)
    h = np.array([0.5, -0.5, 1.0], np.float32)
    alphas = ref_alphas([f, f, h])
    assert alphas[0] >= 0.5 > alphas[2]
    s = strategy(kappa=0.5, lambda_expel=1, tailored_aggregation=False)
    new = s.aggregate(1, w, [upd("f1", f), upd("f2", f), upd("h", h)])
    np.testing.assert_allclose(new, w - (2 * f + h) / 3, rtol=1e-6)  # eq. 6 with p_i = 1/N, not eq. 9
    assert s.alpha["h"] == pytest.approx(alphas[2], rel=1e-6) and s.strikes == {"f1": 1, "f2": 1}
    s.aggregate(2, w, [upd("f1", f, 2), upd("f2", f, 2), upd("h", h, 2)])
    assert s.excluded() == {"f1", "f2"}  # over lambda = 1 strikes


def test_without_tailored_correction_clients_run_plain_sgd(caplog: pytest.LogCaptureFixture) -> None:
    s = strategy(tailored_correction=False)
    w0 = np.zeros(8, np.float32)
    s.assign(1, "a")
    d = np.linspace(-1, 1, 8).astype(np.float32)
    s.aggregate(1, w0, [upd("a", d), upd("b", -d / 2)])
    for c in ("a", "late"):
        told = s.assign(2, c)
        assert told.settings["tailored_correction"] is False and "global_delta" not in told.arrays
    on = strategy().assign(2, "late")
    assert on.settings["tailored_correction"] is True
    off = {"tailored_correction": False}
    client = TacoClient()
    run(client, assignment(W_PREV, 0, params=off))
    with caplog.at_level(logging.WARNING, logger="edgefl.client"):
        got = run(client, assignment(W_CUR, 1, params=off))
        fresh = run(TacoClient(), assignment(W_CUR, 5, params=off))  # nothing to derive from: no warning
    plain = run(FedAvgClient(), assignment(W_CUR, 1))
    np.testing.assert_allclose(got, plain, atol=1e-7)
    np.testing.assert_allclose(fresh, plain, atol=1e-7)
    assert np.abs(run(TacoClient(), assignment(W_CUR, 1, arrays={"global_delta": W_CUR})) - plain).max() > 1e-4
    assert "no correction" not in caplog.text


# -- eq. 9 and the per-client alpha on the wire -----------------------------------------------------------------------


def test_aggregation_is_alpha_weighted_and_alpha_travels_next_round() -> None:
    rng = np.random.default_rng(3)
    w = rng.normal(size=6).astype(np.float32)
    base = rng.normal(size=6)
    deltas = [(base + rng.normal(scale=0.7, size=6)).astype(np.float32) for _ in range(4)]
    s = strategy()
    first = s.assign(1, "c0")
    assert first.settings["alpha_i"] == pytest.approx(0.1)  # alpha_i^0
    # gamma = 0 means 1/K, which the device takes from its plan (eta_g = K eta_l likewise)
    assert first.settings == {
        "gamma": 0.0,
        "correction": "accumulated",
        "tailored_correction": True,
        "alpha_i": first.settings["alpha_i"],
    } and s.gamma == pytest.approx(1 / K)
    assert "global_delta" not in first.arrays  # Delta_0 = 0

    new = s.aggregate(1, w, [upd(f"c{i}", d) for i, d in enumerate(deltas)])
    alphas = ref_alphas(deltas)
    assert not np.allclose(alphas / alphas.sum(), 0.25)  # the weights are really not uniform
    np.testing.assert_allclose(new, ref_aggregate(w, deltas, alphas), rtol=1e-5, atol=1e-6)
    uniform = w - np.mean(deltas, axis=0)
    assert np.abs(new - uniform).max() > 1e-3
    for i in range(4):
        assert s.assign(2, f"c{i}").settings["alpha_i"] == pytest.approx(alphas[i], rel=1e-6)
    metrics = s.round_metrics()
    assert set(metrics) == {"alpha", "smoothed_alpha", "strikes", "expelled"}
    assert metrics["alpha"]["c2"] == pytest.approx(alphas[2], rel=1e-6)


def two_clusters(s: Taco, rounds: int) -> tuple[list[float], list[float]]:
    """Rounds of two label clusters, three clients whose optimum is x = +1 and two at x = -1: each upload is 0.9 of
    the way from the model to its own optimum (D_i = 0.9 (w - w_i*)). The model's x and client a0's alpha per round."""
    optima = {"a0": (1.0, 0.2), "a1": (1.0, -0.2), "a2": (1.0, 0.0), "b0": (-1.0, 0.1), "b1": (-1.0, -0.1)}
    w, xs, alphas = np.zeros(2, np.float32), [], []
    for r in range(1, rounds + 1):
        w = s.aggregate(r, w, [upd(c, 0.9 * (w - np.array(o, np.float32)), r) for c, o in optima.items()])
        xs.append(float(w[0]))
        alphas.append(s.alpha["a0"])
    return xs, alphas


def test_two_clusters_literal_eq9_alternates_and_the_stabilised_one_does_not() -> None:
    """Eq. 9 as printed gives weight only to the clients agreeing with the round's mean: the model jumps to one
    cluster's optimum, the next round the other cluster's uploads dominate the mean and it jumps back, and every
    alpha alternates between 0 and about 0.6-0.7. The stabilised weights (the defaults) keep both clusters in every
    round: the model settles between them, on the majority's side."""
    xs, alphas = two_clusters(strategy(aggregation="paper"), 12)
    assert all(abs(x) > 0.8 for x in xs)  # overshoot to one optimum or the other
    assert all(a * b < 0 for a, b in itertools.pairwise(xs))  # ... alternating every round
    assert alphas[0::2] == pytest.approx([alphas[0]] * 6, abs=0.1) and min(alphas[0::2]) > 0.6
    assert max(alphas[1::2]) == 0.0
    stab = strategy(aggregation="stabilised")
    xs, _ = two_clusters(stab, 12)
    swings = [abs(b - a) for a, b in itertools.pairwise(xs[4:])]
    assert max(swings) < 0.3 and all(0.0 < x < 0.5 for x in xs[4:])  # between the optima (the 3:2 mean is 0.2)
    weights = stabilised_weights(np.array([stab.smoothed[c] for c in ("a0", "a1", "a2", "b0", "b1")]), 0.5)
    assert weights.sum() == pytest.approx(1.0) and weights.min() >= 0.1  # at least the uniform share of 1/5


def test_stabilised_weights_on_hand_made_alphas() -> None:
    """EMA of the alphas across rounds, then (1 - u) of eq. 9's shares plus u / n each."""
    s = strategy(aggregation="stabilised", alpha_smoothing=0.5, uniform_share=0.5)
    w = np.zeros(2, np.float32)
    a, b = np.array([1.0, 0.0], np.float32), np.array([1.0, 1.0], np.float32)
    s.aggregate(1, w, [upd("a", a), upd("b", b)])
    r1 = ref_alphas([a, b])
    assert s.smoothed == pytest.approx({"a": r1[0], "b": r1[1]})  # the first alpha starts the average
    c = np.array([0.0, 1.0], np.float32)
    new = s.aggregate(2, w, [upd("a", a, 2), upd("b", c, 2)])
    r2 = ref_alphas([a, c])  # orthogonal uploads of equal norm: cos to the mean 0.707, share 1/2 -> 0.354 each
    assert r2 == pytest.approx([0.5 / np.sqrt(2)] * 2)
    sm = {"a": 0.5 * r1[0] + 0.5 * r2[0], "b": 0.5 * r1[1] + 0.5 * r2[1]}
    assert s.smoothed == pytest.approx(sm)
    p = 0.5 * np.array([sm["a"], sm["b"]]) / (sm["a"] + sm["b"]) + 0.25
    np.testing.assert_allclose(new, w - (p[0] * a + p[1] * c), rtol=1e-5)
    np.testing.assert_allclose(stabilised_weights(np.array([0.0, 0.0]), 0.3), [0.5, 0.5])  # no alpha: uniform
    np.testing.assert_allclose(stabilised_weights(np.array([0.6, 0.2]), 0.2), [0.7, 0.3])  # 0.8*0.75+0.1 ...


def test_aggregation_falls_back_to_uniform_when_every_alpha_is_zero() -> None:
    w = np.array([1.0, 1.0, 1.0], np.float32)
    d1 = np.array([1.0, 2.0, 0.0], np.float32)
    s = strategy()
    new = s.aggregate(1, w, [upd("a", d1), upd("b", -d1), upd("c", np.zeros(3, np.float32))])  # mean 0 -> alphas 0
    np.testing.assert_allclose(new, w, atol=1e-7)  # uniform mean of (d1, -d1, 0) = 0
    one = strategy().aggregate(1, w, [upd("a", d1)])  # a single client: alpha 0, uniform = FedAvg
    np.testing.assert_allclose(one, w - d1, atol=1e-7)


def test_gamma_and_lambda_keys() -> None:
    assert strategy(gamma=0.3).assign(1, "c").settings["gamma"] == pytest.approx(0.3)
    assert strategy(rounds=50).lambda_expel == 10  # T/5
    assert strategy(rounds=3).lambda_expel == 1  # at least 1
    assert strategy(rounds=50, lambda_expel=4).lambda_expel == 4
    with pytest.raises(
        ContractError, match=r"taco.correction = 'bogus': expected one of 'accumulated', 'per_step', 'model_diff'"
    ):
        strategy(correction="bogus")
    with pytest.raises(ContractError, match=r"taco.aggregation = 'bogus': expected one of 'stabilised', 'paper'"):
        strategy(aggregation="bogus")


def test_without_rounds_or_lambda_nobody_is_expelled_and_it_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="edgefl.server"):
        s = strategy(kappa=0.4)
    assert "rounds" in caplog.text
    v = np.array([1.0, 0.0], np.float32)
    for r in range(1, 6):  # two identical uploads: alpha = 0.5 each >= kappa 0.4
        s.aggregate(r, np.zeros(2, np.float32), [upd("a", v, r), upd("b", v, r)])
    assert s.strikes == {"a": 5, "b": 5} and s.excluded() == set()


# -- eq. 10: strikes and expulsion ------------------------------------------------------------------------------------


def test_expelled_after_over_lambda_strikes_not_before(caplog: pytest.LogCaptureFixture) -> None:
    """The prose's "expel clients satisfying Eq. (10) over lambda times": lambda = 3 strikes stay, the 4th expels."""
    v = np.array([1.0, 0.0], np.float32)
    other = np.array([0.0, 1.0], np.float32)
    s = strategy(kappa=0.4, lambda_expel=3)
    w = np.zeros(2, np.float32)
    for r in (1, 2, 3):
        s.aggregate(r, w, [upd("a", v, r), upd("b", v, r)])  # alpha 0.5 >= 0.4: a strike each
        assert s.excluded() == set()
    s.aggregate(4, w, [upd("a", v, 4), upd("c", other, 4)])  # cos(v, (v+other)/2) = 0.707 -> 0.354 < 0.4
    assert s.strikes == {"a": 3, "b": 3} and s.excluded() == set()  # lambda strikes: not yet
    with caplog.at_level(logging.WARNING, logger="edgefl.server"):
        s.aggregate(5, w, [upd("a", v, 5), upd("b", v, 5)])
    assert s.excluded() == {"a", "b"} and s.round_metrics()["expelled"] == ["a", "b"]
    assert "a" in caplog.text and "4 strikes" in caplog.text and "0.5000" in caplog.text


def test_drop_on_expel_round() -> None:
    w = np.zeros(3, np.float32)
    f = np.array([1.0, 1.0, 0.0], np.float32)
    h = np.array([0.5, -0.5, 1.0], np.float32)
    ups = [upd("f1", f, 2), upd("f2", f, 2), upd("h", h, 2)]
    alphas = ref_alphas([f, f, h])
    assert alphas[0] >= 0.5 > alphas[2]
    s, d = strategy(kappa=0.5, lambda_expel=1), strategy(kappa=0.5, lambda_expel=1, drop_on_expel_round=True)
    for x in (s, d):
        x.aggregate(1, w, [replace(u, round=1) for u in ups])  # the first strike each
    kept = s.aggregate(2, w, ups)  # default: the expulsion round's update still counts
    assert s.excluded() == {"f1", "f2"}
    np.testing.assert_allclose(kept, ref_aggregate(w, [f, f, h], alphas), rtol=1e-5)
    dropped = d.aggregate(2, w, ups)
    assert d.excluded() == {"f1", "f2"}
    np.testing.assert_allclose(dropped, w - h, rtol=1e-6)


def test_expulsion_never_leaves_the_federation_empty(caplog: pytest.LogCaptureFixture) -> None:
    v = np.array([1.0, 0.0], np.float32)
    s = strategy(("a", "b"), kappa=0.4, lambda_expel=1)
    s.aggregate(1, np.zeros(2, np.float32), [upd("a", v), upd("b", v)])
    with caplog.at_level(logging.WARNING, logger="edgefl.server"):
        s.aggregate(2, np.zeros(2, np.float32), [upd("a", v, 2), upd("b", v, 2)])  # both over lambda: both would go
    assert s.excluded() == set() and s.strikes == {"a": 2, "b": 2}
    assert "would leave no client" in caplog.text
    s.ctx.clients["c"] = 10  # a third client registers: now they can go
    s.aggregate(3, np.zeros(2, np.float32), [upd("a", v, 3), upd("b", v, 3)])
    assert s.excluded() == {"a", "b"} and s.strikes == {"a": 3, "b": 3}


def test_outlier_test_on_hand_made_alphas() -> None:
    """Stabilised detection: alpha >= kappa, above the widest gap (>= strike_gap) of the sorted alphas, a minority."""
    got = outliers(np.array([0.84, 0.8, 0.3, 0.25, 0.45]), 0.6, 0.2)  # widest gap 0.45 -> 0.8 (0.35): two above
    assert got.tolist() == [True, True, False, False, False]
    assert not outliers(np.array([0.84, 0.8, 0.3, 0.25, 0.65]), 0.6, 0.2).any()  # widest gap 0.3 -> 0.65: 3 of 5
    assert not outliers(np.array([0.66, 0.7, 0.8, 0.75, 0.9]), 0.6, 0.2).any()  # all high (two-class data): no gap
    assert not outliers(np.array([0.5, 0.1, 0.1, 0.1]), 0.6, 0.2).any()  # apart, but below kappa
    assert outliers(np.array([0.9, 0.1, 0.1, 0.1]), 0.6, 0.2).tolist() == [True, False, False, False]
    assert outliers(np.zeros(0), 0.6, 0.2).size == 0 and not outliers(np.array([0.9]), 0.6, 0.2).any()


def test_stabilised_detection_strikes_outliers_not_a_federation_of_similar_clients() -> None:
    """Six honest clients with similar uploads all have alpha ~0.8 >= kappa: eq. 10 strikes every one of them
    every round (what expelled 18-19 of 20 honest Adult clients); the stabilised test strikes nobody. Two uploads
    far more aligned with the mean than the rest are struck by both, and expelled over lambda = 2 strikes."""
    rng = np.random.default_rng(2)
    base = rng.normal(size=50)
    similar = {f"h{i}": (base + rng.normal(scale=0.3, size=50)).astype(np.float32) for i in range(6)}
    w = np.zeros(50, np.float32)
    paper, stab = strategy(kappa=0.6, lambda_expel=5), strategy(kappa=0.6, lambda_expel=5, detection="stabilised")
    for r in (1, 2):
        for x in (paper, stab):
            x.aggregate(r, w, [upd(c, d, r) for c, d in similar.items()])
    assert min(paper.alpha.values()) >= 0.6 and paper.strikes == dict.fromkeys(similar, 2)
    assert stab.strikes == {}
    # eight honest clients in orthogonal directions, two uploads along their sum (the mean's direction, as a
    # freeloader's is): by hand alpha 0.79 for those two, 0.33 for the honest ones (a gap of 0.46)
    e = np.eye(8, dtype=np.float32)
    ups = {"f1": e.sum(axis=0), "f2": e.sum(axis=0), **{f"h{i}": e[i] for i in range(8)}}
    ref = ref_alphas(list(ups.values()))
    assert ref[0] == pytest.approx(1 - np.sqrt(8) / (2 * np.sqrt(8) + 8), rel=1e-6)
    assert ref[0] >= 0.6 and ref[0] - max(ref[2:]) >= 0.2 and max(ref[2:]) < 0.6
    s = strategy(tuple(ups), kappa=0.6, lambda_expel=2, detection="stabilised")
    for r in (1, 2, 3):
        s.aggregate(r, np.zeros(8, np.float32), [upd(c, d, r) for c, d in ups.items()])
    assert s.strikes == {"f1": 3, "f2": 3} and s.excluded() == {"f1", "f2"}


def freeload(train: TrainFn, weights: np.ndarray) -> TrainResult:
    """One round of a freeloading client given ``weights``, on a model it never touches."""
    flat, data = tiny()
    before = flat.numpy().copy()
    result = train(flat, weights, data, BatchSampler(len(data), 4, 0, "f"), Plan(K, LR, 4), TacoClient(), RoundFacts())
    np.testing.assert_array_equal(flat.numpy(), before)  # no training at all
    assert result.local_steps == K  # claims the steps it was told
    return result


def test_freeloader_behaviour_uploads_the_previous_global_update() -> None:
    rng = np.random.default_rng(0)
    w0, w1, w2 = (rng.normal(size=7).astype(np.float32) for _ in range(3))
    b = freeloader()
    assert np.array_equal(freeload(b, w0).delta, np.zeros(7, np.float32))  # first round: zeros
    assert np.array_equal(freeload(b, w1).delta, w0 - w1)
    assert np.array_equal(freeload(b, w2).delta, w1 - w2)


def test_two_freeloaders_of_five_are_expelled_after_two_strikes_honest_ones_stay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = 400
    rng = np.random.default_rng(0)
    s = strategy(kappa=0.6, lambda_expel=1)  # expelled over 1 strike: at the second
    freeloaders = {"f0": freeloader(), "f1": freeloader()}
    honest = ["h0", "h1", "h2"]
    w = rng.normal(size=d).astype(np.float32)
    direction = rng.normal(size=d) * 0.1  # round 1's common descent direction
    last_w = w
    for r in (1, 2, 3, 4):
        active = [c for c in [*freeloaders, *honest] if c not in s.excluded()]
        deltas: dict[str, np.ndarray] = {}
        for c in active:
            if c in freeloaders:
                deltas[c] = freeload(freeloaders[c], w).delta
            else:  # honest-looking: part of the last global direction plus a large client-specific component
                scale = 1.5 * np.linalg.norm(direction) / np.sqrt(d)
                base = direction if r == 1 else 0.5 * direction
                deltas[c] = (base + rng.normal(scale=scale, size=d)).astype(np.float32)
        if r > 1:
            for c in freeloaders:
                if c in deltas:
                    np.testing.assert_array_equal(deltas[c], last_w - w)
        alphas = ref_alphas([deltas[c] for c in active])
        expected = ref_aggregate(w, [deltas[c] for c in active], alphas)
        with caplog.at_level(logging.WARNING, logger="edgefl.server"):
            new = s.aggregate(r, w, [upd(c, deltas[c], r) for c in active])
        np.testing.assert_allclose(new, expected, rtol=1e-4, atol=1e-6)  # round 3 still aggregates the freeloaders
        got = s.round_metrics()["alpha"]
        for c, a in zip(active, alphas, strict=True):
            assert got[c] == pytest.approx(a, rel=1e-5, abs=1e-7)
        if r == 1:
            assert got["f0"] == got["f1"] == 0.0  # zero uploads in the first round
        else:
            assert all(got[c] < 0.6 for c in honest)
        if r in (2, 3):
            assert got["f0"] >= 0.6 and got["f1"] >= 0.6
        if r == 2:
            assert s.excluded() == set() and s.strikes == {"f0": 1, "f1": 1}
        if r == 3:
            assert s.excluded() == {"f0", "f1"} and s.strikes == {"f0": 2, "f1": 2}
        if r == 4:
            assert active == honest and set(got) == {"f0", "f1", *honest}
        last_w, direction, w = w, (w - new).astype(np.float64), new
    assert s.excluded() == {"f0", "f1"} and not any(c in s.strikes for c in honest)
    assert "f0" in caplog.text and "f1" in caplog.text and "2 strikes" in caplog.text


# -- eq. 15 -----------------------------------------------------------------------------------------------------------


def test_z_is_eq15_with_the_mean_alpha_of_active_clients() -> None:
    w0 = np.array([0.5, -1.0, 2.0], np.float32)
    s = strategy(kappa=0.4, lambda_expel=1)
    np.testing.assert_array_equal(s.outputs(w0)["z"], w0)  # before any aggregation: z_0 = w_0
    a = np.array([1.0, 0.2, 0.0], np.float32)
    b = np.array([0.9, 0.0, 0.1], np.float32)
    c = np.array([0.1, 1.0, -0.5], np.float32)
    w0 = s.aggregate(1, w0, [upd("a", a), upd("b", b), upd("c", c)])  # the first strikes
    w1 = s.aggregate(2, w0, [upd("a", a, 2), upd("b", b, 2), upd("c", c, 2)])  # over lambda = 1: expelled
    alphas = ref_alphas([a, b, c])
    expelled = [i for i, x in enumerate(alphas) if x >= 0.4]
    assert expelled and len(expelled) < 3  # some but not all are expelled: the mean must skip them
    active = [x for i, x in enumerate(alphas) if i not in expelled]
    z = w1.astype(np.float64) + (1 - np.mean(active)) * (w1.astype(np.float64) - w0)
    np.testing.assert_allclose(s.outputs(w1)["z"], z, rtol=1e-5, atol=1e-6)
    assert strategy(output="w").outputs(w0) == {}


# -- the server's global delta for clients that cannot derive it ------------------------------------------------------


def test_global_delta_goes_to_clients_that_missed_the_previous_model() -> None:
    w0 = np.zeros(3, np.float32)
    s = strategy()
    for c in ("a", "b"):
        assert "global_delta" not in s.assign(1, c).arrays
    d = np.array([0.4, -0.2, 0.1], np.float32)
    w1 = s.aggregate(1, w0, [upd("a", d), upd("b", d)])
    assert "global_delta" not in s.assign(2, "a").arrays  # "a" received version 0: derives it
    late = s.assign(2, "late").arrays["global_delta"]  # joined late: no previous model
    np.testing.assert_allclose(late, w0 - w1, rtol=1e-6)  # the model step; the device scales it
    # "b" was not sent version 1; in round 3 (version 2) it gets the array, "a" does not
    w2 = s.aggregate(2, w1, [upd("a", d, 2)])
    assert "global_delta" not in s.assign(3, "a").arrays
    np.testing.assert_allclose(s.assign(3, "b").arrays["global_delta"], w1 - w2, rtol=1e-6)
    # a round without aggregation: version unchanged, so the next assignments carry the array
    assert "global_delta" in s.assign(4, "a").arrays
    # send_global_delta: always
    s2 = strategy(send_global_delta=True)
    s2.assign(1, "a")
    s2.aggregate(1, w0, [upd("a", d)])
    np.testing.assert_allclose(s2.assign(2, "a").arrays["global_delta"], d, rtol=1e-6)


def test_server_state_round_trip_through_json() -> None:
    rng = np.random.default_rng(5)
    w = rng.normal(size=5).astype(np.float32)
    s = strategy(kappa=0.3, lambda_expel=2, aggregation="stabilised")
    for c in "abc":
        s.assign(1, c)
    ups = [upd(c, rng.normal(size=5) + 1.0) for c in "abc"]
    w1 = s.aggregate(1, w, ups)
    restored = strategy(kappa=0.3, lambda_expel=2, aggregation="stabilised")
    restored.load_state_dict(s.state_dict())
    assert restored.round_metrics() == s.round_metrics()
    np.testing.assert_array_equal(restored.outputs(w1)["z"], s.outputs(w1)["z"])
    for c in ("a", "new"):
        i1, i2 = s.assign(2, c), restored.assign(2, c)
        assert i1.settings["alpha_i"] == i2.settings["alpha_i"] and i1.settings == i2.settings
        assert sorted(i1.arrays) == sorted(i2.arrays)
    ups2 = [upd(c, rng.normal(size=5) + 1.0, 2) for c in "abc"]
    np.testing.assert_array_equal(restored.aggregate(2, w1, ups2), s.aggregate(2, w1, ups2))
    assert restored.strikes == s.strikes and restored.excluded() == s.excluded()


# -- the client half (eq. 8) ------------------------------------------------------------------------------------------


def assignment(
    weights: np.ndarray,
    version: int,
    alpha: float | None = 0.2,
    params: dict[str, object] | None = None,
    arrays: dict[str, np.ndarray] | None = None,
) -> Assignment:
    settings = {"gamma": 0.5, "correction": "per_step", "tailored_correction": True, **(params or {})}
    if alpha is not None:
        settings["alpha_i"] = alpha
    weights = np.asarray(weights, dtype=np.float32)
    facts = {"round": version + 1, "model_version": version, "algorithm": "taco"}
    return messages.assignment(weights, K, LR, settings=settings, arrays=arrays or {}, **facts)


def tiny() -> tuple[FlatModel, ArrayDataset]:
    return FlatModel(kit.toy_model()), kit.toy_data(16, seed=1)


def run(algorithm: ClientAlgorithm, a: Assignment) -> np.ndarray:
    if type(algorithm) is FedAvgClient:  # the same round without TACO's part of the assignment
        a = Assignment(replace(a.plan, settings={}, arrays={}), a.facts)
    return kit.train_toy(algorithm, a, kit.toy_data(16, seed=1)).delta


def manual(w: np.ndarray, corr: np.ndarray) -> np.ndarray:
    """K autograd SGD steps on the Linear(3, 2) cross-entropy with ``corr`` added to every gradient (eq. 8)."""
    _, data = tiny()
    c = torch.from_numpy(np.asarray(corr, dtype=np.float32))
    return w - kit.reference_sgd(w, data, BatchSampler(len(data), 4, 0, "c0"), K, LR, lambda _: c)


W_PREV = np.array([0.3, -0.2, 0.1, 0.5, 0.0, -0.4, 0.2, 0.1], np.float32)
W_CUR = np.array([0.1, 0.2, -0.3, 0.4, 0.3, -0.1, -0.2, 0.3], np.float32)


def test_client_correction_is_eq8_with_a_sent_global_delta() -> None:
    gd = np.array([1.0, -2.0, 0.5, 0.0, 1.5, -1.0, 0.25, 2.0], np.float32)
    a = assignment(W_CUR, 3, alpha=0.2, arrays={"global_delta": gd})
    got = run(TacoClient(), a)
    want = manual(W_CUR, 0.5 * (1 - 0.2) * gd / ETA_G)  # the array is w_{t-1} - w_t; per step: / (K eta_l)
    np.testing.assert_allclose(got, want, atol=1e-5)
    plain = run(FedAvgClient(), a)
    assert np.abs(got - plain).max() > 1e-2  # the correction matters at this size
    # gamma = 0: 1/K with K the plan's steps (the paper's experiments, 2.7 (f)10)
    got = run(TacoClient(), assignment(W_CUR, 3, alpha=0.2, params={"gamma": 0.0}, arrays={"global_delta": gd}))
    np.testing.assert_allclose(got, manual(W_CUR, (1 / K) * (1 - 0.2) * gd / ETA_G), atol=1e-5)
    with pytest.raises(ContractError, match=r"taco.alpha_i: missing from the assignment"):
        run(TacoClient(), assignment(W_CUR, 3, alpha=None))
    for bad in ("0.5", 1.5, -0.1, float("nan")):  # a per-round value of the contract, bounded like FedVeca's P
        with pytest.raises(ContractError, match=r"taco.alpha_i = .*: expected a finite number \[0, 1\]"):
            run(TacoClient(), assignment(W_CUR, 3, alpha=bad))  # type: ignore[arg-type]


def test_accumulated_correction_on_hand_made_vectors() -> None:
    """The default reading: Delta_t = (w_{t-1} - w_t) / eta_l, so with gamma = 1/K each of the K steps adds
    (1/K)(1 - alpha_i)(w_{t-1} - w_t) / eta_l to the gradient, and the round's K steps of size eta_l move the model by
    (1 - alpha_i)(w_{t-1} - w_t) beyond the gradients' own steps: Lemma 1's momentum."""
    step = np.array([0.2, -0.4, 0.4, 0.1, -0.3, -0.3, 0.4, -0.2], np.float32)  # W_PREV - W_CUR
    np.testing.assert_allclose(W_PREV - W_CUR, step, atol=1e-7)
    acc = {"gamma": 0.0, "correction": "accumulated"}
    client = TacoClient()
    flat, data = tiny()
    a = assignment(W_CUR, 3, alpha=0.2, params=acc, arrays={"global_delta": step})
    train_assignment(flat, data, BatchSampler(len(data), 4, 0, "c0"), a, client)
    # by hand: gamma = 1/K = 0.25, 1 - alpha = 0.8, eta_l = 0.1 -> corr = 0.25 * 0.8 / 0.1 * step = 2 * step
    hand = np.array([0.4, -0.8, 0.8, 0.2, -0.6, -0.6, 0.8, -0.4], np.float32)
    np.testing.assert_allclose(run(TacoClient(), a), manual(W_CUR, hand), atol=1e-5)
    # K steps of eta_l * corr = 4 * 0.1 * 2 * step = 0.8 * step: the whole (1 - alpha) momentum, K times per_step's
    per_step = run(TacoClient(), assignment(W_CUR, 3, alpha=0.2, params={**acc, "correction": "per_step"},
                                            arrays={"global_delta": step}))  # fmt: skip
    plain = run(FedAvgClient(), a)
    np.testing.assert_allclose(run(TacoClient(), a) - plain, 0.8 * step, atol=0.05)  # nearly linear at this lr
    np.testing.assert_allclose(per_step - plain, 0.8 * step / K, atol=0.02)
    # derived from consecutive models, the same
    deriving = TacoClient()
    run(deriving, assignment(W_PREV, 2, params=acc))
    np.testing.assert_allclose(run(deriving, assignment(W_CUR, 3, alpha=0.2, params=acc)), run(TacoClient(), a),
                               atol=1e-6)  # fmt: skip


def test_client_derives_delta_from_consecutive_models() -> None:
    client = TacoClient()
    first = run(client, assignment(W_PREV, 0))  # version 0: Delta_0 = 0, no correction
    np.testing.assert_allclose(first, run(FedAvgClient(), assignment(W_PREV, 0)), atol=1e-7)
    got = run(client, assignment(W_CUR, 1, alpha=0.2))  # version 1: Delta_1 = (w_0 - w_1) / eta_g
    want = manual(W_CUR, 0.5 * (1 - 0.2) * (W_PREV - W_CUR) / ETA_G)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(got - run(FedAvgClient(), assignment(W_CUR, 1))).max() > 1e-2

    # model_diff scale: the term uses w_{t-1} - w_t itself
    c2 = TacoClient()
    run(c2, assignment(W_PREV, 0))
    got2 = run(c2, assignment(W_CUR, 1, params={"correction": "model_diff"}))
    np.testing.assert_allclose(got2, manual(W_CUR, 0.5 * 0.8 * (W_PREV - W_CUR)), atol=1e-5)


def test_client_without_the_preceding_model_skips_the_correction(caplog: pytest.LogCaptureFixture) -> None:
    client = TacoClient()
    run(client, assignment(W_PREV, 1))
    with caplog.at_level(logging.WARNING, logger="edgefl.client"):
        got = run(client, assignment(W_CUR, 3))  # stored version 1, now 3: not derivable
    np.testing.assert_allclose(got, run(FedAvgClient(), assignment(W_CUR, 3)), atol=1e-7)
    assert "no correction" in caplog.text
    fresh = run(TacoClient(), assignment(W_CUR, 2))  # nothing stored (joined late, no array)
    np.testing.assert_allclose(fresh, run(FedAvgClient(), assignment(W_CUR, 2)), atol=1e-7)


def test_client_state_round_trip_keeps_the_previous_model(tmp_path) -> None:
    client = TacoClient()
    assert client.state_dict() == {}
    run(client, assignment(W_PREV, 4))
    path = tmp_path / "taco.npz"
    np.savez(path, **client.state_dict())  # as the runtime saves it
    restored = TacoClient()
    with np.load(path) as saved:
        restored.load_state_dict({k: saved[k] for k in saved.files})
    assert restored.prev_version == 4
    np.testing.assert_array_equal(restored.prev_weights, W_PREV)
    got = run(restored, assignment(W_CUR, 5))
    np.testing.assert_allclose(got, manual(W_CUR, 0.5 * 0.8 * (W_PREV - W_CUR) / ETA_G), atol=1e-5)


def test_server_and_client_agree_on_delta_over_rounds() -> None:
    """In-process rounds: a client that derives Delta_t trains exactly like one that is sent it."""
    s = strategy(gamma=0.5)
    deriving, told = TacoClient(), TacoClient()
    w = W_PREV.copy()
    for r in (1, 2, 3):
        version = r - 1
        plan = s.assign(r, "a")
        plan.weights = w
        a = Assignment(plan, RoundFacts(round=r, model_version=version, algorithm="taco"))
        forced = dict(plan.arrays)
        if s.last_step is not None:
            forced["global_delta"] = s.last_step
        b = Assignment(replace(plan, arrays=forced), a.facts)
        da, db = run(deriving, a), run(told, b)
        np.testing.assert_allclose(da, db, atol=1e-5)
        other = (da + np.float32(0.3)).astype(np.float32)
        w = s.aggregate(r, w, [upd("a", da, r), upd("b", other, r)])


def test_summary_reports_z_T_beside_w_T() -> None:
    """Alg. 2 outputs z_T (eq. 15); the paper's tables report w_T: the summary gives both final accuracies."""
    rows = [
        {"round": 1, "accuracy": 0.5, "accuracy_z": 0.55, "loss": 1.0, "elapsed_s": 1.0, "slowest_compute_s": 1.0},
        {"round": 2, "accuracy": 0.7, "accuracy_z": 0.65, "loss": 0.8, "elapsed_s": 2.0, "slowest_compute_s": 1.0},
    ]
    summary = summarize(rows, Target.accuracy(0.9))
    assert summary["final_accuracy"] == 0.7 and summary["final_accuracy_z"] == 0.65
    assert "final_accuracy_z" not in summarize([{k: v for k, v in r.items() if k != "accuracy_z"} for r in rows],
                                               Target.accuracy(0.9))  # fmt: skip
