"""Benchmark (issue 27): what a privacy budget costs. FedAvg on MNIST IID and Dir(0.3), 100 devices, each selected
with probability 0.1 a round (Poisson sampling, 10 expected), in-process; final accuracy and time-to-target at
epsilon = 1, 3 and 8 (the noise multiplier derived from the budget over the run's rounds) and without DP, delta 1e-5,
with fixed and adaptive clipping. Target: at epsilon = 8, within 3 points of the non-private final accuracy.

    python -m benchmarks.privacy [--quick] [--rounds R] [--epsilons 1,3,8] [--partitions iid,dirichlet:0.3]
                                 [--clip-norm C] [--local-steps K] [--out DIR] [--runs DIR]

Each run goes to ``--runs DIR/<partition>-<variant>`` (metrics.jsonl, summary.json, report.png with epsilon beside
the accuracy); the plot of final accuracy against epsilon is ``<out>/privacy.png``. Time-to-target is the server's
wall clock (in-process: every device on this machine, one after another).

Quick (CI): digits, 20 devices at rate 0.25, 2 rounds of 5 steps, IID, epsilon 8 and no DP, fixed clipping.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import machine, machine_line, write_results

NAME = "privacy"
MAX_GAP = 0.03  # at epsilon 8, within 3 points of the non-private final accuracy
TARGET_EPSILON = 8.0
#: What ``--quick`` runs (CI): the benchmark's path end to end in seconds, its figures meaningless.
QUICK = {"dataset": "digits", "devices": 20, "fraction": 0.25, "rounds": 2, "partitions": "iid", "epsilons": "8",
         "adaptive": False, "target": 0.5, "local_steps": 5, "delta": 1e-3}  # fmt: skip


def run_one(args: argparse.Namespace, partition: str, epsilon: float | None, adaptive: bool, out: Path) -> dict:
    """One in-process run; its figures (``epsilon`` None: without DP)."""
    from server.config import from_dict
    from server.datasets import load_dataset
    from server.experiments.inprocess import run_inprocess
    from server.experiments.simulate import client_ids, prepare_shards

    privacy = (
        {"mode": "central", "clip_norm": args.clip_norm, "target_epsilon": epsilon, "delta": args.delta,
         "adaptive_clipping": adaptive}
        if epsilon is not None else {}
    )  # fmt: skip
    config = from_dict({
        "run": {"rounds": args.rounds, "out": str(out), "target_accuracy": args.target, "seed": 0},
        "clients": {"count": args.devices, "fraction": args.fraction, "register_timeout_s": 600.0},
        "data": {"dataset": args.dataset, "partition": partition},
        "train": {"algorithm": "fedavg", "local_steps": args.local_steps, "batch_size": 32, "lr": args.lr},
        **({"privacy": privacy} if privacy else {}),
    })  # fmt: skip
    bundle = load_dataset(args.dataset, seed=0)
    shards, _ = prepare_shards(bundle, client_ids(args.devices), partition, 0, out / "shards")
    summary = run_inprocess(config, shards, bundle, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    spent = summary.get("privacy", {})
    return {
        "partition": partition,
        "clipping": "none" if epsilon is None else ("adaptive" if adaptive else "fixed"),
        "target_epsilon": epsilon,
        "noise_multiplier": spent.get("noise_multiplier"),
        "epsilon": spent.get("epsilon"),
        "final_clip_norm": spent.get("final_clip_norm"),
        "final_accuracy": rows[-1].get("accuracy"),
        "rounds": len(rows),
        "rounds_to_target": summary.get("rounds_to_target"),
        "time_to_target_s": summary.get("time_to_target_s"),
        "wall_clock_s": summary.get("wall_clock_s"),
    }


def verdicts(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per partition: the gap between the non-private final accuracy and the best epsilon-8 run's."""
    out = {}
    for partition in dict.fromkeys(r["partition"] for r in records):
        base = next((r for r in records if r["partition"] == partition and r["target_epsilon"] is None), None)
        at8 = [r for r in records if r["partition"] == partition and r["target_epsilon"] == TARGET_EPSILON]
        if base and at8:
            gap = base["final_accuracy"] - max(r["final_accuracy"] for r in at8)
            out[partition] = {"gap": gap, "pass": gap <= MAX_GAP}
    return out


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 4))
    for colour, partition in enumerate(dict.fromkeys(r["partition"] for r in records)):
        for clipping, style in (("fixed", "-"), ("adaptive", ":")):
            runs = sorted((r for r in records if r["partition"] == partition and r["clipping"] == clipping),
                          key=lambda r: r["epsilon"])  # fmt: skip
            if runs:
                ax.plot([r["epsilon"] for r in runs], [r["final_accuracy"] for r in runs], marker="o",
                        linestyle=style, color=f"C{colour}", label=f"{partition}, {clipping} clipping")  # fmt: skip
        base = next((r for r in records if r["partition"] == partition and r["target_epsilon"] is None), None)
        if base:
            ax.axhline(base["final_accuracy"], linestyle="--", linewidth=1, color=f"C{colour}",
                       label=f"{partition}, no DP")  # fmt: skip
    ax.set_xscale("log")
    spent = sorted({r["epsilon"] for r in records if r["epsilon"] is not None})
    ax.set_xticks(spent, [f"{e:.3g}" for e in spent], minor=False)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_ylim(0, 1)  # on the whole scale: a tenth of a point must not look like a cliff
    ax.set_xlabel("epsilon spent (delta 1e-5, dp-accounting RDP)")
    ax.set_ylabel("final test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(data: dict[str, Any]) -> str:
    c = data["config"]
    lines = [
        f"## Differential privacy, {c['devices']} devices: accuracy and time-to-target against epsilon"
        f"{' (quick)' if data['quick'] else ''}",
        "",
        f"`{data['command']}`. {machine_line(data['machine'])}. FedAvg, {c['dataset']}, {c['devices']} devices "
        f"sampled at rate {c['fraction']} (Poisson), {c['rounds']} rounds of {c['local_steps']} local steps, delta "
        f"{c['delta']:g}, clip norm {c['clip_norm']:g} (adaptive: its start), in-process; time-to-target "
        f"{c['target']:g} on the server's wall clock.",
        "",
        "| partition | clipping | target epsilon | noise multiplier | epsilon spent | final accuracy | rounds to "
        "target | time to target (s, server wall clock) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def f(v: Any, spec: str = "{:.3f}") -> str:
        return "-" if v is None else spec.format(v)

    for r in data["records"]:
        lines.append(
            f"| {r['partition']} | {r['clipping']} | {f(r['target_epsilon'], '{:g}')} | {f(r['noise_multiplier'])} "
            f"| {f(r['epsilon'], '{:.2f}')} | {f(r['final_accuracy'], '{:.4f}')} | {f(r['rounds_to_target'], '{}')} "
            f"| {f(r['time_to_target_s'], '{:.1f}')} |"
        )
    if data["verdicts"]:
        lines += ["", "| target | measured | result |", "|---|---|---|"]
    for partition, v in data["verdicts"].items():
        verdict = "PASS" if v["pass"] else "MISS"
        lines.append(f"| {partition}: epsilon {TARGET_EPSILON:g} within {100 * MAX_GAP:.0f} points of the non-private "
                     f"final accuracy | {100 * v['gap']:.1f} points below | {verdict} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, name: str = NAME, quick: dict[str, Any] = QUICK) -> dict[str, Any]:
    """Every variant of ``args`` (``quick``: the settings ``--quick`` runs); results as ``<out>/<name>.json``, ``.md``
    and ``.png``."""
    if args.quick:
        vars(args).update(quick)
    runs_dir = Path(args.runs) if args.runs else Path(args.out or "runs") / f"bench-{name}"
    records = []
    for partition in args.partitions.split(","):
        variants: list[tuple[float | None, bool]] = [(None, False)]
        for eps in (float(e) for e in args.epsilons.split(",")):
            variants += [(eps, False), *([(eps, True)] if args.adaptive else [])]
        for eps, adaptive in variants:
            variant = f"{partition.replace(':', '')}-{'nodp' if eps is None else f'eps{eps:g}'}{'-adaptive' * adaptive}"
            records.append(run_one(args, partition, eps, adaptive, runs_dir / variant))
            print(json.dumps(records[-1]), flush=True)
    data = {
        "quick": args.quick, "machine": machine(), "command": " ".join([f"python -m benchmarks.{name}", *sys.argv[1:]]),
        "config": {k: getattr(args, k) for k in ("dataset", "devices", "fraction", "rounds", "local_steps", "delta",
                                                   "clip_norm", "target")},
        "records": records, "verdicts": verdicts(records),
    }  # fmt: skip
    out = Path(args.out) if args.out else None
    json_path, _ = write_results(name, data, markdown(data), out)
    plot(records, json_path.parent / f"{name}.png")
    return data


def build_parser(
    prog: str = f"python -m benchmarks.{NAME}", description: str = __doc__, quick: dict[str, Any] = QUICK
) -> argparse.ArgumentParser:
    """The options; ``quick``: what ``--quick`` runs, as its help says."""
    parser = argparse.ArgumentParser(prog=prog, description=description.split("\n")[0])
    q = quick
    parser.add_argument("--quick", action="store_true", help=f"{q['dataset']}, {q['devices']} devices, {q['rounds']} "
                        f"rounds, epsilon {q['epsilons']} and none (CI)")  # fmt: skip
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=0.1, help="each device's chance to be selected a round")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--epsilons", default="1,3,8")
    parser.add_argument("--partitions", default="iid,dirichlet:0.3")
    parser.add_argument("--no-adaptive", dest="adaptive", action="store_false", help="fixed clipping only")
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--target", type=float, default=0.9, help="the accuracy time-to-target counts to")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default: benchmarks/results)")
    parser.add_argument("--runs", default=None, help="where the runs go (default: OUT/bench-NAME, else runs/...)")
    return parser


def main(argv: list[str] | None = None) -> int:
    data = run(build_parser().parse_args(argv))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
