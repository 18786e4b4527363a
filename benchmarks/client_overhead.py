"""Benchmark 1: client step overhead, seconds per 100 local updates per algorithm against FedAvg (TACO Table I).

Runs the real training path (``edge_client.loop.trainer.train_local`` on a ``FlatModel`` with each algorithm's client
half, through ``edge_client.tools.speed``'s per-algorithm runner) for the TACO CNN on 28x28 inputs and the Adult MLP,
batch 64, 100 steps, one torch thread. Every algorithm trains on the plan of the assignment its real server half sends
(``server.strategies.make_strategy(...).assign``: SCAFFOLD's ``c``, TACO's alpha_i, ...), FedUmf with its paper's
local optimiser (momentum 0.5, weight decay 5e-4: ``train.momentum``/``train.weight_decay``). Algorithms are
interleaved within each repeat (order rotated), an untimed warm-up round comes first, and ratios are per repeat
against the FedAvg round of the same repeat (median reported, min beside it).

FedVeca's per-round extra (its full local gradient before the loop plus its O(d) estimates per step) is measured
separately: rounds of FedAvg and FedVeca with the same tau on the same 600-sample local data set, interleaved with
one timed ``FlatModel.full_gradient`` pass over that data, and reported as extra / (one pass).

    /work/venv/bin/python -m benchmarks.client_overhead [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.common import machine, machine_line, write_results

NAME = "client_overhead"
COMMAND = "/work/venv/bin/python -m benchmarks.client_overhead"
MODELS: dict[str, dict[str, Any]] = {
    "cnn-mnist": {"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28},
    "mlp-adult": {"name": "mlp", "in_features": 105, "num_classes": 2, "hidden": [32, 16, 8]},
}
#: algorithm -> largest allowed ratio to FedAvg (seconds per 100 updates)
TARGETS: dict[str, float] = {
    "taco": 1.03,
    "fedprox": 1.03,
    "scaffold": 1.03,
    "fedacg": 1.03,
    "fednova": 1.03,
    "drag": 1.03,
    "fedumf": 1.03,
    "stem": 2.1,
}
#: FedVeca: extra per round <= (1 + FEDVECA_SLACK) x one full pass + its O(d) vector work
FEDVECA_SLACK = 0.10
FEDVECA_VECTOR_OPS_PER_STEP = 6  # two subs, two norms, one add, one dot (FedVecaClient.correct)
#: d-vector operations each client half (or its local optimiser) adds per local step, read off the code
VECTOR_OPS_PER_STEP: dict[str, int] = {
    "fedavg": 0,
    "fedprox": 2,  # grad += zeta w; grad -= zeta w_t
    "fedacg": 2,  # FedProx's correction around the look-ahead
    "taco": 1,  # grad += gamma (1 - alpha) Delta
    "scaffold": 1,  # grad += alpha (c - c_i)
    "drag": 0,  # all of DRAG's work is at the end of the round
    "fednova": 0,
    "fedumf": 3,  # weight decay add, momentum mul + add (the real local optimiser)
    "stem": 6,  # beside its second forward/backward: zero, sub, mul, add, two copies
}


#: the local optimiser (momentum, weight decay) of an algorithm whose paper does not train with plain SGD
OPTIMISER: dict[str, tuple[float, float]] = {"fedumf": (0.5, 5e-4)}


def real_plan(algorithm: str, spec: dict[str, Any], size: int, steps: int, batch: int, lr: float, n: int) -> Any:
    """The plan of the algorithm's round-1 assignment from its server half, and where it came from; the contract's
    defaults (``edge_client.tools.speed.make_plan``) when the server half cannot be built here (DRAG-BR's root data)."""
    from edge_client.algorithms import client_algorithm
    from edge_client.tools.speed import make_plan
    from server.strategies import ServerContext, TrainSettings, make_strategy

    momentum, weight_decay = OPTIMISER.get(algorithm, (0.0, 0.0))
    try:
        settings = TrainSettings(steps, lr, batch, momentum=momentum, weight_decay=weight_decay)
        strategy = make_strategy(algorithm, settings, rounds=100)
        strategy.setup(ServerContext(model_spec=dict(spec), num_params=size, clients={"bench": n}))
        plan = strategy.assign(1, "bench")
    except Exception as exc:
        return make_plan(algorithm, size, steps=steps, batch_size=batch), f"contract ({type(exc).__name__}: {exc})"
    if algorithm == "fedveca" and not plan.settings.get("P"):
        plan.settings["P"] = 1.0  # round 1 sends P = 0; later rounds ||grad F||^2 > 0 (delta path either way)
    client_algorithm(algorithm).contract.check_plan(plan, size)
    return plan, "server strategy"


def use_plan(runner: Any, plan: Any) -> None:
    """Make ``runner`` (``edge_client.tools.speed``'s) train every round on ``plan``, its steps and round advanced."""
    import dataclasses
    import types

    from edge_client.loop.trainer import train_local
    from edge_client.tools.speed import facts_of

    def run(self: Any, steps: int) -> Any:
        current = dataclasses.replace(plan, steps=steps)
        facts = facts_of(self.version)
        result = train_local(self.flat, self.weights, self.dataset, self.sampler, current, self.algorithm, facts)
        self.version += 1
        return result

    runner.plan = plan
    runner.run = types.MethodType(run, runner)


def make_runner(
    label: str,
    spec: dict[str, Any],
    algorithm: str,
    *,
    steps: int,
    batch: int,
    seed: int = 0,
    data: tuple[np.ndarray, np.ndarray] | None = None,
):
    """``edge_client.tools.speed``'s runner with the real server coefficients and, optionally, a given data set."""
    from edge_client.learning.data import ArrayDataset, BatchSampler
    from edge_client.tools.speed import LR, _Runner

    runner = _Runner(label, spec, algorithm, batch, seed)
    if data is not None:
        x, y = data
        runner.dataset = ArrayDataset(x, y)
        runner.sampler = BatchSampler(len(y), batch, seed, f"bench-{algorithm}")
    plan, source = real_plan(algorithm, spec, runner.flat.size, steps, batch, LR, len(runner.dataset))
    use_plan(runner, plan)
    runner.plan_source = source
    return runner


def synthetic_data(spec: dict[str, Any], n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    from edge_client.learning.predictor import sample_shape_for

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *sample_shape_for(spec)), dtype=np.float32)
    return x, rng.integers(0, int(spec["num_classes"]), n).astype(np.int64)


def _profile_round(runner, steps: int, top: int = 8) -> str:
    """cProfile of one round (for a MISS): the top functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    runner.run(steps)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start : start + top + 1])


def measure_table(
    models: dict[str, dict[str, Any]], algorithms: list[str], steps: int, batch: int, repeats: dict[str, int]
) -> dict[str, Any]:
    """Seconds per 100 updates of every (model, algorithm), interleaved and rotated, paired ratios to FedAvg."""
    out: dict[str, Any] = {}
    for label, spec in models.items():
        runners = {alg: make_runner(label, spec, alg, steps=steps, batch=batch) for alg in algorithms}
        for runner in runners.values():  # untimed warm-up: discovers arrays, reaches steady state
            runner.run(min(steps, 5))
            runner.run(steps)
        runs: dict[str, list[float]] = {alg: [] for alg in algorithms}
        cpu: dict[str, list[float]] = {alg: [] for alg in algorithms}
        for r in range(repeats[label]):
            shift = r % len(algorithms)
            for alg in algorithms[shift:] + algorithms[:shift]:
                result = runners[alg].run(steps)
                runs[alg].append(result.compute_s * 100.0 / steps)
                cpu[alg].append(result.cpu_s * 100.0 / steps)
        base = runs["fedavg"]
        vec_a, vec_b = runners["fedavg"].flat.grad.clone(), runners["fedavg"].flat.params.clone()
        t0 = time.process_time()
        for _ in range(1000):
            vec_a.add_(vec_b)
        vec_s = (time.process_time() - t0) / 1000
        rows = {}
        for alg in algorithms:
            paired = [a / b for a, b in zip(runs[alg], base, strict=True)]
            paired_cpu = [a / b for a, b in zip(cpu[alg], cpu["fedavg"], strict=True)]
            ratio = statistics.median(paired_cpu)  # judged on CPU time: see render()
            target = TARGETS.get(alg)
            rows[alg] = {
                "ratio_cpu_median_paired": ratio,
                "ratio_cpu_paired_min": min(paired_cpu),
                "ratio_cpu_paired_max": max(paired_cpu),
                "cpu_runs_s_per_100": cpu[alg],
                "s_per_100_median": statistics.median(runs[alg]),
                "s_per_100_min": min(runs[alg]),
                "cpu_s_per_100_median": statistics.median(cpu[alg]),
                "runs_s_per_100": runs[alg],
                "ratio_median_paired": statistics.median(paired),
                "ratio_of_mins": min(runs[alg]) / min(base),
                "ratio_paired_min": min(paired),
                "ratio_paired_max": max(paired),
                "target_ratio": target,
                "status": None if target is None else ("PASS" if ratio <= target else "MISS"),
                "settings": dict(runners[alg].plan.settings),
                "optimiser": {"momentum": runners[alg].plan.momentum, "weight_decay": runners[alg].plan.weight_decay},
                "arrays": sorted(runners[alg].plan.arrays),
                "plan_source": runners[alg].plan_source,
                "vector_ops_per_step": VECTOR_OPS_PER_STEP.get(alg),
                "expected_vector_overhead": (
                    None
                    if alg not in VECTOR_OPS_PER_STEP
                    else VECTOR_OPS_PER_STEP[alg] * vec_s * 100 / statistics.median(cpu["fedavg"])
                ),
            }
        for alg, row in rows.items():
            if row["status"] == "MISS":
                row["profile"] = _profile_round(runners[alg], steps)
                row["profile_fedavg"] = _profile_round(runners["fedavg"], steps)
        out[label] = {
            "spec": spec,
            "size": runners["fedavg"].flat.size,
            "d_vector_op_s": vec_s,
            "repeats": repeats[label],
            "rows": rows,
        }
    return out


def measure_fedveca_extra(spec: dict[str, Any], taus: list[int], n: int, batch: int, repeats: int) -> dict[str, Any]:
    """FedVeca's round minus FedAvg's round for the same tau, against one full forward/backward pass over the data."""
    import torch

    data = synthetic_data(spec, n, seed=1)
    results: dict[str, Any] = {}
    for tau in taus:
        avg = make_runner("fedveca-extra", spec, "fedavg", steps=tau, batch=batch, data=data)
        veca = make_runner("fedveca-extra", spec, "fedveca", steps=tau, batch=batch, data=data)
        probe = make_runner("fedveca-extra", spec, "fedavg", steps=tau, batch=batch, data=data)
        out = torch.empty(probe.flat.size)
        vec_a, vec_b = torch.randn(probe.flat.size), torch.randn(probe.flat.size)
        for runner in (avg, veca):
            runner.run(tau)
        probe.flat.full_gradient(data[0], data[1], out=out)

        def one_pass(probe=probe, out=out) -> tuple[float, float]:
            t0, c0 = time.perf_counter(), time.process_time()
            probe.flat.full_gradient(data[0], data[1], out=out)
            return time.perf_counter() - t0, time.process_time() - c0

        def vector_op(a=vec_a, b=vec_b) -> float:
            t0 = time.process_time()
            for _ in range(1000):
                a.add_(b)
            return (time.process_time() - t0) / 1000

        wall: dict[str, list[float]] = {"avg": [], "veca": [], "pass": []}
        cpu: dict[str, list[float]] = {"avg": [], "veca": [], "pass": []}
        t_vec: list[float] = []
        for r in range(repeats):
            for which in ("avg", "veca", "pass") if r % 2 == 0 else ("pass", "veca", "avg"):
                if which == "pass":
                    w, c = one_pass()
                else:
                    result = (avg if which == "avg" else veca).run(tau)
                    w, c = result.compute_s, result.cpu_s
                wall[which].append(w)
                cpu[which].append(c)
            t_vec.append(vector_op())
        extra_cpu = [v - a for v, a in zip(cpu["veca"], cpu["avg"], strict=True)]
        extra_wall = [v - a for v, a in zip(wall["veca"], wall["avg"], strict=True)]
        pass_s, vec_s, extra_s = statistics.median(cpu["pass"]), statistics.median(t_vec), statistics.median(extra_cpu)
        allowance = (1.0 + FEDVECA_SLACK) * pass_s + FEDVECA_VECTOR_OPS_PER_STEP * tau * vec_s
        results[str(tau)] = {
            "tau": tau,
            "local_samples": n,
            "fedavg_round_s_median": statistics.median(cpu["avg"]),
            "fedveca_round_s_median": statistics.median(cpu["veca"]),
            "extra_s_median_paired": extra_s,
            "extra_s_min": min(extra_cpu),
            "extra_s_max": max(extra_cpu),
            "full_pass_s_median": pass_s,
            "full_pass_s_min": min(cpu["pass"]),
            "wall": {
                "fedavg_round_s_median": statistics.median(wall["avg"]),
                "fedveca_round_s_median": statistics.median(wall["veca"]),
                "extra_s_median_paired": statistics.median(extra_wall),
                "full_pass_s_median": statistics.median(wall["pass"]),
                "ratio_extra_to_pass": statistics.median(extra_wall) / statistics.median(wall["pass"]),
            },
            "d_vector_op_s": vec_s,
            "ratio_extra_to_pass": extra_s / pass_s,
            "remainder_in_d_vector_ops_per_step": (extra_s - pass_s) / (tau * vec_s),
            "allowance_s": allowance,
            "status": "PASS" if extra_s <= allowance else "MISS",
        }
    return results


def _pct(ratio: float) -> str:
    return f"{(ratio - 1.0) * 100.0:+.1f}%"


def render(data: dict[str, Any]) -> str:
    table = data["table"]
    labels = list(table)
    cfg = data["config"]
    repeats_text = ", ".join(f"{k} {v['repeats']}" for k, v in table.items())
    load = data.get("loadavg") or {}
    load_text = " -> ".join(f"{v[0]:.1f}" for v in (load.get("start"), load.get("end")) if v) or "unknown"
    lines = [
        "## Client step overhead (benchmark 1)",
        "",
        f"Command: `{COMMAND}` (quick mode for CI: `--quick`)",
        "",
        machine_line(data["machine"]),
        "",
        f"Seconds per 100 local updates through `edge_client.loop.trainer.train_local` (batch {cfg['batch']}, "
        f"{cfg['steps']} steps per round, {cfg['threads']} torch thread, synthetic data shaped for each model), "
        "every algorithm with the coefficients its server half sends; algorithms interleaved in rotated order, "
        f"an untimed warm-up first; repeats: {repeats_text}. Each round is timed by the trainer's own timers, wall "
        "(`perf_counter`) and process CPU time (`process_time`). Ratios are per repeat against the FedAvg round of "
        "the same repeat (median; min..max of those paired ratios beside). **Judged on CPU time**: this 2-core "
        f"machine is shared with other jobs (load average {load_text} during this run; under a load of 13 wall "
        "medians were up to 4x the wall minima, at random), and with one torch thread process CPU time is what an "
        "uncontended device spends. Wall-clock ratios are shown beside (paired median, and ratio of minima).",
        "",
        "| algorithm | "
        + " | ".join(f"{m}: CPU s/100 (wall median / min)" for m in labels)
        + " | "
        + " | ".join(f"{m}: over FedAvg, CPU (paired min..max) [wall median; wall minima]" for m in labels)
        + " | target | status |",
        "|---|" + "---:|" * (2 * len(labels)) + "---|---|",
    ]
    algorithms = list(table[labels[0]]["rows"])
    for alg in algorithms:
        cells = []
        for m in labels:
            row = table[m]["rows"][alg]
            cells.append(
                f"{row['cpu_s_per_100_median']:.4f} ({row['s_per_100_median']:.3f} / {row['s_per_100_min']:.3f})"
            )
        for m in labels:
            row = table[m]["rows"][alg]
            cells.append(
                f"**{_pct(row['ratio_cpu_median_paired'])}** ({_pct(row['ratio_cpu_paired_min'])}.."
                f"{_pct(row['ratio_cpu_paired_max'])}) [{_pct(row['ratio_median_paired'])}; "
                f"{_pct(row['ratio_of_mins'])}]"
            )
        target = TARGETS.get(alg)
        tgt = "-" if target is None else (f"<= {target:.2f}x" if target > 1.5 else f"within {_pct(target)}")
        statuses = [table[m]["rows"][alg]["status"] for m in labels]
        status = "-" if target is None else ("PASS" if all(s == "PASS" for s in statuses) else "MISS")
        if alg == "fedveca":
            tgt, status = "see below (per-round extra)", "see below"
        lines.append(f"| {alg} | " + " | ".join(cells) + f" | {tgt} | {status} |")
    lines.append("")
    lines.append(
        "Model sizes: " + ", ".join(f"{m} d = {table[m]['size']:,}" for m in labels) + ". FedVeca's row includes its "
        "full local gradient over the runner's local data (256 samples) once per 100-step round."
    )
    veca = data["fedveca_extra"]
    if veca:
        lines += [
            "",
            "### FedVeca per-round extra",
            "",
            f"TACO CNN, {next(iter(veca.values()))['local_samples']} local samples, batch {cfg['batch']}; FedAvg and "
            "FedVeca rounds with the same tau interleaved with one timed `FlatModel.full_gradient` pass over the same "
            "data (the pass FedVeca adds); extra = median over repeats of (FedVeca round - FedAvg round), CPU seconds "
            "(wall-clock extra / pass beside). Target: "
            f"extra <= (1 + {FEDVECA_SLACK:.2f}) x one pass + {FEDVECA_VECTOR_OPS_PER_STEP} d-vector operations "
            "per step.",
            "",
            "| tau | FedAvg round s | FedVeca round s | extra s (min..max) | one pass s | extra / pass [wall] | "
            "remainder, d-vector ops per step | status |",
            "|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in veca.values():
            lines.append(
                f"| {row['tau']} | {row['fedavg_round_s_median']:.4f} | {row['fedveca_round_s_median']:.4f} | "
                f"{row['extra_s_median_paired']:.4f} ({row['extra_s_min']:.4f}..{row['extra_s_max']:.4f}) | "
                f"{row['full_pass_s_median']:.4f} | {row['ratio_extra_to_pass']:.2f} "
                f"[{row['wall']['ratio_extra_to_pass']:.2f}] | "
                f"{row['remainder_in_d_vector_ops_per_step']:.1f} | {row['status']} |"
            )
    misses = [(m, alg, row) for m in labels for alg, row in table[m]["rows"].items() if row["status"] == "MISS"]
    veca_misses = [r for r in veca.values() if r["status"] == "MISS"]
    lines += ["", "### Misses: measured cause and next step", ""]
    if not misses and not veca_misses:
        lines.append("None in this run.")
    for m, alg, row in misses:
        ratio, ops = row["ratio_cpu_median_paired"], row.get("vector_ops_per_step")
        step_ms = table[m]["rows"]["fedavg"]["cpu_s_per_100_median"] * 10.0
        text = (
            f"- **{alg} on {m}**: {_pct(ratio)} CPU time over FedAvg (paired {_pct(row['ratio_cpu_paired_min'])}.."
            f"{_pct(row['ratio_cpu_paired_max'])}; wall {_pct(row['ratio_median_paired'])}, ratio of wall minima "
            f"{_pct(row['ratio_of_mins'])}), i.e. {(ratio - 1.0) * step_ms * 1000:+.0f} us on a {step_ms:.3f} ms "
            "FedAvg step (CPU)."
        )
        if ops is not None:
            expected = ops * table[m]["d_vector_op_s"] * 100 / table[m]["rows"]["fedavg"]["cpu_s_per_100_median"]
            text += (
                f" Cause: its client half adds {ops} d-vector operation(s) per step, {expected * 100:.2f}% of a FedAvg "
                f"step at the measured {table[m]['d_vector_op_s'] * 1e6:.1f} us per operation (d = "
                f"{table[m]['size']:,}); cProfile (below) shows the same hot functions as FedAvg. "
            )
            if expected < 0.01 and row["ratio_cpu_paired_min"] < 1.0:
                text += (
                    "The excess is therefore measurement noise of the shared machine (the paired ratios straddle "
                    "1.0), not code. Next step: rerun on an idle machine or with more repeats; nothing to change "
                    "in the client half."
                )
            else:
                text += (
                    "Next step: profile the client half's per-step work (see cProfile below) and fuse its operations."
                )
        lines.append(text)
        if "profile" in row:
            lines += [
                "",
                "  cProfile of one round (top by own time), then FedAvg's for comparison:",
                "",
                "  ```",
                *("  " + ln for ln in row["profile"].splitlines()),
                "  ---- fedavg",
                *("  " + ln for ln in row["profile_fedavg"].splitlines()),
                "  ```",
                "",
            ]
    for r in veca_misses:
        lines.append(
            f"- **FedVeca tau {r['tau']}**: extra {r['extra_s_median_paired']:.4f} s = {r['ratio_extra_to_pass']:.2f}"
            f" passes over the local data (allowance {r['allowance_s']:.4f} s). Cause: beyond the one full-gradient "
            f"pass, `FedVecaClient.correct` does its running beta/delta work every step (norms of h - g and "
            f"w_k - w, S += g, ||S||^2): {r['remainder_in_d_vector_ops_per_step']:.0f} d-vector operations' worth "
            "per step as measured (column 'remainder'), several separate torch calls whose fixed cost dominates at "
            "this d. Next step: fuse them (one pass computing the three reductions, e.g. torch._foreach_norm over "
            "preallocated buffers) and re-measure."
        )
    notes = data.get("notes") or []
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def run(quick: bool, out: str | None) -> dict[str, Any]:
    from edge_client.algorithms import CLIENT_ALGORITHMS
    from edge_client.loop.trainer import prepare_process

    prepare_process(1)
    algorithms = sorted(CLIENT_ALGORITHMS, key=lambda name: (name != "fedavg", name))
    if quick:
        steps, repeats, taus, veca_repeats = 10, {"cnn-mnist": 1, "mlp-adult": 1}, [5], 1
    else:
        steps, repeats, taus, veca_repeats = 100, {"cnn-mnist": 11, "mlp-adult": 101}, [20, 50], 15
    t0 = time.perf_counter()
    data: dict[str, Any] = {
        "name": NAME,
        "command": COMMAND + (" --quick" if quick else ""),
        "quick": quick,
        "machine": machine(),
        "config": {"steps": steps, "batch": 64, "threads": 1, "taus": taus},
        "targets": {**TARGETS, "fedveca_extra": f"<= (1+{FEDVECA_SLACK}) x pass + O(d)"},
    }
    data["loadavg"] = {"start": os.getloadavg()}
    data["table"] = measure_table(MODELS, algorithms, steps, 64, repeats)
    data["fedveca_extra"] = measure_fedveca_extra(MODELS["cnn-mnist"], taus, 600, 64, veca_repeats)
    data["loadavg"]["end"] = os.getloadavg()
    data["elapsed_s"] = time.perf_counter() - t0
    write_results(NAME, data, render(data), out)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (CI; numbers not meaningful)")
    parser.add_argument("--out", help="output directory (default benchmarks/results/)")
    args = parser.parse_args(argv)
    data = run(args.quick, args.out)
    print(render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
