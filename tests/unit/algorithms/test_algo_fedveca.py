"""FedVeca (ALGORITHMS.md 2.11): the streaming client estimates vs Algorithm 2's stored-iterate definition, eq. (15),
the L estimation, the aggregation rule and the downlink, each against formulas written out here from the spec."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.fedveca import FedVecaClient
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.wire.messages import Assignment, Update
from edge_client.wire.protocol import MissingField
from edgefl_testkit.algorithms import admit, set_up, toy_data, toy_model, train_assignment
from edgefl_testkit.messages import assignment, make_update
from server.strategies.base import TrainSettings
from server.strategies.fedveca import FedVeca

LR = 0.01


# -- helpers ---------------------------------------------------------------------------------------------------------
def make_flat(seed: int = 0) -> FlatModel:
    return FlatModel(toy_model(seed))


def make_dataset(n: int = 24, seed: int = 1) -> ArrayDataset:
    return toy_data(n, seed)


def make_assignment(weights: np.ndarray, tau: int, params: dict | None = None, lr: float = 0.3) -> Assignment:
    settings = {"full_grad_batches": 0, **(params or {})}  # the full pass of Alg. 2 line 9 unless a test says
    return assignment(weights, tau, lr, round=2, model_version=1, algorithm="fedveca", settings=settings)


def stored_iterates(weights: np.ndarray, data: ArrayDataset, tau: int, lr: float, seed: int, cid: str):
    """Re-run the same tau SGD steps (same sampler stream) with a fresh module, storing every iterate and gradient."""
    torch.manual_seed(123)
    module = nn.Linear(3, 2)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(weights[:6].reshape(2, 3)))
        module.bias.copy_(torch.from_numpy(weights[6:]))

    def grad_at(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        loss = F.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
        gw, gb = torch.autograd.grad(loss, [module.weight, module.bias])
        return torch.cat([gw.reshape(-1), gb]).numpy().astype(np.float64)

    h = grad_at(data.x, data.y)  # grad F_i(w_k) on the whole local training set
    sampler = BatchSampler(len(data), 4, seed, cid)
    iterates, grads = [], []
    for _ in range(tau):
        w = torch.cat([module.weight.detach().reshape(-1), module.bias.detach()]).numpy().astype(np.float64)
        idx = sampler.next()
        g = grad_at(data.x[idx], data.y[idx])
        iterates.append(w)
        grads.append(g)
        with torch.no_grad():
            module.weight -= lr * torch.from_numpy(g[:6].reshape(2, 3).astype(np.float32))
            module.bias -= lr * torch.from_numpy(g[6:].astype(np.float32))
    return h, iterates, grads


def algorithm2_beta_delta(h, iterates, grads, p: float) -> tuple[float, float]:
    """Alg. 2 lines 15-18 literally: beta over lam in [1, tau-1] (lam = 0 is 0/0), delta over lam in [1, tau-1]."""
    wk = iterates[0]
    betas = [np.linalg.norm(h - grads[lam]) / np.linalg.norm(wk - iterates[lam]) for lam in range(1, len(grads))]
    deltas = [
        np.linalg.norm(np.sum(grads[: lam + 1], axis=0)) ** 2 / sum(p for _ in range(lam + 1))
        for lam in range(1, len(grads))
    ]
    return max(betas, default=0.0), max(deltas, default=0.0)


def make_strategy(alpha_k: float = 0.95, lr: float = LR, **params) -> FedVeca:
    return set_up(FedVeca(TrainSettings(local_steps=5, lr=lr, batch_size=8), {"alpha_k": alpha_k, **params}), 4)


def upd(cid, n, steps, grad, G, beta=0.0, delta=0.0, round_=1) -> Update:
    arrays = {"grad": np.asarray(grad, np.float32), "G": np.asarray(G, np.float32)}
    extras = {"beta": beta, "delta": delta}
    return make_update(
        cid, np.zeros(4), num_samples=n, local_steps=steps, round=round_, model_version=round_ - 1,
        extras=extras, arrays=arrays,
    )  # fmt: skip


def eq15(beta: dict, delta: dict, alpha: float, lr: float = LR, tau_max: int = 50) -> dict:
    """Eq. (15) with the (f)6 order floor(x + 1e-9) -> reset <= 1 to 2 -> min(tau_max), from the spec."""
    a = {c: lr * beta[c] ** 2 * delta[c] for c in beta}
    m = min(a.values())
    out = {}
    for c, ai in a.items():
        t = math.floor(ai / (ai - alpha * m) + 1e-9)
        out[c] = min(2 if t <= 1 else t, tau_max)
    return out


def run_two_rounds(s: FedVeca, beta: dict, delta: dict) -> None:
    """Round 1 (k = 0) with zero estimates, round 2 (k = 1) with the given ones."""
    w = np.ones(4, np.float32)
    g = np.full(4, 0.5, np.float32)
    w = s.aggregate(1, w, [upd(c, 10, s.assign(1, c).steps, g, g) for c in beta])
    s.aggregate(2, w, [upd(c, 10, s.assign(2, c).steps, g, g, beta[c], delta[c], 2) for c in beta])


# -- client ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 7])
def test_streaming_beta_delta_equal_algorithm2_stored_iterates(seed: int) -> None:
    tau, lr, p, cid = 5, 0.3, 0.37, "c1"
    data = make_dataset(seed=seed + 1)
    flat = make_flat(seed)
    w0 = flat.numpy()
    alg = FedVecaClient()
    res = train_assignment(
        flat, data, BatchSampler(len(data), 4, seed, cid), make_assignment(w0, tau, {"P": p}, lr), alg
    )

    h, iterates, grads = stored_iterates(w0, data, tau, lr, seed, cid)
    beta, delta = algorithm2_beta_delta(h, iterates, grads, p)
    assert res.local_steps == tau
    assert res.extras["beta"] == pytest.approx(beta, rel=1e-5)
    assert res.extras["delta"] == pytest.approx(delta, rel=1e-5)
    np.testing.assert_allclose(res.arrays["grad"], h, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(res.arrays["G"], np.mean(grads, axis=0), rtol=1e-5, atol=1e-7)
    # plain SGD (C7): w_k - w_end = lr * tau * G
    np.testing.assert_allclose(res.delta, lr * tau * res.arrays["G"], rtol=1e-4, atol=1e-7)
    assert beta > 0 and delta > 0


def test_client_with_p_zero_uploads_zero_delta_and_tau_one_gives_zero_estimates() -> None:
    data = make_dataset()
    flat = make_flat()
    w0 = flat.numpy()
    alg = FedVecaClient()
    with pytest.raises(ContractError, match=r"fedveca.P: missing from the assignment"):  # the server always sends P
        train_assignment(flat, data, BatchSampler(len(data), 4, 0, "c"), make_assignment(w0, 4), alg)
    res = train_assignment(flat, data, BatchSampler(len(data), 4, 0, "c"), make_assignment(w0, 4, {"P": 0.0}), alg)
    assert res.extras["delta"] == 0.0 and res.extras["beta"] > 0  # k = 0: no P yet
    res = train_assignment(flat, data, BatchSampler(len(data), 4, 0, "c"), make_assignment(w0, 1, {"P": 1.0}), alg)
    assert res.extras == {"beta": 0.0, "delta": 0.0}


def test_client_memory_does_not_depend_on_tau_and_buffers_are_reused() -> None:
    data = make_dataset()

    def run(alg: FedVecaClient, tau: int) -> list[tuple[int, int]]:
        flat = make_flat()
        train_assignment(
            flat, data, BatchSampler(len(data), 4, 0, "c"), make_assignment(flat.numpy(), tau, {"P": 1.0}), alg
        )
        tensors = [v for v in vars(alg).values() if isinstance(v, torch.Tensor)]
        assert not [v for v in vars(alg).values() if isinstance(v, (list, dict, tuple, np.ndarray))]
        return [(t.numel(), t.data_ptr()) for t in tensors]

    alg = FedVecaClient()
    short = run(alg, 2)
    long_ = run(alg, 50)
    assert [n for n, _ in short] == [n for n, _ in long_]
    assert sum(n for n, _ in short) == 3 * 8  # h, S and one scratch vector of d = 8
    assert short == long_  # the same storage, reused across rounds
    assert sum(n for n, _ in run(FedVecaClient(), 50)) == 3 * 8


def test_client_state_round_trip_is_empty() -> None:
    alg = FedVecaClient()
    assert alg.state_dict() == {}
    alg.load_state_dict({})


# -- server: eq. (15) ------------------------------------------------------------------------------------------------
def test_eq15_alpha_095_smallest_a_gets_exactly_20_and_large_a_resets_to_2() -> None:
    assert 1 / (1 - 0.95) == 19.999999999999982  # the floating-point edge the +1e-9 guard fixes
    beta = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0, "e": 1.0}
    # A = lr * delta: m = A_a; b: 1.1 m -> 7; c: 1.5 m -> 2.72 -> 2; d: 1.91 m > 1.9 m -> x < 2 -> reset; e: 5 m
    delta = {"a": 2.0, "b": 2.2, "c": 3.0, "d": 3.82, "e": 10.0}
    s = make_strategy()
    run_two_rounds(s, beta, delta)
    want = eq15(beta, delta, 0.95)
    assert want == {"a": 20, "b": 7, "c": 2, "d": 2, "e": 2}
    assert s.round_metrics()["tau"] == want
    assert {c: s.assign(3, c).steps for c in beta} == want
    a = s.round_metrics()["A"]
    assert a == pytest.approx({c: LR * beta[c] ** 2 * delta[c] for c in beta})
    # d: x = 1.91 / (1.91 - 0.95) = 1.99 < 2 (reset) although floor gives 1; exactly at 1.9 m it would be 2
    assert math.floor(3.82 / (3.82 - 0.95 * 2.0)) == 1


def test_eq15_beta_enters_squared_and_eta_cancels() -> None:
    beta = {"a": 2.0, "b": 1.0, "c": 3.0}
    delta = {"a": 1.0, "b": 4.4, "c": 0.5}  # A ∝ 4, 4.4, 4.5
    for lr in (0.01, 0.5):
        s = make_strategy(lr=lr)
        run_two_rounds(s, beta, delta)
        assert s.round_metrics()["tau"] == eq15(beta, delta, 0.95, lr) == {"a": 20, "b": 7, "c": 6}


def test_eq15_alpha_0995_is_clamped_at_tau_max() -> None:
    beta = {"a": 1.0, "b": 1.0, "c": 1.0}
    delta = {"a": 1.0, "b": 1.01, "c": 1.05}  # x = 200, 67.3, 19.09
    s = make_strategy(alpha_k=0.995)
    assert s.assign(1, "a").steps == 50  # tau_init = min(50, 200)
    run_two_rounds(s, beta, delta)
    assert s.round_metrics()["tau"] == eq15(beta, delta, 0.995) == {"a": 50, "b": 50, "c": 19}
    s = make_strategy(alpha_k=0.995, tau_max=60)
    run_two_rounds(s, beta, delta)
    assert s.round_metrics()["tau"] == {"a": 60, "b": 60, "c": 19}


def test_degenerate_a_m_zero_and_nonfinite() -> None:
    s = make_strategy(tau_init=9)
    beta = {"a": 1.0, "b": 0.0, "c": 1.0, "d": 2.0}
    delta = {"a": 1.0, "b": 1.0, "c": 0.0, "d": 3.0}
    # A = 0.01, 0, 0, 0.12: the robust minimum is 0.01 (the zeros are below median / 20), the zeros count as it
    run_two_rounds(s, beta, delta)
    assert s.round_metrics()["tau"] == {"a": 20, "b": 20, "c": 20, "d": 2}

    # round 3: a non-finite A (overflowing beta^2, or NaN bypassing admission) keeps the previous tau, and m is
    # taken over the finite A only
    w, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    ups = [
        upd("a", 10, 2, g, g, 1.0, 1.0, 3),
        upd("b", 10, 50, g, g, 1e200, 1.0, 3),
        upd("c", 10, 50, g, g, float("nan"), 1.0, 3),
        upd("d", 10, 2, g, g, 1.0, 1.1, 3),
        upd("e", 10, 9, g, g, float("inf"), 1.0, 3),  # new client with a non-finite A: stays at tau_init
    ]
    s.aggregate(3, w, ups)
    assert s.round_metrics()["tau"] == {"a": 20, "b": 20, "c": 20, "d": 7, "e": 9}
    assert s.round_metrics()["A"]["b"] is None and s.round_metrics()["A"]["c"] is None
    json.dumps(s.round_metrics(), allow_nan=False)
    assert s.assign(4, "e").steps == 9
    # all A non-finite: nothing changes
    s.aggregate(4, w, [upd("a", 10, 20, g, g, float("nan"), 1.0, 4)])
    assert s.assign(5, "a").steps == 20


def test_median_a_zero_keeps_the_f7_rule() -> None:
    """Most clients at A = 0 (tau = 1 gives beta = delta = 0): m = 0, those get tau_max, the others reset (f)7."""
    s = make_strategy()
    run_two_rounds(s, {"a": 0.0, "b": 0.0, "c": 1.0}, {"a": 0.0, "b": 0.0, "c": 1.0})
    assert s.round_metrics()["tau"] == {"a": 50, "b": 50, "c": 2}


def test_one_device_reporting_zero_cannot_hold_honest_clients_at_two_steps() -> None:
    """Issue 23: beta = delta = 0 from one device made m = 0, every honest client 2 steps and itself tau_max."""
    beta = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0, "evil": 0.0}
    delta = {"a": 2.0, "b": 2.2, "c": 3.0, "d": 3.82, "evil": 0.0}
    s = make_strategy()
    run_two_rounds(s, beta, delta)
    honest = {c: beta[c] for c in "abcd"}
    # the honest clients get what eq. 15 gives them without the hostile device; it gets the smallest one's 20
    assert s.round_metrics()["tau"] == {**eq15(honest, delta, 0.95), "evil": 20} == {
        "a": 20, "b": 7, "c": 2, "d": 2, "evil": 20}  # fmt: skip


def test_robust_min_ignores_values_below_median_over_ratio() -> None:
    from server.strategies.fedveca import ROBUST_MIN_RATIO, robust_min

    assert ROBUST_MIN_RATIO == 20.0
    assert robust_min([1.0, 9.0, 10.2, 11.0, 12.0]) == 1.0  # the honest spread (median up to 10.2x the smallest): kept
    assert robust_min([1e-9, 1.0, 2.3, 2.9, 3.0]) == 1.0  # one tiny value below 2.3 / 20 is left out
    assert robust_min([0.1, 0.6, 2.0, 2.2, 2.4]) == 0.1  # exactly median / 20: kept
    assert robust_min([0.09, 0.6, 2.0, 2.2, 2.4]) == 0.6  # below it: left out
    assert robust_min([0.0, 0.0, 1.0]) == 0.0


def test_tau_floor_raises_small_taus_and_is_bounded_by_tau_max() -> None:
    beta = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0, "e": 1.0}
    delta = {"a": 2.0, "b": 2.2, "c": 3.0, "d": 3.82, "e": 10.0}
    s = make_strategy(tau_floor=5)
    run_two_rounds(s, beta, delta)
    assert s.round_metrics()["tau"] == {"a": 20, "b": 7, "c": 5, "d": 5, "e": 5}
    assert make_strategy().tau_floor == 1  # the paper's rule alone by default
    with pytest.raises(ContractError, match=r"fedveca.tau_floor = 51: expected at most fedveca.tau_max \(50\)"):
        make_strategy(tau_floor=51)


def test_gradient_from_full_grad_batches_minibatches_of_the_stream() -> None:
    """h over the first n_b batches of the client's stream; the steps take the batches after them."""
    tau, lr, p, cid, n_b = 3, 0.3, 0.37, "c1", 2
    data = make_dataset(n=40)
    flat = make_flat()
    w0 = flat.numpy()
    a = make_assignment(w0, tau, {"P": p, "full_grad_batches": n_b}, lr)
    res = train_assignment(flat, data, BatchSampler(len(data), 4, 0, cid), a, FedVecaClient())
    stream = BatchSampler(len(data), 4, 0, cid)
    idx = np.concatenate([stream.next() for _ in range(n_b)])
    ref = make_flat()
    h = torch.empty(ref.size)
    ref.full_gradient(data.x[idx], data.y[idx], out=h)
    np.testing.assert_allclose(res.arrays["grad"], h.numpy(), rtol=1e-5, atol=1e-7)
    steps = [stream.next() for _ in range(tau)]
    ref = make_flat()
    for b in steps:  # plain SGD on the batches after the gradient's
        ref.loss_and_grad(torch.from_numpy(data.x[b]), torch.from_numpy(data.y[b]))
        ref.params.add_(ref.grad, alpha=-lr)
    np.testing.assert_allclose(res.delta, (torch.from_numpy(w0) - ref.params).numpy(), rtol=1e-4, atol=1e-6)
    # batches covering the data set (10 x 4 >= 40) are the full pass
    full = make_assignment(w0, tau, {"P": p, "full_grad_batches": 10}, lr)
    res = train_assignment(make_flat(), data, BatchSampler(len(data), 4, 0, cid), full, FedVecaClient())
    ref = make_flat()
    ref.full_gradient(data.x, data.y, out=h)
    np.testing.assert_allclose(res.arrays["grad"], h.numpy(), rtol=1e-5, atol=1e-7)


def test_tau_init_rules_and_rounds_0_and_1_use_it() -> None:
    assert make_strategy().tau_init == 20
    assert make_strategy(alpha_k=0.5).tau_init == 2
    assert make_strategy(tau_init=7).tau_init == 7
    assert make_strategy(tau_init=70).tau_init == 50
    s = make_strategy()
    w, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    assert s.assign(1, "a").steps == 20
    # k = 0: estimates ignored (clients had no P), tau_(1,i) = tau_(0,i)
    w = s.aggregate(1, w, [upd("a", 10, 20, g, g, 5.0, 1.0), upd("b", 10, 20, g, g, 1.0, 1.0)])
    assert s.assign(2, "a").steps == 20 and s.assign(2, "b").steps == 20
    assert s.round_metrics()["tau"] == {"a": 20, "b": 20} and s.round_metrics()["A"] == {}
    s.aggregate(2, w, [upd("a", 10, 20, g, g, 1.5, 1.0, 2), upd("b", 10, 20, g, g, 1.0, 1.0, 2)])
    assert s.assign(3, "a").steps == 2 and s.assign(3, "b").steps == 20
    assert s.assign(3, "newcomer").steps == 20


def test_invalid_parameters_are_rejected() -> None:
    for bad in ({"alpha_k": 1.0}, {"alpha_k": 0.0}, {"tau_max": 0}, {"tau_min_reset": 0}, {"tau_init": -1},
                {"tau_floor": 0}, {"full_grad_batches": -1}):  # fmt: skip
        (key, value), *_ = bad.items()
        with pytest.raises(ContractError, match=f"fedveca.{key} = {value!r}: expected"):
            make_strategy(**{"alpha_k": 0.95, **bad})
    with pytest.raises(ContractError, match=r"fedveca.zeta: not a setting of fedveca"):
        make_strategy(zeta=1.0)


# -- server: aggregation, L, downlink --------------------------------------------------------------------------------
def test_aggregation_formula_uses_data_weights_and_steps_run() -> None:
    s = make_strategy(lr=0.05)
    rng = np.random.default_rng(3)
    w = rng.normal(size=4).astype(np.float32)
    ns, steps = [10, 30, 60], [20, 3, 7]
    hs = rng.normal(size=(3, 4)).astype(np.float32)
    gs = rng.normal(size=(3, 4)).astype(np.float32)
    ups = [upd(f"c{i}", ns[i], steps[i], hs[i], gs[i]) for i in range(3)]
    new = s.aggregate(1, w, ups)
    p = np.array(ns, float) / sum(ns)
    tau_k = float(p @ np.array(steps, float))
    want = w.astype(float) - 0.05 * tau_k * (p @ gs.astype(float))
    np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-6)
    assert new.dtype == np.float32
    assert s.round_metrics()["tau_k"] == pytest.approx(tau_k)
    # P = ||gradF_0||^2 goes to the clients of the NEXT round; round 1 had none
    grad_f0 = p @ hs.astype(float)
    assert s.assign(2, "c0").settings["P"] == pytest.approx(float(grad_f0 @ grad_f0), rel=1e-5)


def test_p_sent_with_round_k_is_previous_global_gradient() -> None:
    s = make_strategy()
    w = np.ones(4, np.float32)
    h1 = [np.array([1, 2, 0, 0], np.float32), np.array([3, 0, 0, 1], np.float32)]
    h2 = [np.array([0, 1, 1, 0], np.float32), np.array([0, 0, 0, 2], np.float32)]
    assert s.assign(1, "a").settings["P"] == 0.0
    w2 = s.aggregate(1, w, [upd("a", 1, 20, h1[0], h1[0]), upd("b", 3, 20, h1[1], h1[1])])
    gf0 = 0.25 * h1[0] + 0.75 * h1[1]
    assert s.assign(2, "a").settings["P"] == pytest.approx(float(gf0 @ gf0), rel=1e-6)
    s.aggregate(2, w2, [upd("a", 1, 20, h2[0], h2[0], 1, 1, 2), upd("b", 3, 20, h2[1], h2[1], 1, 1, 2)])
    gf1 = 0.25 * h2[0] + 0.75 * h2[1]
    assert s.assign(3, "b").settings["P"] == pytest.approx(float(gf1 @ gf1), rel=1e-6)


def test_l_estimation_k1_and_k2_running_max() -> None:
    lr = 0.1
    s = make_strategy(lr=lr)
    rng = np.random.default_rng(5)
    ws, gfs, ls = [rng.normal(size=4).astype(np.float32)], [], []
    # L_1 > L_0 (large gradient change), then an almost unchanged gradient: L_2 < L_0 must not lower the running max
    h1 = rng.normal(size=(2, 4))
    h2 = 10 * rng.normal(size=(2, 4))
    h3 = h2 + 1e-3 * rng.normal(size=(2, 4))
    hs = [h.astype(np.float32) for h in (h1, h2, h3, h3 + 1e-3)]
    for r in range(1, 5):
        h = hs[r - 1]
        g = rng.normal(size=(2, 4)).astype(np.float32)
        ups = [upd("a", 10, 5, h[0], g[0], 1, 1, r), upd("b", 30, 8, h[1], g[1], 1.2, 1, r)]
        ws.append(s.aggregate(r, ws[-1], ups))
        gfs.append(0.25 * h[0].astype(float) + 0.75 * h[1].astype(float))
        k = r - 1
        if k == 0:
            assert s.round_metrics()["L"] is None and s.round_metrics()["eta_tau_L"] is None
            continue
        if k == 1:
            ls.append(np.linalg.norm(gfs[0]) / np.linalg.norm(ws[0].astype(float)))  # line 12
        else:
            dw = ws[k - 1].astype(float) - ws[k - 2].astype(float)
            ls.append(np.linalg.norm(gfs[k - 1] - gfs[k - 2]) / np.linalg.norm(dw))  # line 14
        m = s.round_metrics()
        assert m["L"] == pytest.approx(max(ls), rel=1e-5)
        assert m["eta_tau_L"] == pytest.approx(lr * (0.25 * 5 + 0.75 * 8) * max(ls), rel=1e-5)
    assert ls[1] > ls[0] > ls[2]  # the scenario really exercised the running max


def test_l0_is_skipped_for_a_zero_model() -> None:
    s = make_strategy()
    g = np.full(4, 0.5, np.float32)
    w = s.aggregate(1, np.zeros(4, np.float32), [upd("a", 10, 20, g, g)])
    s.aggregate(2, w, [upd("a", 10, 20, g, g, 1, 1, 2)])
    assert s.round_metrics()["L"] is None


def test_admission_requires_arrays_and_extras() -> None:
    s = make_strategy()
    g = np.zeros(4, np.float32)
    u = upd("a", 10, 2, g, g)
    admit(s, u)
    del u.arrays["G"]
    with pytest.raises(MissingField, match=r"fedveca.G: array missing"):
        admit(s, u)
    u = upd("a", 10, 2, g, g)
    del u.extras["delta"]
    with pytest.raises(MissingField, match=r"fedveca.delta: missing"):
        admit(s, u)


def test_state_dict_round_trip_continues_identically() -> None:
    rng = np.random.default_rng(11)
    w = rng.normal(size=4).astype(np.float32)
    rounds = [
        [upd(c, n, 20, rng.normal(size=4), rng.normal(size=4), b, d, r) for c, n, b, d in spec]
        for r, spec in enumerate(
            [
                [("a", 10, 0.0, 0.0), ("b", 20, 0.0, 0.0)],
                [("a", 10, 1.0, 2.0), ("b", 20, 1.3, 2.0)],
                [("a", 10, 1.0, 1.0), ("b", 20, 1.0, 1.1)],
                [("a", 10, 2.0, 1.0), ("b", 20, 1.0, 1.0)],
            ],
            start=1,
        )
    ]
    full = make_strategy()
    wf = w
    for r, ups in enumerate(rounds, start=1):
        wf = full.aggregate(r, wf, ups)
    part = make_strategy()
    wp = w
    for r, ups in enumerate(rounds[:2], start=1):
        wp = part.aggregate(r, wp, ups)
    restored = make_strategy()
    restored.load_state_dict(part.state_dict())
    assert restored.assign(3, "a").settings == part.assign(3, "a").settings
    for r, ups in enumerate(rounds[2:], start=3):
        wp = restored.aggregate(r, wp, ups)
    np.testing.assert_array_equal(wp, wf)
    assert restored.round_metrics() == full.round_metrics()
    got, want = restored.state_dict(), full.state_dict()
    np.testing.assert_array_equal(got.pop("prev_grad"), want.pop("prev_grad"))
    assert got == want


# -- both halves -----------------------------------------------------------------------------------------------------
def test_clients_run_the_instructed_tau_end_to_end() -> None:
    """Three clients, three rounds: every client runs exactly the tau it is told, and round 3 uses adapted taus."""
    s = FedVeca(TrainSettings(local_steps=5, lr=0.2, batch_size=4), {"alpha_k": 0.9})
    datas = {c: make_dataset(n=12 + 6 * i, seed=20 + i) for i, c in enumerate(["a", "b", "c"])}
    set_up(s, 8, {c: len(d) for c, d in datas.items()})
    algs = {c: FedVecaClient() for c in datas}
    samplers = {c: BatchSampler(len(d), 4, 0, c) for c, d in datas.items()}
    w = make_flat(3).numpy()
    told, next_tau = [], []
    for r in range(1, 4):
        ups = []
        told.append({c: s.assign(r, c).steps for c in datas})
        for c, d in datas.items():
            ins = s.assign(r, c)
            a = make_assignment(w, ins.steps, ins.settings, ins.lr)
            res = train_assignment(make_flat(), d, samplers[c], a, algs[c])
            assert res.local_steps == ins.steps
            np.testing.assert_allclose(res.delta, ins.lr * ins.steps * res.arrays["G"], rtol=1e-4, atol=1e-6)
            if r == 1:
                assert res.extras["delta"] == 0.0
            else:
                assert res.extras["delta"] > 0.0
            kw = {"round": r, "model_version": r - 1, "extras": res.extras, "arrays": res.arrays}
            ups.append(make_update(c, res.delta, num_samples=len(d), local_steps=res.local_steps, **kw))
            admit(s, ups[-1], assigned_steps=ins.steps)
        w = s.aggregate(r, w, ups)
        next_tau.append(s.round_metrics()["tau"])
    assert told[0] == told[1] == next_tau[0] == {"a": 10, "b": 10, "c": 10}  # tau_init = floor(1/(1-0.9) + 1e-9)
    assert told[2] == next_tau[1]  # round 3 runs the taus adapted in round 2 (k = 1)
    a = s.round_metrics()["A"]
    assert next_tau[2] == eq15({c: 1.0 for c in a}, {c: a[c] / 0.2 for c in a}, 0.9, lr=0.2)
