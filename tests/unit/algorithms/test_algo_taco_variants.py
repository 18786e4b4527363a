"""TACO-tailored FedProx / SCAFFOLD (ALGORITHMS.md 2.7 (f)13): per-client coefficients from TACO's eq. 7.

The server sends each client its ``alpha_i`` (the assignment's ``alpha``, computed independently here from the round's
uploads); the device applies fedprox-taco's ``zeta (1 - alpha_i)`` and scaffold-taco's ``alpha (1 - alpha_i)``
(SCAFFOLD's alpha, 1 by default).
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.fedprox import FedProxClient
from edge_client.algorithms.fedprox_taco import FedProxTacoClient
from edge_client.algorithms.scaffold import ScaffoldClient
from edge_client.algorithms.scaffold_taco import ScaffoldTacoClient
from edge_client.loop.models_cache import ModelCache
from edge_client.wire.messages import Assignment, GlobalModel, RoundFacts, Update
from edge_client.wire.plan import Plan
from edge_client.wire.protocol import decode, encode
from edgefl_testkit.algorithms import set_up, toy_data, train_toy
from edgefl_testkit.fakes import as_sent
from edgefl_testkit.messages import assignment, make_update
from server.strategies.base import TrainSettings
from server.strategies.fedprox import FedProx
from server.strategies.fedprox_taco import FedProxTaco
from server.strategies.scaffold import Scaffold
from server.strategies.scaffold_taco import ScaffoldTaco

SETTINGS = TrainSettings(local_steps=3, lr=0.05, batch_size=4)
D = 8
CLIENTS = {f"c{i}": 10 for i in range(4)}


def ref_alphas(deltas: list[np.ndarray], reference: np.ndarray | None = None) -> np.ndarray:
    """TACO eq. 7, written from the spec: (1 - |D_i| / sum |D_j|) * max(cos(D_i, r), 0), r = mean D or ``reference``."""
    d = np.stack(deltas).astype(np.float64)
    norms = np.linalg.norm(d, axis=1)
    mean = d.mean(axis=0) if reference is None else np.asarray(reference, dtype=np.float64)
    cos = d @ mean / (norms * np.linalg.norm(mean))
    return (1 - norms / norms.sum()) * np.maximum(cos, 0)


def make_updates(round_: int, seed: int) -> list[Update]:
    rng = np.random.default_rng(seed)
    base = rng.normal(size=D)
    out = []
    for i in range(4):
        delta = (base + rng.normal(scale=0.8, size=D)).astype(np.float32)
        delta_c = rng.normal(size=D).astype(np.float32)
        out.append(
            make_update(
                f"c{i}", delta, local_steps=3, round=round_, model_version=round_ - 1, arrays={"delta_c": delta_c}
            )
        )
    return out


def on_the_wire(told: Plan, weights: np.ndarray, algorithm: str) -> Plan:
    """A strategy's plan -> what a device decodes and trains (sent with the round's facts as the orchestrator sends
    it; the model goes in the round's broadcast, the assignment names it)."""
    told.weights = weights
    a = Assignment(told, RoundFacts(round=1, deadline_s=60.0, algorithm=algorithm))
    model, slim = (decode(encode(m)) for m in as_sent(a))
    assert isinstance(model, GlobalModel) and isinstance(slim, Assignment)
    cache = ModelCache()
    assert cache.add(model)
    cache.complete(slim)
    return slim.plan


def test_fedprox_taco_sends_zeta_and_alpha_i() -> None:
    s = FedProxTaco(SETTINGS, {"zeta": 0.2})
    assert isinstance(s, FedProx) and s.name == "fedprox-taco" and s.params["alpha_init"] == 0.1
    set_up(s, D)
    w = np.zeros(D, np.float32)
    first = on_the_wire(s.assign(1, "c0"), w, s.name)
    assert first.settings.pop("alpha_i") == pytest.approx(0.1) and first.settings == {"zeta": 0.2}  # alpha_init

    ups = make_updates(1, seed=0)
    new = s.aggregate(1, w, ups)
    np.testing.assert_allclose(new, w - np.mean([u.delta for u in ups], axis=0), rtol=1e-5)  # FedProx's averaging
    alphas = ref_alphas([u.delta for u in ups])
    assert len(set(np.round(alphas, 4))) == 4 and alphas.max() > 0.2  # distinct, non-trivial per-client values
    for u, a in zip(ups, alphas, strict=True):
        wire = on_the_wire(s.assign(2, u.client_id), new, s.name)
        assert wire.settings.pop("alpha_i") == pytest.approx(a, rel=1e-6) and wire.settings == {"zeta": 0.2}
    assert s.round_metrics()["alpha"]["c1"] == pytest.approx(alphas[1], rel=1e-6)

    # round 2 with only two reporters: they get new alphas, the others keep theirs (2.7 (f)12)
    ups2 = make_updates(2, seed=1)[:2]
    s.aggregate(2, new, ups2)
    alphas2 = ref_alphas([u.delta for u in ups2])
    assert s.assign(3, "c0").settings["alpha_i"] == pytest.approx(alphas2[0], rel=1e-6)
    assert s.assign(3, "c3").settings["alpha_i"] == pytest.approx(alphas[3], rel=1e-6)

    restored = FedProxTaco(SETTINGS, {"zeta": 0.2})
    restored.load_state_dict(s.state_dict())
    assert all(
        restored.assign(3, c).settings["alpha_i"] == s.assign(3, c).settings["alpha_i"]
        for c in ("c0", "c1", "c2", "c3", "new")
    )


def test_scaffold_taco_sends_alpha_and_alpha_i() -> None:
    s = ScaffoldTaco(SETTINGS)
    assert isinstance(s, Scaffold) and s.name == "scaffold-taco"
    set_up(s, D, CLIENTS)
    w = np.zeros(D, np.float32)
    first = on_the_wire(s.assign(1, "c0"), w, s.name)
    assert first.settings["alpha_i"] == pytest.approx(0.1) and first.settings["alpha"] == 1.0  # alpha_i^0, SCAFFOLD's

    ups = make_updates(1, seed=2)
    plain = Scaffold(SETTINGS)
    set_up(plain, D, CLIENTS)
    new = s.aggregate(1, w, ups)
    np.testing.assert_array_equal(new, plain.aggregate(1, w, ups))  # SCAFFOLD's aggregation and c unchanged
    np.testing.assert_array_equal(s.c, plain.c)
    alphas = ref_alphas([u.delta for u in ups])
    for u, a in zip(ups, alphas, strict=True):
        wire = on_the_wire(s.assign(2, u.client_id), new, s.name)
        assert wire.settings["alpha_i"] == pytest.approx(a, rel=1e-6) and wire.settings["alpha"] == 1.0
        np.testing.assert_array_equal(wire.arrays["c"], s.c)

    half = ScaffoldTaco(SETTINGS, {"alpha": 0.5})  # SCAFFOLD's alpha stays a multiplier (the device's)
    set_up(half, D)
    half.aggregate(1, w, ups)
    told = half.assign(2, "c2")
    assert told.settings["alpha"] == 0.5 and told.settings["alpha_i"] == pytest.approx(alphas[2], rel=1e-6)

    restored = ScaffoldTaco(SETTINGS)
    restored.load_state_dict(s.state_dict())
    assert all(
        restored.assign(2, c).settings["alpha_i"] == s.assign(2, c).settings["alpha_i"] for c in ("c0", "c3", "new")
    )
    np.testing.assert_array_equal(restored.c, s.c)


@pytest.mark.parametrize("variant", [FedProxTaco, ScaffoldTaco])
def test_variants_take_the_previous_global_update_as_reference(variant: type) -> None:
    s = variant(SETTINGS, {"alpha_reference": "previous_global"})
    with pytest.raises(ContractError, match="alpha_reference"):
        variant(SETTINGS, {"alpha_reference": "median"})
    set_up(s, D, CLIENTS)
    w0 = np.zeros(D, np.float32)
    w1 = s.aggregate(1, w0, make_updates(1, seed=3))
    assert all(s.assign(2, f"c{i}").settings["alpha_i"] == 0.0 for i in range(4))  # round 0: no reference, alpha 0
    ups = make_updates(2, seed=4)
    w2 = s.aggregate(2, w1, ups)
    alphas = ref_alphas([u.delta for u in ups], w0 - w1)  # against the update the clients were sent
    assert np.abs(alphas - ref_alphas([u.delta for u in ups])).max() > 1e-3 and alphas.max() > 0.2
    for u, a in zip(ups, alphas, strict=True):
        assert s.assign(3, u.client_id).settings["alpha_i"] == pytest.approx(a, rel=1e-5)
    restored = variant(SETTINGS, {"alpha_reference": "previous_global"})
    set_up(restored, D, CLIENTS)
    restored.load_state_dict(s.state_dict())
    ups3 = make_updates(3, seed=5)
    np.testing.assert_array_equal(s.aggregate(3, w2, ups3), restored.aggregate(3, w2, ups3))
    for u, a in zip(ups3, ref_alphas([u.delta for u in ups3], w1 - w2), strict=True):
        assert restored.assign(4, u.client_id).settings["alpha_i"] == s.assign(4, u.client_id).settings["alpha_i"]
        assert s.assign(4, u.client_id).settings["alpha_i"] == pytest.approx(a, rel=1e-5)


def tiny_run(
    algorithm: object, params: dict[str, float], arrays: dict[str, np.ndarray], alpha: float | None = None
) -> np.ndarray:
    w = np.linspace(-0.5, 0.5, 8).astype(np.float32)
    settings = params if alpha is None else {**params, "alpha_i": alpha}
    a = assignment(w, 3, 0.1, settings=settings, arrays=arrays, round=1)
    return train_toy(algorithm, a, toy_data(16, seed=1), "c").delta  # type: ignore[arg-type]


def test_client_variants_are_the_base_clients_with_the_tailored_coefficient() -> None:
    assert FedProxTacoClient.contract.name == "fedprox-taco" and issubclass(FedProxTacoClient, FedProxClient)
    assert ScaffoldTacoClient.contract.name == "scaffold-taco" and issubclass(ScaffoldTacoClient, ScaffoldClient)
    prox = tiny_run(FedProxTacoClient(), {"zeta": 0.3}, {}, alpha=0.25)
    np.testing.assert_array_equal(prox, tiny_run(FedProxClient(), {"zeta": 0.3 * (1 - 0.25)}, {}))  # zeta_i
    np.testing.assert_array_equal(
        tiny_run(FedProxTacoClient(), {"zeta": 0.3}, {}, alpha=0.0), tiny_run(FedProxClient(), {"zeta": 0.3}, {})
    )
    assert np.abs(prox - tiny_run(FedProxTacoClient(), {"zeta": 0.0}, {}, alpha=0.25)).max() > 0  # reads zeta
    assert np.abs(prox - tiny_run(FedProxTacoClient(), {"zeta": 0.3}, {}, alpha=0.9)).max() > 0  # reads alpha_i
    with pytest.raises(ContractError, match=r"fedprox-taco.alpha_i: missing from the assignment"):
        tiny_run(FedProxTacoClient(), {"zeta": 0.3}, {})
    c = {"c": np.full(8, 0.5, np.float32)}
    sc = tiny_run(ScaffoldTacoClient(), {"alpha": 0.7}, c, alpha=0.4)
    np.testing.assert_array_equal(sc, tiny_run(ScaffoldClient(), {"alpha": 0.7 * (1 - 0.4)}, c))
    assert np.abs(sc - tiny_run(ScaffoldTacoClient(), {"alpha": 0.1}, c, alpha=0.4)).max() > 1e-3
    with pytest.raises(ContractError, match=r"scaffold-taco.alpha_i: missing from the assignment"):
        tiny_run(ScaffoldTacoClient(), {"alpha": 0.7}, c)
