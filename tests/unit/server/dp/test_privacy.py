"""Differential privacy (docs/privacy.md): the noise actually added, clipping on both sides, the accountant against
dp-accounting itself, the budget stopping a run, the config refusals. A run over mosquitto with DP on:
tests/integration/test_privacy.py; the privacy benchmark: tests/integration/benchmarks/test_privacy.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp

from edge_client.algorithms import CONTRACTS, contract_of
from edge_client.algorithms.contract import ContractError, vector_norm
from edge_client.loop.dp import privatize
from edge_client.wire.plan import Plan
from edgefl_testkit.federation import make_config, run_simulated
from edgefl_testkit.messages import make_update
from server.config import ConfigError
from server.datasets import load_dataset
from server.dp import accountant
from server.dp.budget import Budget, budget_of
from server.dp.mechanism import PrivateStrategy, adapted_clip_norm
from server.dp.settings import dp_markdown
from server.strategies import TrainSettings, make_strategy

SIZE = 2000


def budget(**over: object) -> Budget:
    fields = {"mode": "central", "clip_norm": 1.0, "noise_multiplier": 0.8, "delta": 1e-5, "sampling_rate": 1.0,
              "rounds": 10, "target_epsilon": 0.0, "derived": False, "expected_devices": 4.0, "adaptive": False,
              "secure_aggregation": False, **over}  # fmt: skip
    return Budget(**fields)  # type: ignore[arg-type]


def private(algorithm: str = "fedavg", **over: object) -> PrivateStrategy:
    inner = make_strategy(algorithm, TrainSettings(5, 0.1, 8), {}, 0)
    return PrivateStrategy(inner, budget(**over))


def one_round(strategy: PrivateStrategy, deltas: list[np.ndarray]) -> np.ndarray:
    weights = np.zeros(SIZE, dtype=np.float32)
    rnd = strategy.begin(1, weights)
    for i, d in enumerate(deltas):
        strategy.fold(rnd, make_update(f"c{i}", d.copy(), num_samples=10 * (i + 1)))
    return strategy.finish(rnd)


def test_noise_on_the_aggregate_has_std_z_c_over_expected_devices() -> None:
    """200 rounds of the same four updates: what the aggregate moves beyond their sum / 4 is the noise, whose std per
    coordinate must be z C / 4 (400k draws: within 2 %); the mean of the updates is what remains on average."""
    strategy = private(noise_multiplier=0.8, clip_norm=1.0, expected_devices=4.0)
    rng = np.random.default_rng(0)
    deltas = [v / np.linalg.norm(v) * 0.5 for v in rng.normal(size=(4, SIZE)).astype(np.float32)]  # within C
    expected = -np.sum(deltas, axis=0) / 4
    noise = np.stack([one_round(strategy, deltas) - expected for _ in range(200)])
    assert noise.std() == pytest.approx(0.8 * 1.0 / 4, rel=0.02)
    assert abs(noise.mean()) < 0.01  # centred: the updates' mean is what the aggregate carries


def test_the_server_clips_what_it_received_and_weighs_every_update_the_same() -> None:
    """No noise: an update 10x the clip norm counts as one of norm C; sample counts do not weight (FedNova's D_i)."""
    strategy = private("fednova", noise_multiplier=1e-12, clip_norm=1.0, expected_devices=2.0)
    strategy.inner.params["local_steps_mode"] = "fixed"
    unit = np.zeros(SIZE, dtype=np.float32)
    unit[0] = 1.0
    new = one_round(strategy, [unit * 10, unit * 0.5])
    assert -new[0] == pytest.approx((1.0 + 0.5) / 2, rel=1e-4)


def test_device_clips_jointly_before_any_codec_and_reports_whether_it_was_within() -> None:
    delta = np.full(100, 1.0, dtype=np.float32)  # norm 10
    extra = {"delta_c": np.full(100, 1.0, dtype=np.float32)}  # norm 10: 14.1 together
    out, arrays, sent = privatize({"dp_clip_norm": 2.0}, delta, extra)
    joint = math.sqrt(vector_norm(out) ** 2 + vector_norm(arrays["delta_c"]) ** 2)
    assert joint <= 2.0 and joint == pytest.approx(2.0, rel=1e-4) and sent == {"dp_within": 0}
    assert extra["delta_c"][0] == 1.0  # the algorithm's own array is not modified in place
    small = np.full(100, 0.01, dtype=np.float32)
    assert privatize({"dp_clip_norm": 2.0}, small, {})[2] == {"dp_within": 1}
    assert privatize({}, delta, {})[0] is delta  # no DP: untouched


def test_local_noise_std_and_secure_aggregation_shares_sum_to_the_total() -> None:
    """Local mode: each device adds z C itself. With secure aggregation each of n selected devices adds a share, and
    the n shares (drawn by the device code) sum to noise of std z C."""
    local = private(mode="local", noise_multiplier=0.5, clip_norm=2.0)
    assert local.device_noise_std() == pytest.approx(1.0)
    shared = private(secure_aggregation=True, noise_multiplier=0.5, clip_norm=2.0)
    shared.select(1, [f"c{i}" for i in range(8)])
    std = shared.device_noise_std()
    assert std == pytest.approx(1.0 / math.sqrt(8))
    zero = np.zeros(50_000, dtype=np.float32)
    total = sum(privatize({"dp_clip_norm": 2.0, "dp_noise_std": std}, zero, {})[0] for _ in range(8))
    assert total.std() == pytest.approx(1.0, rel=0.02)
    assert shared.assign(1, "c0").settings["dp_noise_std"] == pytest.approx(std)
    rnd = shared.begin(1, np.zeros(SIZE, dtype=np.float32))
    shared.fold(rnd, make_update("c0", np.zeros(SIZE)))
    assert not shared.finish(rnd).any()  # the server adds nothing of its own


def test_poisson_sampling_selects_each_device_with_the_sampling_rate() -> None:
    strategy = private(sampling_rate=0.25)
    devices = [f"c{i}" for i in range(40)]
    counts = [len(strategy.select(r, devices)) for r in range(200)]
    assert np.mean(counts) == pytest.approx(10, rel=0.05)
    assert len(set(counts)) > 3  # not a fixed-size sample


def test_adaptive_clipping_moves_the_norm_towards_the_quantile() -> None:
    b = budget(adaptive=True, expected_devices=100.0, noise_multiplier=1.0)
    assert b.update_multiplier > b.noise_multiplier  # part of the budget pays for the count
    rng = np.random.default_rng(0)
    down = [math.log(adapted_clip_norm(1.0, 100, b, rng)) for _ in range(400)]  # all within: C shrinks
    up = [math.log(adapted_clip_norm(1.0, 0, b, rng)) for _ in range(400)]  # all clipped: C grows
    assert np.mean(down) == pytest.approx(-0.2 * 0.5, abs=0.01) and np.mean(up) == pytest.approx(0.1, abs=0.01)


@pytest.mark.parametrize(
    ("z", "q", "rounds", "delta"), [(1.1, 0.01, 1000, 1e-5), (0.8, 0.1, 30, 1e-5), (2.0, 1, 5, 1e-3)]
)
def test_epsilon_matches_the_library_computed_directly(z: float, q: float, rounds: int, delta: float) -> None:
    """The same event through dp-accounting's own RDP accountant (its default orders) and its PLD accountant: RDP is
    an upper bound a few percent above the tighter PLD."""
    ours = accountant.epsilon(z, q, rounds, delta)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)) if q < 1
        else dp_accounting.GaussianDpEvent(z), rounds,
    )  # fmt: skip
    direct = rdp.RdpAccountant().compose(event).get_epsilon(delta)
    tight = pld.PLDAccountant().compose(event).get_epsilon(delta)
    assert ours == pytest.approx(direct, rel=0.02)
    assert tight <= ours <= tight * 1.3


def test_the_multiplier_derived_from_target_epsilon_spends_it() -> None:
    z = accountant.calibrate(3.0, 0.1, 30, 1e-5)
    assert 2.99 <= accountant.epsilon(z, 0.1, 30, 1e-5) <= 3.0
    assert accountant.epsilon(z * 0.9, 0.1, 30, 1e-5) > 3.0
    config = make_config(Path("/nonexistent"), "b", 20, 30, privacy={"mode": "central", "clip_norm": 1.0,
                         "target_epsilon": 3.0, "delta": 1e-5}, fraction=0.1)  # fmt: skip
    b = budget_of(config)
    assert b.derived and b.noise_multiplier == pytest.approx(z, rel=1e-3) and b.epsilon(30) <= 3.0


@pytest.mark.parametrize(
    ("privacy", "extra", "names"),
    [
        ({"mode": "central", "noise_multiplier": 1.0}, {}, "privacy.clip_norm"),
        ({"mode": "central", "clip_norm": 1.0}, {}, "privacy.noise_multiplier"),
        ({"mode": "central", "clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 0.5}, {}, "privacy.delta"),
        ({"mode": "global", "clip_norm": 1.0, "noise_multiplier": 1.0}, {}, "privacy.mode"),
        ({"noise_multiplier": 1.0}, {}, "privacy.noise_multiplier is set but privacy.mode = 'off'"),
        ({"mode": "local", "clip_norm": 1.0, "noise_multiplier": 1.0, "adaptive_clipping": True}, {},
         "privacy.adaptive_clipping"),
        ({"mode": "central", "clip_norm": 1.0, "noise_multiplier": 1.0}, {"train": {"algorithm": "taco"}},
         "train.algorithm = 'taco' refuses"),
        ({"mode": "central", "clip_norm": 1.0, "noise_multiplier": 1.0}, {"algorithm_params": {"weighting": "samples"}},
         "[algorithm.fedavg] weighting = 'samples'"),
        ({"mode": "central", "clip_norm": 1.0, "noise_multiplier": 1.0}, {"train": {"algorithm": "fednova"}},
         "[algorithm.fednova] local_steps_mode = 'epochs'"),
    ],
)  # fmt: skip
def test_config_refusals_name_the_key(tmp_path: Path, privacy: dict, extra: dict, names: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        make_config(tmp_path, "refused", 3, 2, privacy=privacy, **extra)
    assert names in str(err.value)


def test_every_contract_declares_dp_and_only_compatible_ones_accept_its_values() -> None:
    accepted = {n for n, c in CONTRACTS.items() if not c.dp_refusal}
    assert accepted == {"fedavg", "fedprox", "scaffold", "fednova", "stem", "fedacg"}
    sent = {"dp_clip_norm": 1.0, "dp_noise_std": 0.1}
    fedavg = contract_of("fedavg")
    fedavg.check_plan(Plan(5, 0.1, 8, {**fedavg.example_sent(), **sent}), 4)  # accepted
    with pytest.raises(ContractError, match="dp_clip_norm"):
        fedavg.check_plan(Plan(5, 0.1, 8, {**fedavg.example_sent(), "dp_clip_norm": 0.0}), 4)  # and bounded
    assert fedavg.check_returned(fedavg.resolve(), {"dp_within": 1}, {}, 4) == []
    assert fedavg.check_returned(fedavg.resolve(), {"dp_within": 7}, {}, 4)[0][0] == "invalid_field"
    taco = contract_of("taco")
    with pytest.raises(ContractError, match="dp_clip_norm"):
        taco.check_plan(Plan(5, 0.1, 8, {**taco.example_sent(), **sent}), 4)


def test_the_run_stops_before_it_would_exceed_target_epsilon(tmp_path: Path) -> None:
    """In-process: z = 1 on all 3 devices spends 3.6, 5.5, 7.0 after rounds 1-3 at delta 1e-3: a budget of 6 allows
    2 rounds."""
    per_round = [accountant.epsilon(1.0, 1.0, r, 1e-3) for r in (1, 2, 3)]
    assert per_round[1] <= 6.0 < per_round[2]
    privacy = {"mode": "central", "clip_norm": 1.0, "noise_multiplier": 1.0, "target_epsilon": 6.0, "delta": 1e-3}
    config = make_config(tmp_path, "budget", 3, 5, train={"local_steps": 5}, privacy=privacy)
    summary, _, _ = run_simulated("inprocess", config, load_dataset("digits", seed=0), None)  # type: ignore[arg-type]
    rows = [json.loads(line) for line in (tmp_path / "budget" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert [r["epsilon"] for r in rows] == pytest.approx(per_round[:2])
    assert summary["privacy"]["epsilon"] == pytest.approx(per_round[1])
    assert "stopped before round 3" in summary["privacy"]["stopped_by_budget"]


def test_the_guide_lists_every_algorithm_as_its_contract_declares() -> None:
    assert dp_markdown() in (Path(__file__).resolve().parents[4] / "docs" / "privacy.md").read_text()
