"""The fleet leaderboard (issue 24): the suite's rows in configurations of their own (``fedveca@deadline``), more seeds
for FedAvg and the best rows of a ranking, variants with their own mode and seeds, and the leaderboard document and
plot that ``python -m benchmarks.fleet --leaderboard`` writes from a real (tiny) in-process run."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.fleet import build_parser, leaderboard
from server.config import ConfigError
from server.experiments import leaderboard as board
from server.experiments.runner import rank
from server.experiments.suites import load_suite, parse_suite

SUITE = {
    "run": {"rounds": 3, "target_accuracy": 0.9},
    "data": {"dataset": "digits"},
    "bench": {
        "algorithms": ["fedavg", "fednova", "fednova@deadline", "fedveca"],
        "partitions": ["iid"],
        "seeds": [0],
        "more_seeds": [1, 2],
        "more_seeds_for": ["fedavg", "best:2"],
        "overrides": {"fednova@deadline": {"train": {"steps_policy": "deadline", "round_budget_s": 2.0}}},
        "variants": [
            {"name": "a"},
            {"name": "b", "algorithms": ["fedavg", "best:1"], "mode": "broker", "seeds": [5]},
        ],
    },
}


def record(row: str, column: str, accuracies: list[float], *, mode: str = "inprocess", seed: int = 0) -> dict:
    """A bench record of a run of two devices whose rounds each take 10 s of the parallel clock and whose links carry
    2 MB each a round."""
    links = {"client-00": 2_000_000, "client-01": 2_000_000}
    curve = [{"round": i + 1, "accuracy": a, "parallel_elapsed_s": 10.0 * (i + 1), "elapsed_s": 20.0 * (i + 1),
              "device_bytes": links} for i, a in enumerate(accuracies)]  # fmt: skip
    summary = {"final_accuracy": accuracies[-1], "clients": 2, "per_class": {"pi4": {"rounds_missed": 1}}}
    return {"algorithm": row, "column": column, "mode": mode, "seed": seed, "target": 0.9, "curve": curve,
            "summary": summary}  # fmt: skip


def test_rows_in_their_own_configuration_more_seeds_for_the_best_and_variants_of_their_own() -> None:
    suite = parse_suite("t", SUITE, "test")
    first = suite.runs()
    assert suite.ranked() and suite.ranking_column() == "a · iid"
    deadline = next(s for s in first if s.algorithm == "fednova@deadline")
    assert (deadline.config.train.algorithm, deadline.config.train.steps_policy) == ("fednova", "deadline")
    assert next(s for s in first if s.algorithm == "fednova").config.train.steps_policy == "fixed"
    # before the ranking: every row once in "a" plus FedAvg's more seeds; only FedAvg (seed 5, broker) in "b"
    assert sorted((s.variant, s.algorithm, s.seed, s.mode) for s in first if s.seed or s.variant == "b") == [
        ("a", "fedavg", 1, "inprocess"), ("a", "fedavg", 2, "inprocess"), ("b", "fedavg", 5, "broker")]  # fmt: skip
    curves = {"fedavg": [0.5, 0.8, 0.95], "fednova": [0.5, 0.92, 0.93], "fednova@deadline": [0.91, 0.95, 0.96],
              "fedveca": [0.5, 0.6, 0.7]}  # fmt: skip
    records = [record(row, "a · iid", accuracies) for row, accuracies in curves.items()]
    ranking = rank(records, "a · iid")
    assert ranking == ["fednova@deadline", "fednova", "fedavg", "fedveca"]  # never reached: last
    second = {(s.variant, s.algorithm, s.seed) for s in suite.runs(ranking)} - {(s.variant, s.algorithm, s.seed)
                                                                                for s in first}  # fmt: skip
    assert second == {("a", "fednova@deadline", 1), ("a", "fednova@deadline", 2), ("a", "fednova", 1),
                      ("a", "fednova", 2), ("b", "fednova@deadline", 5)}  # fmt: skip
    assert {s.mode for s in suite.runs(ranking, mode="inprocess")} == {"inprocess"}  # bench --mode wins
    bad = {**SUITE, "bench": {**SUITE["bench"], "more_seeds_for": ["fedprox"]}}
    with pytest.raises(ConfigError, match=r"bench.more_seeds_for names \['fedprox'\], not in bench.algorithms"):
        parse_suite("t", bad, "test")


def test_the_shipped_suite_has_every_algorithm_and_both_deadline_rows() -> None:
    suite = load_suite("fleet-noniid")
    assert len({a.partition("@")[0] for a in suite.algorithms}) == 14
    runs = suite.runs()
    deadline = {s.algorithm for s in runs if s.config.train.steps_policy == "deadline"}
    assert deadline == {"fednova@deadline", "fedveca@deadline", "fedveca@fleet", "fednova@buffered-deadline"}
    fleet = next(s for s in runs if s.algorithm == "fedveca@fleet")  # FedVeca's recommended fleet configuration
    assert fleet.config.algorithm_params()["tau_floor"] == 50
    by_column = {s.column: s for s in runs}
    assert {s.config.data.dataset for s in runs} == {"mnist", "fmnist"}
    hot = next(s for c, s in by_column.items() if "throttle" in c).config.fleet
    assert hot.devices == "pi5:2,pi4-hot:2,pi4:3,pi3:3" and hot.profiles["pi4-hot"]["throttle_from_round"] == 10
    assert {s.mode for s in runs if "broker" in s.column} == {"broker"}


def test_the_leaderboard_ranks_by_time_to_target_with_the_spread_over_seeds() -> None:
    rows = {"fedavg": [record("fedavg", "c", [0.5, 0.95], seed=s) for s in (0, 1)],
            "fast": [record("fast", "c", [0.91, 0.95])], "never": [record("never", "c", [0.5, 0.6])]}  # fmt: skip
    header, body = board.column_table(rows)
    assert header == ["#", "row", *board.COLUMNS]
    fast, fedavg, never = body
    assert fast[1:7] == ["fast", "10.0", "0.50x", "1.0", "95.00", "2.00"]  # reached in round 1: 2 MB per device
    assert fedavg[1:7] == ["fedavg", "20.0 ± 0.0", "1.00x", "2.0 ± 0.0", "95.00 ± 0.00", "4.00 ± 0.00"]
    assert fedavg[8] == "0,1" and never[2] == "x" and never[7] == "pi4 1"


def test_quick_leaderboard_writes_the_markdown_with_its_columns_and_a_png(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "--leaderboard", str(tmp_path / "leaderboard.md"), "--runs", str(tmp_path / "runs"),
        "--quick", "--column", "MNIST", "--column", "Fashion-MNIST",
    ])  # fmt: skip
    md, png = leaderboard(args)
    text = md.read_text()
    for fact in ("Machine:", "Command: `python -m benchmarks.fleet", "Date:", "Seeds per row"):
        assert fact in text
    for column in ("MNIST · dirichlet:0.3: target 97%, parallel clock", "Fashion-MNIST · dirichlet:0.3: target 75%"):
        assert f"## {column}" in text
    header = "| # | row | " + " | ".join(board.COLUMNS) + " |"
    assert text.count(header) == 2 and text.count("| fednova@deadline |") == 2 and text.count("| fedavg |") == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png.name})" in text


def test_a_throttling_column_gets_the_timelines_of_its_deadline_rows(tmp_path: Path) -> None:
    hot = {"fleet": {"profiles": {"pi4-hot": {"throttle_from_round": 10}, "pi4": {}}}}
    records = []
    for row, policy in (("fedavg", "fixed"), ("fednova@deadline", "deadline")):
        r = record(row, "hot", [0.5, 0.95])
        r.update(path=f"hot/{row}/seed-0", steps_policy=policy, summary={**r["summary"], **hot})
        (tmp_path / "runs" / r["path"]).mkdir(parents=True)
        (tmp_path / "runs" / r["path"] / "timeline.png").write_bytes(b"\x89PNG" + row.encode())
        records.append(r)
    md, png = board.write(records, tmp_path / "docs" / "lb.md", tmp_path, title="t", facts=[], description="")
    [copied] = (tmp_path / "docs").glob("lb-timeline-*.png")
    assert copied.read_bytes() == b"\x89PNGfednova@deadline" and f"]({copied.name})" in md.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_column_the_suite_does_not_have_is_refused_before_any_run(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--leaderboard", str(tmp_path / "lb.md"), "--runs", str(tmp_path / "runs"),
                                      "--column", "MNSIT"])  # fmt: skip
    with pytest.raises(SystemExit, match=r"--column \['MNSIT'\]: not a column of fleet-noniid; its columns: \['MNIST'"):
        leaderboard(args)
    assert not (tmp_path / "runs").exists()
