"""edge_client.tools.speed: structure of the results, no timing assertions (timings depend on the machine)."""

from __future__ import annotations

import json
import math
import sys
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from edge_client.algorithms import CLIENT_ALGORITHMS, CONTRACTS
from edge_client.algorithms.base import ClientAlgorithm, LocalContext
from edge_client.algorithms.contract import Array, Contract, Setting
from edge_client.tools.speed import benchmark, format_table

MLP = {"name": "mlp", "in_features": 64, "num_classes": 10}


@pytest.fixture(scope="module")
def tiny() -> list[dict[str, Any]]:
    return benchmark({"mlp-digits": MLP}, None, steps=5, batch_size=16, repeats=1, threads=1, inference_repeats=3)


def test_every_registered_algorithm_appears(tiny: list[dict[str, Any]]) -> None:
    assert tiny[0]["algorithm"] == "fedavg"
    assert sorted(r["algorithm"] for r in tiny) == sorted(CLIENT_ALGORITHMS)
    assert {r["model"] for r in tiny} == {"mlp-digits"}


def test_record_structure(tiny: list[dict[str, Any]]) -> None:
    for r in tiny:
        assert r["spec"] == MLP
        assert (r["steps"], r["batch_size"], r["repeats"], r["threads"]) == (5, 16, 1, 1)
        assert math.isfinite(r["s_per_100"]) and r["s_per_100"] > 0
        assert math.isfinite(r["cpu_s_per_100"]) and r["cpu_s_per_100"] >= 0
        assert len(r["runs_s_per_100"]) == 1
        assert r["ratio_to_fedavg"] is not None and math.isfinite(r["ratio_to_fedavg"])
        assert set(r["device"]) >= {"cpu_freq_mhz_before", "temperature_c_after", "throttled_flags", "peak_rss_mb"}
    json.dumps(tiny)  # the CLI writes it with --out


def test_fedavg_ratio_is_one(tiny: list[dict[str, Any]]) -> None:
    (fedavg,) = [r for r in tiny if r["algorithm"] == "fedavg"]
    assert fedavg["ratio_to_fedavg"] == 1.0


def test_inference_latency_on_the_first_record(tiny: list[dict[str, Any]]) -> None:
    first, *rest = tiny
    assert set(first["inference"]) == {"batch_1", "batch_64"}
    assert first["inference"]["batch_1"]["batch"] == 1 and first["inference"]["batch_64"]["batch"] == 64
    for lat in first["inference"].values():
        assert lat["median_ms"] > 0 and lat["p90_ms"] >= lat["median_ms"]
    assert all(r["inference"] is None for r in rest)


def test_format_table(tiny: list[dict[str, Any]]) -> None:
    table = format_table(tiny)
    assert "seconds per 100 local updates" in table
    assert "mlp-digits" in table
    for name in CLIENT_ALGORITHMS:
        assert name in table
    assert "+0.0%" in table  # fedavg over itself
    assert "batch 1" in table and "batch 64" in table


class NeedsArraysClient(ClientAlgorithm):
    """A client half the benchmark has never heard of: its contract asks for an array and a coefficient."""

    contract = Contract(
        "test-needs-arrays",
        "a prox term towards a server-sent anchor",
        settings=(Setting("kappa", float, 0.01, "prox coefficient", low=0.0, device=True),),
        sends=(Array("anchor", "the prox centre"),),
    )
    kappas: ClassVar[list[float]] = []  # every coefficient a round was run with

    def begin_round(self, ctx: LocalContext) -> None:
        self.anchor = ctx.array("anchor")
        self.kappa = float(ctx.setting("kappa"))
        self.kappas.append(self.kappa)

    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        ctx.flat.grad.add_(ctx.flat.params - self.anchor, alpha=self.kappa)

    def end_round(self, ctx: LocalContext, delta: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return {}, {}


def test_arrays_and_settings_come_from_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    name = NeedsArraysClient.contract.name
    monkeypatch.setitem(CLIENT_ALGORITHMS, name, NeedsArraysClient)
    monkeypatch.setitem(CONTRACTS, name, NeedsArraysClient.contract)
    monkeypatch.setattr(NeedsArraysClient, "kappas", [])
    threads = torch.get_num_threads()
    results = benchmark([MLP], ["fedavg", name], steps=3, batch_size=8, repeats=2, threads=1, inference=False)
    assert torch.get_num_threads() == threads  # restored
    assert [r["algorithm"] for r in results] == ["fedavg", name]
    custom = results[1]
    assert custom["arrays"] == ["anchor"]
    assert NeedsArraysClient.kappas and set(NeedsArraysClient.kappas) == {0.01}  # the contract's default
    assert len(custom["runs_s_per_100"]) == 2
    assert all(r["inference"] is None for r in results)


def test_without_fedavg_there_is_no_ratio() -> None:
    other = next((a for a in CLIENT_ALGORITHMS if a != "fedavg"), "fedavg")
    results = benchmark([MLP], [other], steps=2, batch_size=8, repeats=1, inference=False)
    if other == "fedavg":  # only FedAvg registered: nothing else to compare
        assert results[0]["ratio_to_fedavg"] == 1.0
        return
    assert results[0]["ratio_to_fedavg"] is None
    row = next(line for line in format_table(results).splitlines() if line.startswith(other))
    assert "%" not in row


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown algorithm"):
        benchmark([MLP], ["no-such-algorithm"], steps=1, repeats=1, inference=False)
    with pytest.raises(ValueError, match=">= 1"):
        benchmark([MLP], ["fedavg"], steps=0)


def test_without_onnx_the_training_figures_still_come(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A device has onnxruntime but not onnx (needed to export): the benchmark says so instead of failing."""
    monkeypatch.setitem(sys.modules, "onnx", None)
    with caplog.at_level("WARNING"):
        results = benchmark([MLP], ["fedavg"], steps=2, batch_size=8, repeats=1, inference_repeats=2)
    assert results[0]["s_per_100"] > 0 and results[0]["inference"] is None
    assert "needs the onnx package" in caplog.text
