"""Every algorithm's contract is declared once and both halves, config validation, ``--help`` and the docs use it:
settings round-trip, and a setting missing or out of range fails the same way for every algorithm."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_client.algorithms import CLIENT_ALGORITHMS, CONTRACTS, client_algorithm
from edge_client.algorithms.contract import ContractError, Setting, checked_norm, settings_markdown, vector_norm
from edge_client.learning.data import ArrayDataset
from edge_client.wire.plan import Plan
from server.cli import main as server_main
from server.config import ConfigError, from_dict
from server.strategies import STRATEGIES, ServerContext, TrainSettings, make_strategy

REPO = Path(__file__).resolve().parents[4]
SETTINGS = [(name, s) for name, c in CONTRACTS.items() for s in c.all_settings]


def bad_value(s: Setting) -> Any:
    """A value outside what ``s`` allows, of the right type where possible."""
    if s.kind is bool:
        return "yes"
    if s.choices:
        return "no-such-choice"
    if s.kind is str:
        return 7
    if s.low is not None:
        return s.kind(s.low) if s.low_open else s.kind(s.low - 1)
    if s.high is not None:
        return s.kind(s.high + 1)
    return "not a number"


def test_both_halves_share_one_contract_per_algorithm() -> None:
    assert set(STRATEGIES) == set(CLIENT_ALGORITHMS) == set(CONTRACTS)
    for name, strategy in STRATEGIES.items():
        assert strategy.contract is CLIENT_ALGORITHMS[name].contract is CONTRACTS[name]


@pytest.mark.parametrize(("algorithm", "setting"), SETTINGS, ids=[f"{a}.{s.name}" for a, s in SETTINGS])
def test_setting_round_trips_and_fails_uniformly(algorithm: str, setting: Setting) -> None:
    config = from_dict({"train": {"algorithm": algorithm}, "algorithm": {algorithm: {setting.name: setting.default}}})
    strategy = make_strategy(algorithm, TrainSettings(5, 0.1, 8), config.algorithm_params())
    assert strategy.params[setting.name] == setting.default
    bad = bad_value(setting)
    with pytest.raises(ConfigError) as info:
        from_dict({"algorithm": {algorithm: {setting.name: bad}}})
    expected = f"[algorithm.{algorithm}]: {algorithm}.{setting.name} = {bad!r}: expected {setting.allowed()}"
    assert str(info.value) == expected


def test_unknown_setting_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"fedprox\.mu: not a setting of fedprox; valid settings: zeta, weighting"):
        from_dict({"algorithm": {"fedprox": {"mu": 0.1}}})


def test_help_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("simulate", "run"):
        with pytest.raises(SystemExit):
            server_main([command, "--help"])
        text = capsys.readouterr().out
        for algorithm, contract in CONTRACTS.items():
            assert f"  {algorithm}: {contract.description}" in text
        for _, s in SETTINGS:
            assert f"    {s.name} = {s.default!r}  ({s.allowed()})" in text


def test_docs_table_is_the_contracts() -> None:
    assert settings_markdown(CONTRACTS.values()) in (REPO / "docs" / "algorithms.md").read_text()


def full_plan(algorithm: str, size: int) -> Plan:
    """What a server would send: the contract's device settings and per-round values, and every array."""
    contract = CONTRACTS[algorithm]
    arrays = {a.name: np.zeros(size, np.float32) for a in contract.sends}
    return Plan(2, 0.1, 4, contract.example_sent(), arrays, weights=np.zeros(size, np.float32))


@pytest.mark.parametrize("algorithm", sorted(CONTRACTS))
def test_device_refuses_what_its_contract_does_not_allow(algorithm: str) -> None:
    contract, size = CONTRACTS[algorithm], 6
    a = full_plan(algorithm, size)
    sent = dict(a.settings)

    def check(plan: Plan) -> Plan:
        client_algorithm(algorithm).contract.check_plan(plan, size)
        return plan

    assert check(replace(a)).settings == sent
    for s in (s for s in contract.all_settings if s.device):  # missing or out of range: one shape of error
        missing = {k: v for k, v in a.settings.items() if k != s.name}
        with pytest.raises(ContractError, match=rf"^{re.escape(algorithm)}\.{s.name}: missing from the assignment"):
            check(replace(a, settings=missing))
        bad = {**a.settings, s.name: bad_value(s)}
        with pytest.raises(ContractError, match=rf"^{re.escape(algorithm)}\.{s.name} = .*: expected "):
            check(replace(a, settings=bad))
    undeclared = {**a.settings, "undeclared": 1.0}
    with pytest.raises(ContractError, match=rf"^{re.escape(algorithm)}\.undeclared: "):
        check(replace(a, settings=undeclared))
    with pytest.raises(ContractError, match=rf"^{re.escape(algorithm)}\.stray: "):
        check(replace(a, arrays={**a.arrays, "stray": np.zeros(size, np.float32)}))
    for arr in contract.sends:
        wrong = {**a.arrays, arr.name: np.zeros(size + 1, np.float32)}
        with pytest.raises(ContractError, match=rf"^{re.escape(algorithm)}\.{arr.name}: expected shape"):
            check(replace(a, arrays=wrong))
    for v in (v for v in contract.sends_values if v.required):  # per-round values: TACO's alpha_i, FedVeca's P
        without = {k: x for k, x in a.settings.items() if k != v.name}
        with pytest.raises(ContractError, match=rf"^{re.escape(algorithm)}\.{v.name}: missing"):
            check(replace(a, settings=without))


@pytest.mark.parametrize("algorithm", sorted(CONTRACTS))
def test_server_sends_exactly_what_the_contract_declares(algorithm: str) -> None:
    """A plan made by the server half passes the device's check, for every algorithm."""
    strategy = make_strategy(algorithm, TrainSettings(3, 0.1, 4), {}, rounds=5)
    root = ArrayDataset(np.zeros((8, 5), np.float32), np.zeros(8, np.int64))
    spec = {"name": "mlp", "in_features": 5, "num_classes": 2, "hidden": []}
    strategy.setup(ServerContext(spec, 12, {"c0": 10}, root))
    size = 12
    plan = strategy.assign(1, "c0")
    client_algorithm(algorithm).contract.check_plan(plan, size)
    assert set(plan.settings) >= {s.name for s in CONTRACTS[algorithm].all_settings if s.device}
    assert all(math.isfinite(float(v)) for v in plan.settings.values() if isinstance(v, int | float))


def test_vector_norm_is_numpys_float32_norm_in_one_read_and_tells_overflow_from_non_finite() -> None:
    rng = np.random.default_rng(0)
    for size in (1, 1000, 100_003):
        v = rng.normal(size=size).astype(np.float32)
        assert vector_norm(v) == float(np.linalg.norm(v))  # bit for bit: the strategies reuse admission's norm
    huge = np.full(4, 3e38, np.float32)  # finite, but its float32 sum of squares overflows
    assert vector_norm(huge) == pytest.approx(6e38, rel=1e-6)
    assert checked_norm("delta", huge, 4, 1e4)[1][0][0] == "norm"
    for bad in (np.array([1.0, np.nan], np.float32), np.array([np.inf, -np.inf], np.float32)):
        assert not math.isfinite(vector_norm(bad))
        assert checked_norm("delta", bad, 2, 1e4)[1][0][0] == "non_finite"
    assert checked_norm("delta", rng.normal(size=3).astype(np.float32), 4, 1e4)[1][0][0] == "shape"
