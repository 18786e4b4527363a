"""Benchmark 4 (issues 5, 16): server aggregation, folded as updates arrive, against the numpy floor; its memory.

Time. For N = 10, 100 and 1000 updates of d = 1M float32 parameters (``--quick``: N = 10 of d = 10k) every registered
algorithm (``server.strategies.STRATEGIES``) is built with ``make_strategy``, set up with a ``ServerContext`` and fed
``Update`` objects carrying the arrays and values its contract has clients return, each admitted as the orchestrator
admits it (``server.admission``, not timed), which measures the norm of each delta and hands it to ``fold`` as the
orchestrator does. One round is what the orchestrator does: ``begin`` when the assignments
are out, ``fold`` for each update as it is admitted, ``finish`` after the last one. The whole round (begin + N folds +
finish: all the server's aggregation work) is timed against the numpy floor, ``np.sum(stacked, axis=0)`` over the
(N, d) array, and so is ``finish`` alone (what is left after the last update arrived: the round's critical path).
Calls are interleaved (floor, alg 1, alg 2, ..., floor, ...), repeated, median; each strategy first aggregates one
warm-up round (so TACO, DRAG, FedUmf and FedVeca are timed in their steady state: DRAG then streams against the
previous round's reference). DRAG-BR's ``begin`` trains its reference on the root data set (an MLP of exactly d
parameters, U = local_steps SGD steps), reported separately as well. The timed stores of TACO, FoolsGold and the
tailored variants keep every row in RAM (a bound above N x 4d: the passes are what is timed); one extra row, at
N <= 100, times TACO with a RAM bound of 0, every row copied into the memory-mapped spill file (in ``--out``).

Memory. For N = 10, 100 and 1000 (``--quick``: 3 and 10) updates of d parameters, each strategy folds one round
whose updates are made one at a time, folded and dropped, as admission hands them over: the peak of the round's
allocations (tracemalloc, which numpy reports to; from ``begin`` to ``finish``, one update in flight included) must not
grow with N for the streaming algorithms. TACO is shown beside them: its store grows up to its RAM bound, then spills
to the memory-mapped file (file pages are not counted: the kernel may write them out and drop them).

Inputs: one (N, d) float32 array filled once per N (rows are shifted copies of a 2d random buffer, so every row is
distinct memory); update i's delta is row i (a view: zero extra memory, and the floor sums exactly the same bytes).
Extra arrays an algorithm requires are other rows of the same array (row i+1, i+2, ...), so they are distinct
memory per update but shared between arrays. N = 1000 x 1M x 4 B = 4 GB, which fits this machine (24 GB).

Run: ``python -m benchmarks.aggregation [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import math
import os
import pstats
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import DEFAULT_OUT, machine, machine_line, write_results
from edge_client.learning.data import ArrayDataset
from edge_client.wire.messages import Update
from server.admission import Admission, RoundState
from server.config import TrainSection
from server.strategies import STRATEGIES, ServerContext, Strategy, TrainSettings, make_strategy
from server.strategies.store import DEFAULT_RAM_BYTES

NAME = "aggregation"
TARGETS = {"fedavg": 2.0, "fednova": 2.0, "taco": 2.0, "drag": 2.0}
STORED = ("taco", "foolsgold", "fedprox-taco", "scaffold-taco")  # keep a round's uploads: eq. 7 / similarities
MEMORY_SHOWN_STORED = ("taco",)  # beside the streaming ones in the memory table, for contrast
MEMORY_SLACK_UPDATES = 0.5  # "does not grow": the peak at the largest N within half an update of the smallest N's
SETTINGS = TrainSettings(local_steps=50, lr=0.1, batch_size=64)  # the default run's K, lr, B
SAMPLES = 6000  # per client (an MNIST IID shard of 10 clients)
ROUNDS = 100
SLOW = ("drag-br",)  # its time is dominated by server-side training: timed in the first SLOW_REPEATS rounds only
SLOW_REPEATS = 3
SPILLING = "taco (every row spilled)"  # TACO with a RAM bound of 0: the memory-mapped path alone
SPILLING_MAX_N = 100  # not at N = 1000: 4 GB written to the disk every round would time the disk
IN_RAM = sys.maxsize  # the timed stores' RAM bound: every row stays in RAM (the SPILLING row times the file)


def mlp_spec(d: int) -> dict[str, Any]:
    """An MLP spec (one hidden layer, 10 classes) with exactly ``d`` parameters: h (f + 11) + 10 = d."""
    target = d - 10
    best = None
    for h in range(max(1, int(math.sqrt(target) / 3)), target + 1):
        if target % h == 0 and target // h - 11 >= 1:
            best = (h, target // h - 11)
            if h * h * 4 >= target:  # a balanced layer: in_features about 4x hidden or less
                break
    if best is None:
        raise ValueError(f"no one-hidden-layer MLP has exactly {d} parameters")
    h, f = best
    return {"name": "mlp", "in_features": f, "num_classes": 10, "hidden": [h]}


def make_inputs(n: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """(N, d) float32: row i = base[s_i : s_i + d] of a 2d random buffer (fast to fill, every row distinct)."""
    base = rng.standard_normal(2 * d, dtype=np.float32) * np.float32(1e-3)
    stacked = np.empty((n, d), dtype=np.float32)
    shifts = rng.integers(0, d, size=n)
    for i, s in enumerate(shifts):
        stacked[i] = base[s : s + d]
    return stacked


def make_update(name: str, i: int, round_: int, delta: np.ndarray, arrays: list[np.ndarray]) -> Update:
    """Client i's update: ``delta``, the contract's arrays taken from ``arrays`` in order, plausible values."""
    contract = STRATEGIES[name].contract
    return Update(
        round=round_,
        model_version=round_ - 1,
        client_id=f"c{i:04d}",
        num_samples=SAMPLES + i,
        local_steps=SETTINGS.local_steps - (i % 3),
        compute_s=1.0,
        cpu_s=1.0,
        train_loss=0.5,
        delta=delta,
        extras={v.name: 1.0 + 0.01 * i for v in contract.returns_values},
        arrays={a.name: v for a, v in zip(contract.returns, arrays, strict=False)},
    )


def make_updates(name: str, stacked: np.ndarray, round_: int) -> list[Update]:
    """N updates whose delta and required arrays are rows of ``stacked`` (views)."""
    n, k = stacked.shape[0], len(STRATEGIES[name].contract.returns)
    return [make_update(name, i, round_, stacked[i], [stacked[(i + 1 + j) % n] for j in range(k)]) for i in range(n)]


def new_strategy(name: str, d: int, n: int, spill_dir: Path, ram_bytes: int = DEFAULT_RAM_BYTES) -> Strategy:
    """``name`` set up for N clients of d parameters (DRAG-BR with a root data set and an MLP of exactly d)."""
    strategy = make_strategy(name, SETTINGS, seed=0, rounds=ROUNDS)
    root = None
    spec: dict[str, Any] = {"name": "mlp", "in_features": 1, "num_classes": 10}
    if name == "drag-br":
        spec = mlp_spec(d)
        rng = np.random.default_rng(0)
        root = ArrayDataset(rng.standard_normal((512, spec["in_features"]), dtype=np.float32), rng.integers(0, 10, 512))
    clients = {f"c{i:04d}": SAMPLES + i for i in range(n)}
    strategy.setup(ServerContext(spec, d, clients, root, 0, run_dir=spill_dir, store_ram_bytes=ram_bytes))
    return strategy


class Case:
    """One strategy set up for N clients, with its updates; ``step()`` folds one round as the orchestrator does."""

    def __init__(self, name: str, stacked: np.ndarray, weights: np.ndarray, spill_dir: Path, ram_bytes: int) -> None:
        n, d = stacked.shape
        self.name = name
        self.strategy = new_strategy(name.split(" ")[0], d, n, spill_dir, ram_bytes)
        self.round = 1
        self.updates = make_updates(self.strategy.name, stacked, self.round)
        clients = self.strategy.ctx.clients
        state = RoundState(1, 0, set(clients), assigned_steps=dict.fromkeys(clients, SETTINGS.local_steps))
        admission = Admission(self.strategy.contract, self.strategy.params, d, TrainSection.max_update_norm)
        # what the orchestrator checks on arrival (not timed), with the norm of each delta it hands to the strategy
        self.norms = [admission.check(u.client_id, u, state, clients[u.client_id], u.run_id) for u in self.updates]
        self.weights = weights
        self.times: list[float] = []  # begin + folds + finish
        self.finish_times: list[float] = []
        self.begin_times: list[float] = []
        self.spilled = 0

    def step(self) -> tuple[float, float, float]:
        """(whole round, finish, begin) seconds of one round."""
        ids = [u.client_id for u in self.updates]
        self.strategy.select(self.round, ids)  # keeps the strategy's per-round bookkeeping realistic
        for cid in ids:
            self.strategy.assign(self.round, cid)
        for u in self.updates:
            u.round, u.model_version = self.round, self.round - 1
        t0 = time.perf_counter()
        rnd = self.strategy.begin(self.round, self.weights)
        t1 = time.perf_counter()
        for u, norm in zip(self.updates, self.norms, strict=True):
            self.strategy.fold(rnd, u, norm)
        self.spilled = rnd.rows.spilled if rnd.rows is not None else 0
        t2 = time.perf_counter()
        new = self.strategy.finish(rnd)
        t3 = time.perf_counter()
        assert new.shape == self.weights.shape
        self.round += 1
        return t3 - t0, t3 - t2, t1 - t0


def floor_time(stacked: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.sum(stacked, axis=0)
    return time.perf_counter() - t0


def profile_case(case: Case, calls: int = 1) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        case.step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(8)
    text = s.getvalue()
    keep = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("   Ordered", "         "))]
    return "\n".join(keep[-12:])


def bench_n(
    n: int, d: int, repeats: int, algos: list[str], rng: np.random.Generator, spill_dir: Path
) -> dict[str, Any]:
    t_gen = time.perf_counter()
    stacked = make_inputs(n, d, rng)
    gen_s = time.perf_counter() - t_gen
    weights = rng.standard_normal(d, dtype=np.float32)
    cases = {name: Case(name, stacked, weights, spill_dir, IN_RAM) for name in algos}
    if n <= SPILLING_MAX_N:
        cases[SPILLING] = Case(SPILLING, stacked, weights, spill_dir, 0)
    floor_time(stacked)  # warm-up
    for c in cases.values():  # warm-up round: state from a previous round (TACO's alphas, DRAG's reference, ...)
        c.step()
    floors: list[float] = []
    for r in range(repeats):  # interleaved
        floors.append(floor_time(stacked))
        for name, c in cases.items():
            if name in SLOW and r >= SLOW_REPEATS:  # seconds per call (server-side training): fewer repeats
                continue
            total, finish, begin = c.step()
            c.times.append(total)
            c.finish_times.append(finish)
            c.begin_times.append(begin)
    floor = statistics.median(floors)
    rows = {}
    for name, c in cases.items():
        t, f = statistics.median(c.times), statistics.median(c.finish_times)
        row: dict[str, Any] = {
            "seconds": t,
            "ratio": t / floor,
            "ratio_of_minima": min(c.times) / min(floors),
            "finish_s": f,
            "finish_ratio": f / floor,
            "fold_ms_per_update": 1e3 * (t - f - statistics.median(c.begin_times)) / n,
            "spilled_rows": c.spilled,
            "times": c.times,
        }
        if name in TARGETS:
            row["target"] = TARGETS[name]
            row["verdict"] = "PASS" if t / floor <= TARGETS[name] else "MISS"
        if name in SLOW:
            ref = statistics.median(c.begin_times)
            row["server_training_s"] = ref
            row["ratio_without_training"] = max(t - ref, 0.0) / floor
        rows[name] = row
    profiles = {name: profile_case(cases[name]) for name, row in rows.items() if row.get("verdict") == "MISS"}
    del cases
    return {
        "n": n,
        "d": d,
        "repeats": repeats,
        "input_bytes": stacked.nbytes,
        "input_fill_s": gen_s,
        "floor_s": floor,
        "floor_times": floors,
        "floor_gbs": stacked.nbytes / floor / 1e9,
        "algorithms": rows,
        "profiles": profiles,
    }


# ------------------------------------------------------------------------------------------------ memory
def folding_peak(name: str, n: int, d: int, spill_dir: Path) -> dict[str, Any]:
    """Peak bytes allocated while one round of N updates is folded, each made just before its fold and dropped after
    it (tracemalloc, from ``begin`` to ``finish``), after a warm-up round of two updates."""
    strategy = new_strategy(name, d, n, spill_dir)
    rng = np.random.default_rng(1)
    base = rng.standard_normal(2 * d, dtype=np.float32) * np.float32(1e-3)
    k = len(strategy.contract.returns)
    shifts = rng.integers(0, d, size=n + 2 + k)

    def update(i: int, round_: int) -> Update:  # fresh arrays, as a decoded message's are
        arrays = [base[s : s + d].copy() for s in shifts[i + 1 : i + 1 + k]]
        return make_update(name, i, round_, base[shifts[i] : shifts[i] + d].copy(), arrays)

    weights = np.zeros(d, dtype=np.float32)
    weights = strategy.aggregate(1, weights, [update(0, 1), update(1, 1)])
    gc.collect()
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    rnd = strategy.begin(2, weights)
    for i in range(n):
        strategy.fold(rnd, update(i, 2))
    spilled = rnd.rows.spilled if rnd.rows is not None else 0
    strategy.finish(rnd)
    peak = tracemalloc.get_traced_memory()[1] - start
    tracemalloc.stop()
    return {"peak_bytes": peak, "peak_updates": peak / (4 * d), "spilled_rows": spilled}


def folding_memory(ns: tuple[int, ...], d: int, algos: list[str], spill_dir: Path) -> dict[str, Any]:
    shown = [a for a in algos if a not in STORED or a in MEMORY_SHOWN_STORED]
    rows: dict[str, Any] = {}
    for name in shown:
        peaks = {n: folding_peak(name, n, d, spill_dir) for n in ns}
        row: dict[str, Any] = {"by_n": peaks}
        if name not in STORED:
            growth = (peaks[ns[-1]]["peak_bytes"] - peaks[ns[0]]["peak_bytes"]) / (4 * d)
            row["growth_updates"] = growth
            row["verdict"] = "PASS" if growth <= MEMORY_SLACK_UPDATES else "MISS"
        rows[name] = row
    return {"d": d, "ns": list(ns), "store_ram_bytes": DEFAULT_RAM_BYTES, "algorithms": rows}


# ------------------------------------------------------------------------------------------------ report
# Causes of the figures, read off the cProfile kept in aggregation.json under "profiles" and the code.
CAUSES: dict[str, tuple[str, str]] = {
    "taco": (
        "eq. 7 needs the mean of all of a round's uploads before the cosine of any one of them, so each upload is read "
        "from memory twice: on arrival (added to the running sum) and in finish (its dot with the mean, then its "
        "alpha-weighted add while it is still in cache). Two reads are 2x the one-read floor before anything else; "
        "the add from cache and the round's model-sized operations (mean, new model) come on top.",
        "none that keeps eq. 7 exact: a second read of every upload is the least its formula allows "
        '(`alpha_reference = "previous_global"` takes the dots on arrival and reads each upload once in finish).',
    ),
    "drag": (
        "at N = 10 the floor (10 updates) is about as long as the round's fixed model-sized operations (a zero "
        "running sum, the aggregate's scaling, the new model and reference); each update costs one read from memory "
        "(its dot with the reference) and one scaled add from cache.",
        "none needed at N >= 100, where the fixed part is amortised.",
    ),
}


def render(data: dict[str, Any]) -> str:
    quick = data["quick"]
    lines = [
        "## Server aggregation: folded as updates arrive, against the numpy floor; memory"
        + (" (quick mode)" if quick else ""),
        "",
        f"Command: `python -m benchmarks.aggregation{' --quick' if quick else ''}` (from the repo root).",
        "",
        machine_line(data["machine"]),
        "",
        "One round as the orchestrator runs it: `strategy.begin(round, weights)` when the assignments are out, "
        "`strategy.fold(round, update)` for each of N updates of d float32 parameters as admission lets it in, "
        "`strategy.finish(round)` after the last. Times are wall-clock seconds (`time.perf_counter`), median of "
        "interleaved repeats after one warm-up round per strategy, against the floor `np.sum(stacked, axis=0)` over "
        "the same (N, d) array. **round** is begin + folds + finish (all the aggregation work of a round); "
        "**finish** is what is left after the last update arrived (the round's critical path); **fold** is the "
        "cost per update on arrival. Deltas are rows of one (N, d) array, cold in cache for N >= 100 (a just-received "
        "update is warmer). The stores of taco, foolsgold, fedprox-taco and scaffold-taco keep every row in RAM here "
        f"(their default bound is {DEFAULT_RAM_BYTES / 2**30:g} GiB, see the memory table); `{SPILLING}` (N <= "
        f"{SPILLING_MAX_N}) has a RAM bound of 0: every row is copied into the memory-mapped file. drag-br's begin "
        "trains its reference (K SGD steps of an MLP with exactly d parameters on a "
        "512-sample root set): 'excl. training' subtracts it. Train settings K = "
        f"{SETTINGS.local_steps}, lr {SETTINGS.lr}, B {SETTINGS.batch_size}. Only FedAvg, FedNova, TACO and DRAG have "
        "a target (the round within 2x of the floor); the verdict uses the ratio of medians. The ratio of minima "
        "(fastest round over fastest floor) is less sensitive to other processes sharing the cores.",
        "",
    ]
    for block in data["runs"]:
        n, d = block["n"], block["d"]
        lines += [
            f"### N = {n}, d = {d:,} ({block['input_bytes'] / 1e9:.2f} GB of updates; floor "
            f"{block['floor_s'] * 1e3:.2f} ms = {block['floor_gbs']:.1f} GB/s; {block['repeats']} repeats)",
            "",
            "| algorithm | round s (median) | round / floor | target | verdict | finish / floor | fold ms / update "
            "| ratio of minima | note |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, row in block["algorithms"].items():
            notes = []
            if "server_training_s" in row:
                rest = row["ratio_without_training"]
                rest_text = f"{rest:.2f}x" if rest > 0 else "~0 (training alone timed >= the whole round: noise)"
                notes.append(f"begin trains {row['server_training_s']:.3f} s; excl. training {rest_text}")
            if row["spilled_rows"]:
                notes.append(f"{row['spilled_rows']} of {n} rows spilled to the file")
            target = f"<= {row['target']:g}x" if "target" in row else "-"
            lines.append(
                f"| {name} | {row['seconds']:.4f} | {row['ratio']:.2f}x | {target} | {row.get('verdict', '-')} | "
                f"{row['finish_ratio']:.2f}x | {row['fold_ms_per_update']:.3f} | {row['ratio_of_minima']:.2f}x | "
                f"{'; '.join(notes)} |"
            )
        lines += [""]
    mem = data["memory"]
    ns = mem["ns"]
    lines += [
        "### Server memory while a round is folded (tracemalloc), in MB and in updates of 4 d bytes",
        "",
        f"d = {mem['d']:,}. Each update is made just before its fold and dropped after it, as admission hands it over; "
        "the peak of everything allocated from `begin` to `finish` (one update in flight included). Target for the "
        f"streaming algorithms: no growth with N (PASS when the peak at N = {ns[-1]} is within "
        f"{MEMORY_SLACK_UPDATES:g} update of the peak at N = {ns[0]}). taco is shown for contrast: its store keeps "
        f"rows in RAM up to {mem['store_ram_bytes'] / 2**30:g} GiB and spills the rest to its memory-mapped file "
        "(file pages are not counted: the kernel may write them out and drop them).",
        "",
        "| algorithm | " + " | ".join(f"N = {n}: peak MB (updates)" for n in ns) + " | growth, updates | verdict |",
        "|---|" + "---|" * (len(ns) + 2),
    ]
    for name, row in mem["algorithms"].items():
        cells = []
        for n in ns:
            p = row["by_n"][n]
            spill = f", {p['spilled_rows']} rows spilled" if p["spilled_rows"] else ""
            cells.append(f"{p['peak_bytes'] / 1e6:.1f} ({p['peak_updates']:.2f}{spill})")
        growth = f"{row['growth_updates']:+.2f}" if "growth_updates" in row else "(stores rows: up to its bound)"
        lines.append(f"| {name} | {' | '.join(cells)} | {growth} | {row.get('verdict', '-')} |")
    misses = sorted({name for b in data["runs"] for name, r in b["algorithms"].items() if r.get("verdict") == "MISS"})
    lines += ["", f"Targets missed: {', '.join(misses) if misses else 'none'}."]
    for name in misses:
        cause, step = CAUSES.get(name, ("see the profile in aggregation.json", "profile further"))
        lines += ["", f"**{name}** MISS. Measured cause: {cause} Next step: {step}"]
    if data.get("notes"):
        lines += ["", *data["notes"]]
    la, lb = data["load_avg_start"], data["load_avg_end"]
    lines += [
        "",
        f"Load average (1 min) at start / end of the run: {la[0]:.1f} / {lb[0]:.1f} on {data['machine']['cores']} "
        "cores (other processes running at the same time slow the figures down).",
    ]
    return "\n".join(lines) + "\n"


def run(quick: bool, out: str | Path | None) -> dict[str, Any]:
    logging.basicConfig(level=logging.ERROR)
    load_start = os.getloadavg()
    out_dir = Path(out) if out is not None else DEFAULT_OUT
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    algos = sorted(STRATEGIES)
    d = 10_000 if quick else 1_000_000
    memory = folding_memory((3, 10) if quick else (10, 100, 1000), d, algos, out_dir)
    plan = [(10, d, 1)] if quick else [(10, d, 15), (100, d, 9), (1000, d, 3)]
    runs = [bench_n(n, dd, reps, algos, rng, out_dir) for n, dd, reps in plan]
    data: dict[str, Any] = {
        "benchmark": NAME,
        "quick": quick,
        "command": "python -m benchmarks.aggregation" + (" --quick" if quick else ""),
        "machine": machine(),
        "settings": {"local_steps": SETTINGS.local_steps, "lr": SETTINGS.lr, "batch_size": SETTINGS.batch_size},
        "targets": {"ratio_to_floor": TARGETS, "memory_growth_updates": MEMORY_SLACK_UPDATES},
        "runs": runs,
        "memory": memory,
        "notes": [],
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
    }
    write_results(NAME, data, render(data), out)
    return data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 10 updates of 10k parameters, one repeat (CI)")
    ap.add_argument("--out", default=None, help="output directory (default benchmarks/results); spill files go here")
    args = ap.parse_args(argv)
    data = run(args.quick, args.out)
    for block in data["runs"]:
        print(f"N = {block['n']}, d = {block['d']}: floor {block['floor_s']:.4f} s")
        for name, row in block["algorithms"].items():
            print(
                f"  {name:26s} {row['seconds']:.4f} s  {row['ratio']:6.2f}x  finish {row['finish_ratio']:5.2f}x  "
                f"{row.get('verdict', '')}"
            )
    for name, row in data["memory"]["algorithms"].items():
        peaks = ", ".join(f"N={n}: {p['peak_bytes'] / 1e6:.1f} MB" for n, p in row["by_n"].items())
        print(f"  memory {name:14s} {peaks}  {row.get('verdict', '')}")


if __name__ == "__main__":
    main()
