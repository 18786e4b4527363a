"""`[bench] match_steps`: baselines given the total local steps another algorithm ran (FedVeca sec. IV-A1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from server.config import ConfigError
from server.experiments.matched_steps import matched, source_record
from server.experiments.runner import run_suite
from server.experiments.suites import parse_suite

BENCH = {"algorithms": ["fedavg", "fednova", "fedveca"], "partitions": ["iid"], "seeds": [0], "match_steps": "fedveca"}


def _source(steps_per_round: list[int], trained: int, samples: dict[str, int]) -> dict:
    curve = [{"round": k, "local_steps": s, "trained": trained} for k, s in enumerate(steps_per_round, 1)]
    return {"variant": "default", "partition": "iid", "seed": 0, "algorithm": "fedveca", "path": "p",
            "curve": curve, "client_samples": samples}  # fmt: skip


def test_fednova_gets_the_papers_e_avg_and_every_baseline_the_mean_steps() -> None:
    specs = {s.algorithm: s for s in parse_suite("x", {"bench": BENCH, "train": {"batch_size": 10}}, "x").runs()}
    # 4 clients, 3 rounds, 60 steps in all: tau_mean = 5; D = 1000, so E_avg = tau_all / K x B / D = 20 x 10 / 1000
    source = _source([20, 28, 12], 4, {"a": 100, "b": 200, "c": 300, "d": 400})
    nova, derived = matched(specs["fednova"], source)
    assert nova.config.algorithm["fednova"]["epochs"] == pytest.approx(0.2)
    assert derived == {"source": "fedveca", "source_local_steps": 60, "tau_mean": 5.0, "local_steps": 5,
                       "epochs": pytest.approx(0.2)}  # fmt: skip
    avg, derived = matched(specs["fedavg"], source)
    assert avg.config.train.local_steps == 5 and "epochs" not in derived
    assert "fedavg" not in avg.config.algorithm and specs["fedavg"].config.train.local_steps == 50  # a copy
    # partial participation: the mean over the clients that trained (2 of 4 per round here)
    partial = _source([20, 28, 12], 2, source["client_samples"])
    assert matched(specs["fedavg"], partial)[0].config.train.local_steps == 10


def test_the_source_must_be_in_the_suite_and_have_run() -> None:
    with pytest.raises(ConfigError, match=r"bench\.match_steps must name one of bench\.algorithms"):
        parse_suite("x", {"bench": {**BENCH, "match_steps": "taco"}}, "x")
    spec = parse_suite("x", {"bench": BENCH}, "x").runs()[0]
    with pytest.raises(ConfigError, match=r"bench\.match_steps = 'fedveca'.*keep fedveca in bench\.algorithms"):
        source_record([], spec, "fedveca")


def test_a_bench_runs_the_source_first_and_the_baselines_at_its_total_steps(tmp_path: Path) -> None:
    """Real in-process runs on digits; FedVeca is listed last, so the runner must reorder the cell."""
    bench = {**BENCH, "algorithms": ["fedavg", "fedveca"]}
    data = {"bench": bench, "run": {"rounds": 3}, "clients": {"count": 3}, "data": {"dataset": "digits"},
            "train": {"batch_size": 32, "lr": 0.05}, "algorithm": {"fedveca": {"tau_init": 3}}}  # fmt: skip
    run_suite(parse_suite("x", data, "x"), tmp_path, console=Console(quiet=True))
    records = json.loads((tmp_path / "records.json").read_text())
    assert [r["algorithm"] for r in records] == ["fedveca", "fedavg"]
    veca, avg = records
    tau_all = sum(p["local_steps"] for p in veca["curve"])
    assert veca["curve"][0]["local_steps"] == 3 * 3 and "matched_steps" not in veca
    assert avg["matched_steps"]["source_local_steps"] == tau_all
    assert all(p["local_steps"] == 3 * round(tau_all / 9) for p in avg["curve"])
