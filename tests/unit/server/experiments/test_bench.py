"""`edge-server bench`: suites, the grid, the tables in the papers' layouts. The smoke suite end to end, as a command:
tests/integration/test_bench.py."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from server.config import ConfigError
from server.experiments.runner import round_alphas
from server.experiments.suites import load_suite, parse_suite, shipped
from server.experiments.tables import (
    accuracy_table,
    alpha_rounds_csv,
    alpha_table,
    compute_table,
    fleet_table,
    freeloader_table,
    plot_alphas,
    time_table,
)

PAPER_SUITES = [
    "taco-fmnist",
    "taco-adult",
    "taco-freeloaders",
    "taco-ablation",
    "fedumf-mnist",
    "drag-mnist",
    "fedveca-mnist",
]


def _record(algorithm: str, seed: int, acc: float, reached: int | None, *, column: str = "iid", **summary: Any) -> dict:
    """A finished run of 50 rounds whose accuracy is 0.5 until round ``reached`` and ``acc`` from then on."""
    curve = [
        {
            "round": k,
            "accuracy": acc if reached is not None and k >= reached else 0.5,
            "elapsed_s": 10.0 * k,
            "slowest_compute_s": 4.0,
            "compute_s": 2.0,
            "local_steps": 100,
        }
        for k in range(1, 51)
    ]
    return {
        "algorithm": algorithm,
        "seed": seed,
        "column": column,
        "summary": {"final_accuracy": acc, "rounds": 50, "clients": 10, **summary},
        "curve": curve,
    }


def test_accuracy_table_has_the_layout_of_taco_table_v() -> None:
    records = [
        _record("fedavg", 0, 0.70, 20),
        _record("fedavg", 1, 0.72, 30),
        _record("taco", 0, 0.80, 10),
        _record("taco", 1, 0.60, None),
        _record("fedprox", 0, 0.30, None),
        _record("fedprox", 1, 0.30, None),
    ]
    header, rows = accuracy_table(records, 0.7)
    assert header == ["Method", "iid Acc(%) 50R", "iid Rounds (70%)"]
    assert rows[0] == ["fedavg", "71.00±1.00", "25"]
    assert rows[1] == ["taco", "70.00±10.00", "10 (1/2)"]  # only one of two seeds reached the target
    assert rows[2] == ["fedprox", "30.00±0.00", "x"]  # never reached


def test_time_and_compute_tables() -> None:
    records = [_record("fedavg", 0, 0.7, 20), _record("stem", 0, 0.7, 10)]
    for point in records[1]["curve"]:
        point["compute_s"] = 3.0  # 1.5x FedAvg's compute for the same 100 local updates
    _, rows = time_table(records, 0.7)
    assert rows == [["fedavg", "200", "80"], ["stem", "100", "40"]]
    _, rows = compute_table(records)
    assert rows == [["fedavg", "2.000s (+0.00%)", "5,000"], ["stem", "3.000s (+50.00%)", "5,000"]]


def test_the_parallel_clock_column_and_the_fleet_table_appear_only_for_fleets() -> None:
    fleet = {"spec": "pi4:1,pi3:1"}
    classes = {"pi3": {"rounds_missed": 2, "s_per_100_steps": 4.0}, "pi4": {"rounds_missed": 0, "s_per_100_steps": 1.0}}
    records = [_record("fedavg", 0, 0.7, 20, fleet=fleet, per_class=classes), _record("fedavg", 1, 0.7, 10)]
    for record, per_round in zip(records, (3.0, None), strict=True):
        for point in record["curve"]:
            point["parallel_elapsed_s"] = per_round and per_round * point["round"]
    header, rows = time_table(records, 0.7)
    assert header[1:3] == ["iid wall clock to 70% (s)", "iid parallel clock to 70% (s)"]
    assert rows == [["fedavg", "150", "60 (1/2)", "60"]]  # only the fleet run kept the parallel clock
    header, rows = fleet_table(records)
    assert rows == [["fedavg", "pi3 2 · pi4 0", "pi3 4 · pi4 1"]]
    assert fleet_table([_record("fedavg", 0, 0.7, 20)]) is None
    assert time_table([_record("fedavg", 0, 0.7, 20)], 0.7)[0][1:] == [
        "iid wall clock to 70% (s)", "iid client compute (device clock) to 70% (s)"]  # fmt: skip


def test_freeloader_table_counts_true_and_false_positives() -> None:
    records = [
        _record("taco", 0, 0.7, 5, freeloaders=["c8", "c9"], excluded=["c8", "c9", "c0"]),
        _record("fedavg", 0, 0.7, 5, freeloaders=["c8", "c9"], excluded=[]),
    ]
    header, rows = freeloader_table(records)
    assert header == ["Method", "iid TPR", "iid FPR"]
    assert rows == [["taco", "100.0%", "12.5%"], ["fedavg", "0.0%", "0.0%"]]
    assert freeloader_table([_record("taco", 0, 0.7, 5)]) is None  # no freeloaders: no table


def _alpha_record(alphas: dict[int, dict[str, float]], **summary: Any) -> dict:
    """A 3-round TACO run on taco-groups (6 clients: groups A, B, C, A, B, C) with the given alphas per round."""
    record = _record("taco", 0, 0.7, 1, column="taco-groups", **{"clients": 6, **summary})
    record.update(partition="taco-groups", variant="default", path="default/taco-groups/taco/seed-0")
    record["curve"] = record["curve"][:3]
    for point in record["curve"]:
        point["alpha"] = alphas.get(point["round"], {})
    return record


def test_alpha_table_is_table_ii_per_group_from_round_2(tmp_path: Path) -> None:
    alphas = {
        1: {"client-00": 0.9, "client-05": 0.0},  # round 1 is left out of the table
        2: {"client-00": 0.2, "client-03": 0.4, "client-01": 0.3, "client-02": 0.5, "client-05": 0.8},
        3: {"client-00": 0.1, "client-03": 0.1, "client-01": 0.3, "client-02": 0.5},  # client-05 expelled
    }
    record = _alpha_record(alphas, freeloaders=["client-05"], excluded=["client-05"])
    header, rows = alpha_table([record, _record("fedavg", 0, 0.7, 1, column="taco-groups")])
    assert header == ["Method"] + [f"taco-groups alpha {g}" for g in ("Group A", "Group B", "Group C", "Freeloaders")]
    # group A: round means 0.3 and 0.1 -> 0.20±0.10; B 0.3, 0.3; C 0.5, 0.5; freeloaders 0.8 in round 2 only
    assert rows == [["taco", "0.20±0.10", "0.30±0.00", "0.50±0.00", "0.80±0.00"]]
    assert alpha_table([_record("fedavg", 0, 0.7, 1)]) is None  # no alphas: no table
    alpha_rounds_csv([record], tmp_path / "a.csv")
    lines = list(csv.reader((tmp_path / "a.csv").open()))
    assert lines[0] == ["column", "row", "round", "Group A", "Group B", "Group C", "Honest", "Freeloaders"]
    assert lines[1] == ["taco-groups", "taco", "1", "0.9000", "", "", "", "0.0000"]
    assert lines[3] == ["taco-groups", "taco", "3", "0.1000", "0.3000", "0.5000", "", ""]
    plot_alphas(record, tmp_path / "alpha.png")
    assert (tmp_path / "alpha.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_records_keep_per_client_alphas_only() -> None:
    row = {"clients": {"c0": {}, "c1": {}}, "algorithm": {"alpha": {"c0": 0.3, "c1": 0.5, "gone": 0.9}}}
    assert round_alphas(row) == {"alpha": {"c0": 0.3, "c1": 0.5}}  # the reporters' alphas, not an expelled client's
    assert round_alphas({"clients": {"c0": {}}, "algorithm": {"alpha": 0.2}}) == {}  # STEM's scalar alpha_t
    assert round_alphas({"clients": {"c0": {}}, "algorithm": {}}) == {}


def test_an_ablation_has_its_variants_as_rows() -> None:
    records = []
    for variant, acc in (("corr", 0.8), ("none", 0.6)):
        for column in ("dir:0.1", "dir:0.5"):
            r = _record("taco", 0, acc, 5, column=f"{variant} · {column}")
            r.update(variant=variant, partition=column)
            records.append(r)
    header, rows = accuracy_table(records, 0.7)
    assert header == [
        "Variant",
        "dir:0.1 Acc(%) 50R",
        "dir:0.1 Rounds (70%)",
        "dir:0.5 Acc(%) 50R",
        "dir:0.5 Rounds (70%)",
    ]
    assert rows == [["corr", "80.00±0.00", "5", "80.00±0.00", "5"], ["none", "60.00±0.00", "x", "60.00±0.00", "x"]]


def test_every_shipped_suite_is_valid_and_the_paper_suites_ship() -> None:
    assert {*PAPER_SUITES, "smoke"} <= set(shipped())
    for name in shipped():
        suite = load_suite(name)
        runs = suite.runs()  # before a ranking: the rows a variant names (not its best:N), its seeds, and more_seeds
        expected = 0
        for v in suite.variants:
            rows = [a for a in v.algorithms or suite.algorithms if not a.startswith("best:")]
            more = 0 if v.seeds else len(suite.more_seeds) * len(set(rows) & set(suite.more_seeds_for))
            expected += (len(rows) * len(v.seeds or suite.seeds) + more) * len(suite.partitions)
        assert len(runs) == expected
        assert suite.description
        if name in PAPER_SUITES:
            assert suite.paper and suite.scaled  # the paper's numbers and what was scaled down are stated


def test_suite_errors_name_the_key() -> None:
    base = {"bench": {"algorithms": ["fedavg"], "partitions": ["iid"], "seeds": [0]}}
    with pytest.raises(ConfigError, match=r"bench\.seeds"):
        parse_suite("x", {"bench": {**base["bench"], "seeds": ["a"]}}, "x.toml")
    with pytest.raises(ConfigError, match=r"bench\.colour"):
        parse_suite("x", {"bench": {**base["bench"], "colour": 1}}, "x.toml")
    with pytest.raises(ConfigError, match=r"train\.lr"):
        parse_suite("x", {**base, "train": {"lr": -1.0}}, "x.toml")
    with pytest.raises(ConfigError, match="unknown suite 'nope'"):
        load_suite("nope")


def test_variants_override_the_base_configuration() -> None:
    data = {
        "bench": {
            "algorithms": ["fedavg", "fedumf"],
            "partitions": ["shards:2"],
            "seeds": [0],
            "variants": [
                {"name": "C=0.1", "clients": {"fraction": 0.1}},
                {"name": "C=0.5", "clients": {"fraction": 0.5}},
            ],
        },
        "clients": {"count": 20},
    }
    runs = parse_suite("x", data, "x.toml").runs()
    assert [(r.variant, r.algorithm, r.config.clients.fraction) for r in runs] == [
        ("C=0.1", "fedavg", 0.1),
        ("C=0.1", "fedumf", 0.1),
        ("C=0.5", "fedavg", 0.5),
        ("C=0.5", "fedumf", 0.5),
    ]
    assert all(r.config.clients.count == 20 and r.config.data.partition == "shards:2" for r in runs)
    assert runs[0].column == "C=0.1 · shards:2"
    data["bench"]["variants"][1]["algorithms"] = ["fedumf"]  # a variant may run only some of the algorithms
    runs = parse_suite("x", data, "x.toml").runs()
    assert [(r.variant, r.algorithm) for r in runs] == [("C=0.1", "fedavg"), ("C=0.1", "fedumf"), ("C=0.5", "fedumf")]
    data["bench"]["variants"][1]["algorithms"] = ["drag"]
    with pytest.raises(ConfigError, match=r"bench\.variants\[1\]\.algorithms.*drag"):
        parse_suite("x", data, "x.toml")


def test_an_algorithm_override_applies_to_its_runs_only() -> None:
    data = {
        "bench": {
            "algorithms": ["fedavg", "fednova"],
            "partitions": ["iid"],
            "seeds": [0],
            "overrides": {"fednova": {"train": {"steps_policy": "deadline", "round_budget_s": 2.0}}},
        },
    }
    runs = parse_suite("x", data, "x.toml").runs()
    assert [(r.algorithm, r.config.train.steps_policy, r.config.train.round_budget_s) for r in runs] == [
        ("fedavg", "fixed", 0.0),
        ("fednova", "deadline", 2.0),
    ]
    with pytest.raises(ConfigError, match=r"bench\.overrides\.NAME"):
        parse_suite("x", {"bench": {**data["bench"], "overrides": {"fednova": 1}}}, "x.toml")
