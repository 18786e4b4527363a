"""Benchmark: a heterogeneous fleet (issue 14), the bench suite ``fleet-mnist`` on both clocks; and the fleet
leaderboard (issue 24), the suite ``fleet-noniid``, with ``--leaderboard FILE.md``.

10 clients as 2 pi5, 5 pi4 and 3 pi3 (``edge-server fleet list``), MNIST Dir(0.5), TACO CNN: FedAvg with fixed
K = 50, FedNova with the deadline steps policy, FedVeca, TACO. In-process, each client is measured alone and the
suite keeps the parallel clock (each round as long as its slowest device); in broker mode each client is a process
under its class's cgroup CPU quota and the clock is this machine's wall clock. The target: FedNova with the deadline
policy reaches the suite's target accuracy in at most 0.6x FedAvg's time with FedAvg's final accuracy within 0.5
points.

    python -m benchmarks.fleet [--modes inprocess,broker] [--rounds R] [--algorithms a,b] [--quick] [--out DIR]
                               [--runs DIR]

The runs go to ``--runs DIR/<mode>`` as ``edge-server bench --suite fleet-mnist --mode <mode>`` writes them (report.md,
plots, timeline.png per run); runs finished there before are kept, not run again.

Quick (CI): digits, 2 rounds, FedAvg and FedNova, in-process, a fleet of one pi5, one pi4 and one pi3.

The leaderboard (docs/leaderboard.md, docs/bench.md "Which algorithm wins on your fleet")::

    python -m benchmarks.fleet --leaderboard docs/leaderboard.md [--runs DIR] [--rounds R] [--algorithms a,b@deadline]
                               [--seeds 0] [--more-seeds 1,2] [--quick]

runs every column of ``fleet-noniid`` (resumed from ``--runs``, default runs/bench-fleet-noniid) and writes the
leaderboard with the machine, command, date and seeds, and its plot beside it (FILE.png). Quick (the test): digits, 2
rounds, FedAvg and FedNova with the deadline policy, the two in-process dataset columns on three devices, no extra
seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine, machine_line, write_results

NAME = "fleet"
SUITE = "fleet-mnist"
LEADERBOARD_SUITE = "fleet-noniid"
BASELINE, POLICY = "fedavg", "fednova"
MAX_TIME_RATIO = 0.6
MAX_ACCURACY_GAP = 0.005
CLOCKS = {"inprocess": "parallel clock (s, in-process)", "broker": "wall clock (s, broker, cgroup quotas)"}


def time_to_target(record: dict[str, Any], mode: str, target: float) -> float | None:
    """Seconds to ``target`` on the clock ``mode`` measures: the parallel clock in-process, else the wall clock."""
    key = "parallel_elapsed_s" if mode == "inprocess" else "elapsed_s"
    return next((p[key] for p in record["curve"] if p["accuracy"] >= target), None)


def server_s_to_target(metrics: Path, target: float) -> float | None:
    """The server's own seconds (assigning, aggregating, evaluating; this machine's wall clock) until ``target``:
    the part of either clock that no device profile scales."""
    total = 0.0
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        total += row["assign_s"] + row["aggregate_s"] + row["eval_s"]
        if row["accuracy"] >= target:
            return total
    return None


def _mean_if_all(values: list[Any]) -> float | None:
    """The mean, when every run has a value (reached the target)."""
    return None if None in values else statistics.fmean(values)


def figures(
    records: list[dict[str, Any]],
    mode: str,
    target: float,
    policies: dict[str, str],
    paths: dict[tuple[str, int], Path],
) -> dict[str, dict[str, Any]]:
    """Per algorithm: final accuracy, rounds and time to target with the server's share of it, and the rounds missed
    per class (means over the seeds; a time only when every seed reached the target). ``paths``: each run's
    directory by (algorithm, seed)."""
    out: dict[str, dict[str, Any]] = {}
    for algorithm in dict.fromkeys(r["algorithm"] for r in records):
        runs = [r for r in records if r["algorithm"] == algorithm]
        times = [time_to_target(r, mode, target) for r in runs]
        server = [server_s_to_target(paths[r["algorithm"], r["seed"]] / "metrics.jsonl", target) for r in runs]
        rounds = [r["summary"]["rounds_to_target"] for r in runs]
        classes = sorted({c for r in runs for c in r["summary"]["per_class"]})
        out[algorithm] = {
            "final_accuracy": statistics.fmean(r["summary"]["final_accuracy"] for r in runs),
            "time_to_target_s": _mean_if_all(times),
            "server_s_to_target": _mean_if_all(server),
            "rounds_to_target": _mean_if_all(rounds),
            "rounds_missed": {
                c: statistics.fmean(r["summary"]["per_class"].get(c, {}).get("rounds_missed", 0) for r in runs)
                for c in classes
            },
            "steps_policy": policies[algorithm],
        }
    return out


def verdict(per_algorithm: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The target on one clock, or None when the run lacks FedAvg or FedNova."""
    base, policy = per_algorithm.get(BASELINE), per_algorithm.get(POLICY)
    if base is None or policy is None:
        return None
    t0, t1 = base["time_to_target_s"], policy["time_to_target_s"]
    ratio = t1 / t0 if t0 and t1 is not None else None
    gap = abs(policy["final_accuracy"] - base["final_accuracy"])
    ok = ratio is not None and ratio <= MAX_TIME_RATIO and gap <= MAX_ACCURACY_GAP
    return {"time_ratio": ratio, "accuracy_gap": gap, "pass": ok}


def _fmt(v: float | None, spec: str = "{:.1f}") -> str:
    return "not reached" if v is None else spec.format(v)


def markdown(data: dict[str, Any]) -> str:
    target = data["config"]["target_accuracy"]
    lines = [
        "## Heterogeneous fleet (fleet-mnist)",
        "",
        f"Command: `{data['command']}`. {machine_line(data['machine'])}. Fleet {data['config']['fleet']}, "
        f"{data['config']['dataset']} {data['config']['partition']}, {data['config']['rounds']} rounds, target "
        f"{target * 100:g}%.",
        "",
    ]
    for mode, per_algorithm in data["modes"].items():
        lines += [
            f"### {CLOCKS[mode]}",
            "",
            f"| algorithm | steps policy | final accuracy | rounds to {target * 100:g}% | time to {target * 100:g}% "
            f"({CLOCKS[mode]}) | of which the server's own (s, wall) | rounds missed per class |",
            "|---|---|---|---|---|---|---|",
        ]
        for algorithm, f in per_algorithm.items():
            missed = " · ".join(f"{c} {v:g}" for c, v in f["rounds_missed"].items()) or "-"
            lines.append(
                f"| {algorithm} | {f['steps_policy']} | {f['final_accuracy'] * 100:.2f}% | "
                f"{_fmt(f['rounds_to_target'], '{:g}')} | {_fmt(f['time_to_target_s'])} | "
                f"{_fmt(f['server_s_to_target'])} | {missed} |"
            )
        lines.append("")
    verdicts = [(mode, v) for mode, v in data["verdicts"].items() if v is not None]
    if verdicts:
        lines += [
            f"| target: {POLICY} with the deadline policy against {BASELINE} | measured | target | result |",
            "|---|---|---|---|",
        ]
        for mode, v in verdicts:
            lines.append(
                f"| time to {target * 100:g}% on the {CLOCKS[mode]}, and final accuracy | "
                f"{_fmt(v['time_ratio'], '{:.2f}x')}; {v['accuracy_gap'] * 100:.2f} points apart | "
                f"<= {MAX_TIME_RATIO:g}x; <= {MAX_ACCURACY_GAP * 100:g} points | {'PASS' if v['pass'] else 'MISS'} |"
            )
        lines.append("")
    return "\n".join(lines)


def leaderboard(args: argparse.Namespace) -> tuple[Path, Path]:
    """Run ``fleet-noniid`` (reduced as the flags say) and write the leaderboard and its plot."""
    from server.experiments import leaderboard as board
    from server.experiments.runner import run_suite
    from server.experiments.suites import load_suite

    suite = load_suite(LEADERBOARD_SUITE)
    if args.quick:
        suite.variants = [v for v in suite.variants if v.mode is None and v.algorithms is None]
        for v in suite.variants:
            v.overrides.pop("data", None)
        suite.base["data"] = {"dataset": "digits"}
        suite.base["train"]["batch_size"] = 16
        suite.use_fleet("pi5:1,pi4:1,pi3:1")
        suite.more_seeds = []
    if args.column:
        unknown = sorted(set(args.column) - {v.name for v in suite.variants})
        if unknown:
            names = [v.name for v in suite.variants]
            raise SystemExit(f"--column {unknown}: not a column of {LEADERBOARD_SUITE}; its columns: {names}")
        suite.variants = [v for v in suite.variants if v.name in args.column]
    if args.rounds or args.quick:
        suite.use_rounds(args.rounds or 2)
    algorithms = args.algorithms or ("fedavg,fednova@deadline" if args.quick else "")
    if algorithms:
        suite.algorithms = algorithms.split(",")
    if args.seeds:
        suite.seeds = [int(s) for s in args.seeds.split(",")]
    if args.more_seeds is not None:
        suite.more_seeds = [int(s) for s in args.more_seeds.split(",") if s]
    runs_dir = Path(args.runs) if args.runs else Path("runs") / f"bench-{LEADERBOARD_SUITE}"
    records = run_suite(suite, runs_dir)
    seeds = "; ".join(f"{row} {','.join(map(str, sorted({r['seed'] for r in records if r['algorithm'] == row})))}"
                      for row in dict.fromkeys(r["algorithm"] for r in records))  # fmt: skip
    facts = [
        machine_line(machine()),
        f"Command: `{' '.join(['python -m benchmarks.fleet', *sys.argv[1:]])}` (runs in {runs_dir})",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; the runs took "
        f"{sum(r.get('duration_s', 0.0) for r in records) / 60:.0f} min of this machine",
        f"Seeds per row, over all columns: {seeds}",
        f"Scaled: {suite.scaled}" if suite.scaled else "",
    ]
    return board.write(
        records,
        Path(args.leaderboard),
        runs_dir,
        title="Which algorithm wins on your fleet: the fleet leaderboard",
        facts=[f for f in facts if f],
        description=suite.description + "\n\n" + board.__doc__.split("\n\n", 1)[1].strip(),
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from server.experiments.runner import run_suite
    from server.experiments.suites import load_suite

    runs_dir = Path(args.runs) if args.runs else Path("runs") / f"bench-{NAME}"
    command = " ".join(["python -m benchmarks.fleet", *sys.argv[1:]])
    data: dict[str, Any] = {"quick": args.quick, "machine": machine(), "command": command, "modes": {}, "verdicts": {}}
    for mode in (args.modes or ("inprocess" if args.quick else "inprocess,broker")).split(","):
        if mode not in CLOCKS:
            raise SystemExit(f"--modes: {mode!r} is not one of {', '.join(CLOCKS)}")
        suite = load_suite(SUITE)
        if args.quick:
            suite.base["data"] = {"dataset": "digits"}
            suite.base["train"]["batch_size"] = 16
            suite.use_fleet("pi5:1,pi4:1,pi3:1")
        if args.rounds or args.quick:
            suite.base["run"]["rounds"] = args.rounds or 2
        algorithms = args.algorithms or ("fedavg,fednova" if args.quick else "")
        if algorithms:
            suite.algorithms = algorithms.split(",")
        records = run_suite(suite, runs_dir / mode, mode)  # finished runs found there are kept
        target = suite.base["run"]["target_accuracy"]
        data["config"] = {"fleet": suite.base["fleet"]["devices"], "dataset": suite.base["data"]["dataset"],
                          "partition": ", ".join(suite.partitions), "rounds": suite.base["run"]["rounds"],
                          "target_accuracy": target, "seeds": suite.seeds}  # fmt: skip
        policies = {spec.algorithm: spec.config.train.steps_policy for spec in suite.runs()}
        paths = {(spec.algorithm, spec.seed): runs_dir / mode / "runs" / spec.path for spec in suite.runs()}
        data["modes"][mode] = figures(records, mode, target, policies, paths)
        data["verdicts"][mode] = verdict(data["modes"][mode])
    write_results(NAME, data, markdown(data), args.out)
    return data


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--modes", help="clocks to measure: inprocess, broker or both (default both; quick: inprocess)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds instead of the suite's 40")
    parser.add_argument("--algorithms", default="", help="comma-separated algorithms instead of the suite's four")
    parser.add_argument("--quick", action="store_true", help="digits, 2 rounds, FedAvg and FedNova, three devices (CI)")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default: benchmarks/results)")
    parser.add_argument(
        "--runs",
        default=None,
        help="the bench runs' directory, resumed (default runs/bench-fleet, "
        f"with --leaderboard runs/bench-{LEADERBOARD_SUITE})",
    )
    parser.add_argument("--leaderboard", metavar="FILE.md", help=f"run {LEADERBOARD_SUITE} and write its leaderboard")
    parser.add_argument("--seeds", default="", help="with --leaderboard: the seeds of every row instead of the suite's")
    parser.add_argument("--more-seeds", default=None, help="with --leaderboard: the extra seeds (empty: none)")
    parser.add_argument(
        "--column", action="append", help="with --leaderboard: only this column (a variant's name; repeat for more)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.leaderboard:
        md, png = leaderboard(args)
        print(f"wrote {md} and {png}")
        return 0
    data = run(args)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
