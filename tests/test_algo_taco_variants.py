"""TACO-tailored FedProx / SCAFFOLD (ALGORITHMS.md 2.7 (f)13): per-client coefficients from TACO's eq. 7 on the wire.

fedprox-taco sends ``zeta_i = zeta (1 - alpha_i)``, scaffold-taco ``1 - alpha_i`` (times SCAFFOLD's alpha, 1 by
default), with ``alpha_i`` computed independently here from the round's uploads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edge_client.algorithms.fedprox import FedProxClient
from edge_client.algorithms.fedprox_taco import FedProxTacoClient
from edge_client.algorithms.scaffold import ScaffoldClient
from edge_client.algorithms.scaffold_taco import ScaffoldTacoClient
from edge_client.data import ArrayDataset, BatchSampler
from edge_client.flat import FlatModel
from edge_client.protocol import Assignment, Update, decode, encode
from edge_client.trainer import train_local
from server.strategies.base import Instructions, ServerContext, TrainSettings
from server.strategies.fedprox import FedProx
from server.strategies.fedprox_taco import FedProxTaco
from server.strategies.scaffold import Scaffold
from server.strategies.scaffold_taco import ScaffoldTaco

SETTINGS = TrainSettings(local_steps=3, lr=0.05, batch_size=4)
D = 8


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
        out.append(Update(round_, round_ - 1, f"c{i}", 10, 3, 0.0, 0.0, 0.0, delta, arrays={"delta_c": delta_c}))
    return out


def on_the_wire(instr: Instructions, weights: np.ndarray, algorithm: str) -> Assignment:
    """Instructions -> the assignment a device decodes (as the orchestrator builds it)."""
    a = Assignment(1, 0, instr.local_steps, instr.lr, instr.batch_size, 60.0, algorithm, {}, weights, instr.alpha,
                   instr.params, instr.arrays)  # fmt: skip
    decoded = decode(encode(a))
    assert isinstance(decoded, Assignment)
    return decoded


def test_fedprox_taco_sends_zeta_times_one_minus_alpha() -> None:
    s = FedProxTaco(SETTINGS, {"zeta": 0.2})
    assert isinstance(s, FedProx) and s.name == "fedprox-taco" and s.params["alpha_init"] == 0.1
    s.setup(ServerContext(model_spec={}, num_params=D))
    w = np.zeros(D, np.float32)
    assert on_the_wire(s.instructions(1, "c0"), w, s.name).params["zeta"] == pytest.approx(0.2 * 0.9)  # alpha^0

    ups = make_updates(1, seed=0)
    new = s.aggregate(1, w, ups)
    np.testing.assert_allclose(new, w - np.mean([u.delta for u in ups], axis=0), rtol=1e-5)  # FedProx's averaging
    alphas = ref_alphas([u.delta for u in ups])
    assert len(set(np.round(alphas, 4))) == 4 and alphas.max() > 0.2  # distinct, non-trivial per-client values
    for u, a in zip(ups, alphas, strict=True):
        got = on_the_wire(s.instructions(2, u.client_id), new, s.name).params["zeta"]
        assert got == pytest.approx(0.2 * (1 - a), rel=1e-6)
    assert s.round_metrics()["alpha"]["c1"] == pytest.approx(alphas[1], rel=1e-6)

    # round 2 with only two reporters: they get new alphas, the others keep theirs (2.7 (f)12)
    ups2 = make_updates(2, seed=1)[:2]
    s.aggregate(2, new, ups2)
    alphas2 = ref_alphas([u.delta for u in ups2])
    assert s.zeta_for("c0") == pytest.approx(0.2 * (1 - alphas2[0]), rel=1e-6)
    assert s.zeta_for("c3") == pytest.approx(0.2 * (1 - alphas[3]), rel=1e-6)

    restored = FedProxTaco(SETTINGS, {"zeta": 0.2})
    restored.load_state_dict(s.state_dict())
    assert all(restored.zeta_for(c) == s.zeta_for(c) for c in ("c0", "c1", "c2", "c3", "new"))


def test_scaffold_taco_sends_one_minus_alpha() -> None:
    s = ScaffoldTaco(SETTINGS)
    assert isinstance(s, Scaffold) and s.name == "scaffold-taco"
    s.setup(ServerContext(model_spec={}, num_params=D, clients={f"c{i}": 10 for i in range(4)}))
    w = np.zeros(D, np.float32)
    assert on_the_wire(s.instructions(1, "c0"), w, s.name).params["alpha"] == pytest.approx(0.9)

    ups = make_updates(1, seed=2)
    plain = Scaffold(SETTINGS)
    plain.setup(ServerContext(model_spec={}, num_params=D, clients={f"c{i}": 10 for i in range(4)}))
    new = s.aggregate(1, w, ups)
    np.testing.assert_array_equal(new, plain.aggregate(1, w, ups))  # SCAFFOLD's aggregation and c unchanged
    np.testing.assert_array_equal(s.c, plain.c)
    alphas = ref_alphas([u.delta for u in ups])
    for u, a in zip(ups, alphas, strict=True):
        wire = on_the_wire(s.instructions(2, u.client_id), new, s.name)
        assert wire.params["alpha"] == pytest.approx(1 - a, rel=1e-6)
        np.testing.assert_array_equal(wire.arrays["c"], s.c)

    half = ScaffoldTaco(SETTINGS, {"alpha": 0.5})  # SCAFFOLD's alpha stays a multiplier
    half.setup(ServerContext(model_spec={}, num_params=D))
    half.aggregate(1, w, ups)
    assert half.alpha_for("c2") == pytest.approx(0.5 * (1 - alphas[2]), rel=1e-6)

    restored = ScaffoldTaco(SETTINGS)
    restored.load_state_dict(s.state_dict())
    assert all(restored.alpha_for(c) == s.alpha_for(c) for c in ("c0", "c3", "new"))
    np.testing.assert_array_equal(restored.c, s.c)


@pytest.mark.parametrize("variant", [FedProxTaco, ScaffoldTaco])
def test_variants_take_the_previous_global_update_as_reference(variant: type) -> None:
    s = variant(SETTINGS, {"alpha_reference": "previous_global"})
    with pytest.raises(ValueError, match="alpha_reference"):
        variant(SETTINGS, {"alpha_reference": "median"})
    s.setup(ServerContext(model_spec={}, num_params=D, clients={f"c{i}": 10 for i in range(4)}))
    coefficient = s.zeta_for if variant is FedProxTaco else s.alpha_for
    base = 0.1 if variant is FedProxTaco else 1.0  # zeta, SCAFFOLD's alpha
    w0 = np.zeros(D, np.float32)
    w1 = s.aggregate(1, w0, make_updates(1, seed=3))
    assert all(coefficient(f"c{i}") == pytest.approx(base) for i in range(4))  # round 0: no reference, alpha 0
    ups = make_updates(2, seed=4)
    w2 = s.aggregate(2, w1, ups)
    alphas = ref_alphas([u.delta for u in ups], w0 - w1)  # against the update the clients were sent
    assert np.abs(alphas - ref_alphas([u.delta for u in ups])).max() > 1e-3 and alphas.max() > 0.2
    for u, a in zip(ups, alphas, strict=True):
        assert coefficient(u.client_id) == pytest.approx(base * (1 - a), rel=1e-5)
    restored = variant(SETTINGS, {"alpha_reference": "previous_global"})
    restored.setup(ServerContext(model_spec={}, num_params=D, clients={f"c{i}": 10 for i in range(4)}))
    restored.load_state_dict(s.state_dict())
    ups3 = make_updates(3, seed=5)
    np.testing.assert_array_equal(s.aggregate(3, w2, ups3), restored.aggregate(3, w2, ups3))
    alphas3 = ref_alphas([u.delta for u in ups3], w1 - w2)
    for u, a in zip(ups3, alphas3, strict=True):
        assert restored.round_metrics()["alpha"][u.client_id] == s.round_metrics()["alpha"][u.client_id]
        assert coefficient(u.client_id) == pytest.approx(base * (1 - a), rel=1e-5)


def tiny_run(algorithm: object, name: str, params: dict[str, float], arrays: dict[str, np.ndarray]) -> np.ndarray:
    torch.manual_seed(0)
    flat = FlatModel(nn.Linear(3, 2))
    rng = np.random.default_rng(1)
    data = ArrayDataset(rng.normal(size=(16, 3)).astype(np.float32), rng.integers(0, 2, size=16))
    w = np.linspace(-0.5, 0.5, flat.size).astype(np.float32)
    a = Assignment(1, 0, 3, 0.1, 4, 60.0, name, {}, w, None, params, arrays)
    return train_local(flat, data, BatchSampler(16, 4, 0, "c"), a, algorithm).delta  # type: ignore[arg-type]


def test_client_variants_are_the_base_clients_under_a_new_name() -> None:
    assert FedProxTacoClient.name == "fedprox-taco" and issubclass(FedProxTacoClient, FedProxClient)
    assert ScaffoldTacoClient.name == "scaffold-taco" and issubclass(ScaffoldTacoClient, ScaffoldClient)
    prox = tiny_run(FedProxTacoClient(), "fedprox-taco", {"zeta": 0.3}, {})
    np.testing.assert_array_equal(prox, tiny_run(FedProxClient(), "fedprox", {"zeta": 0.3}, {}))
    assert np.abs(prox - tiny_run(FedProxTacoClient(), "fedprox-taco", {"zeta": 0.0}, {})).max() > 0  # reads zeta
    c = {"c": np.full(8, 0.5, np.float32)}
    sc = tiny_run(ScaffoldTacoClient(), "scaffold-taco", {"alpha": 0.7}, c)
    np.testing.assert_array_equal(sc, tiny_run(ScaffoldClient(), "scaffold", {"alpha": 0.7}, c))
    assert np.abs(sc - tiny_run(ScaffoldTacoClient(), "scaffold-taco", {"alpha": 0.1}, c)).max() > 1e-3
