"""Benchmark: bandwidth (issue 18): what each upload codec costs in accuracy and saves in bytes, and how fast it runs.

Training: MNIST, 10 clients, the TACO CNN (44,426 parameters), IID and Dir(0.5), FedAvg, SCAFFOLD and TACO, each
upload codec (``fp32``, ``fp16``, ``int8``, ``topk:0.01``, ``topk:0.01+int8``), the same seed and partition for every
codec. Each run goes in-process (``server.experiments.inprocess``: the server and device code of a real run, the
clients one after another, every message encoded and decoded as over MQTT), one run at a time. Per run: final
accuracy after R rounds, the first round reaching 97%, bytes up per update as the server received them (frame bytes,
header included), bytes up and all bytes (up and down) moved until 97%. Ratios are against fp32 of the same algorithm
and partition. Beside them, FedAvg with ``train.downlink_codec = "int8"`` (each round's model broadcast as the int8
difference from the last one) shows what the downlink adds to all bytes moved.

Targets (issue 18): ``int8`` at most 0.27x the bytes up of fp32 with final accuracy within 0.3 points;
``topk:0.01+int8`` at most 0.03x the bytes up, final accuracy within 1 point, bytes up to 97% at most 0.1x.

Speed: encode (``codecs.encode``, what a device does) and decode (``protocol.decode`` of a whole update frame, what
the server does: header, checks, expansion) in GB/s of float32 (4 d bytes) for d = 44,426, 1M and 11M, median of
interleaved repeats beside a float32 copy into a fresh array (the floor any decode that allocates its output meets).
Target: decode >= 1 GB/s.

    python -m benchmarks.bandwidth [--quick] [--out DIR] [--work DIR] [--rounds R] [--algorithms A,..]
        [--partitions P,..] [--codecs C,..]

The last three run a subset of the grid (one full run takes minutes; the grid is 36 runs); the result says which.

A finished run's record is kept in ``--work`` (default runs/bench-bandwidth), so an interrupted benchmark resumes.
Quick: digits, 3 clients, 2 rounds, FedAvg, IID, fp32 and topk:0.01+int8; speed at d = 44,426 only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import machine, machine_line, write_results
from edge_client.wire import codecs
from edge_client.wire.messages import Update
from edge_client.wire.protocol import decode, encode

NAME = "bandwidth"
TARGET = 0.97
CODECS = ["fp32", "int8", "topk:0.01+int8", "fp16", "topk:0.01"]  # the order the runs go in: targets first
ALGORITHMS = ["fedavg", "scaffold", "taco"]
PARTITIONS = ["iid", "dirichlet:0.5"]
DOWNLINK = [("fedavg", "fp32"), ("fedavg", "int8"), ("fedavg", "topk:0.01+int8")]  # (algorithm, upload codec)
SPEED_SIZES = (44_426, 1_000_000, 11_000_000)
INT8_BYTES, INT8_POINTS = 0.27, 0.3
TOPK_BYTES, TOPK_POINTS, TOPK_TO_TARGET = 0.03, 1.0, 0.1
DECODE_GBS = 1.0


def plan(quick: bool, rounds: int | None) -> dict[str, Any]:
    if quick:
        return {"dataset": "digits", "clients": 3, "rounds": rounds or 2, "partitions": ["iid"],
                "algorithms": ["fedavg"], "codecs": ["fp32", "topk:0.01+int8"], "downlink": [], "local_steps": 20,
                "batch_size": 32, "lr": 0.1, "speed_sizes": SPEED_SIZES[:1], "repeats": 3}  # fmt: skip
    return {"dataset": "mnist", "clients": 10, "rounds": rounds or 20, "partitions": PARTITIONS,
            "algorithms": ALGORITHMS, "codecs": CODECS, "downlink": DOWNLINK, "local_steps": 50, "batch_size": 64,
            "lr": 0.1, "speed_sizes": SPEED_SIZES, "repeats": 15}  # fmt: skip


# ------------------------------------------------------------------------------------------------------ training runs
def run_cell(
    p: dict[str, Any], partition: str, algorithm: str, codec: str, downlink: str, work: Path
) -> dict[str, Any]:
    """One training run in-process (or its record from an earlier, finished run)."""
    from server.config import from_dict
    from server.datasets import load_dataset
    from server.experiments.inprocess import run_inprocess
    from server.experiments.simulate import client_ids, prepare_shards
    from server.report import round_bytes

    name = f"{partition}-{algorithm}-{codec}-down-{downlink}".replace(":", "_").replace("+", "_")
    out = work / name
    done = out / "record.json"
    if done.exists():
        return json.loads(done.read_text())
    config = from_dict({
        "run": {"rounds": p["rounds"], "target_accuracy": TARGET, "seed": 0, "out": str(out), "job": name},
        "clients": {"count": p["clients"]},
        "data": {"dataset": p["dataset"], "partition": partition},
        "train": {"algorithm": algorithm, "local_steps": p["local_steps"], "batch_size": p["batch_size"],
                  "lr": p["lr"], "codec": codec, "downlink_codec": downlink},
    })  # fmt: skip
    bundle = load_dataset(p["dataset"], seed=0)
    shards, _ = prepare_shards(bundle, client_ids(p["clients"]), partition, 0, out / "shards")
    t0 = time.monotonic()
    summary = run_inprocess(config, shards, bundle, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    reached = summary["rounds_to_target"]
    updates = sum(len(r["clients"]) for r in rows)
    record = {
        "partition": partition, "algorithm": algorithm, "codec": codec, "downlink": downlink,
        "final_accuracy": summary["final_accuracy"], "rounds_to_target": reached,
        "bytes_up": summary["bytes_up"], "bytes_down": summary["bytes_down"],
        "bytes_per_update": summary["bytes_up"] / max(1, updates),
        "bytes_up_to_target": sum(round_bytes(r)[0] for r in rows if r["round"] <= reached) if reached else None,
        "bytes_to_target": summary["bytes_to_target"], "codec_mix": summary["codec_mix"],
        "rejected": summary["rejected"], "duration_s": time.monotonic() - t0,
    }  # fmt: skip
    done.write_text(json.dumps(record) + "\n")
    return record


def ratios(records: list[dict[str, Any]]) -> None:
    """Each record's figures against fp32 (fp32 downlink) of its algorithm and partition, in place."""
    base = {(r["partition"], r["algorithm"]): r for r in records if r["codec"] == "fp32" and r["downlink"] == "fp32"}
    for r in records:
        b = base.get((r["partition"], r["algorithm"]))
        if b is None:
            continue
        r["bytes_ratio"] = r["bytes_per_update"] / b["bytes_per_update"]
        r["points"] = 100.0 * (r["final_accuracy"] - b["final_accuracy"])
        both = r["bytes_up_to_target"] is not None and b["bytes_up_to_target"]
        r["up_to_target_ratio"] = r["bytes_up_to_target"] / b["bytes_up_to_target"] if both else None
        both = r["bytes_to_target"] is not None and b["bytes_to_target"]
        r["all_to_target_ratio"] = r["bytes_to_target"] / b["bytes_to_target"] if both else None


# -------------------------------------------------------------------------------------------------------------- speed
def speed(sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """Encode and decode GB/s of float32 per codec and size, interleaved with the copy floor."""
    rng = np.random.default_rng(0)
    out = []
    for d in sizes:
        x = (rng.standard_normal(d, dtype=np.float32) * np.float32(1e-3)).astype(np.float32)
        frames = {}
        for name in CODECS:
            enc = codecs.encode(x, codecs.parse(name), rng)
            frames[name] = encode(Update(7, 6, "bench-dev", 600, 50, 1.0, 1.0, 0.1, enc, run_id="bench"))
        times: dict[str, list[float]] = {k: [] for k in ["copy", *(f"{c} {w}" for c in CODECS for w in ("enc", "dec"))]}
        for _ in range(repeats):
            for name in CODECS:
                spec = codecs.parse(name)
                t0 = time.perf_counter()
                codecs.encode(x, spec, rng)
                t1 = time.perf_counter()
                decode(frames[name])
                t2 = time.perf_counter()
                times[f"{name} enc"].append(t1 - t0)
                times[f"{name} dec"].append(t2 - t1)
            t0 = time.perf_counter()
            x.copy()
            times["copy"].append(time.perf_counter() - t0)
        gbs = {k: 4 * d / statistics.median(v) / 1e9 for k, v in times.items()}
        for name in CODECS:
            out.append({
                "params": d, "codec": name, "frame_bytes": len(frames[name]),
                "frame_ratio": len(frames[name]) / len(frames["fp32"]), "encode_gbs": gbs[f"{name} enc"],
                "decode_gbs": gbs[f"{name} dec"], "copy_floor_gbs": gbs["copy"],
            })  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------------------- render
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _mb(x: float | None) -> str:
    return "not reached" if x is None else f"{x / 1e6:.2f}"


def verdicts(records: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(figure, measured, target, PASS|MISS) for every target of every algorithm and partition."""
    rows = []
    for r in records:
        if r["downlink"] != "fp32" or "bytes_ratio" not in r:
            continue
        cell = f"{r['algorithm']} {r['partition']} {r['codec']}"
        if r["codec"] == "int8":
            ok = r["bytes_ratio"] <= INT8_BYTES and r["points"] >= -INT8_POINTS
            measured = f"bytes up {r['bytes_ratio']:.3f}x, accuracy {r['points']:+.2f} points"
            rows.append((cell, measured, f"<= {INT8_BYTES}x, >= -{INT8_POINTS} points", "PASS" if ok else "MISS"))
        elif r["codec"] == "topk:0.01+int8":
            to = r["up_to_target_ratio"]
            ok = (
                r["bytes_ratio"] <= TOPK_BYTES
                and r["points"] >= -TOPK_POINTS
                and to is not None
                and to <= TOPK_TO_TARGET
            )
            measured = (f"bytes up {r['bytes_ratio']:.3f}x, accuracy {r['points']:+.2f} points, bytes up to 97% "
                        f"{_pct(to)}")  # fmt: skip
            target = f"<= {TOPK_BYTES}x, >= -{TOPK_POINTS} points, <= {TOPK_TO_TARGET}x"
            rows.append((cell, measured, target, "PASS" if ok else "MISS"))
    return rows


def render(data: dict[str, Any]) -> str:
    p, records = data["plan"], data["runs"]
    cmd = " ".join(["python -m benchmarks.bandwidth", *data["argv"]])
    lines = [
        "# Bandwidth: upload codecs, bytes moved and accuracy (issue 18)",
        "",
        f"Command: `{cmd}` (from the repository root, under `nice -n 10`). {machine_line(data['machine'])}",
        "",
        f"{p['dataset']}, {p['clients']} clients, {p['rounds']} rounds of {p['local_steps']} local steps (batch "
        f"{p['batch_size']}, lr {p['lr']}), seed 0, in-process, one run at a time; target accuracy {TARGET:.0%}. "
        "Bytes are frame bytes as the server received (up) or published (down) them; ratios are against fp32 of the "
        "same algorithm and partition. Accuracy differences are in points (percent).",
        "",
        "## Targets",
        "",
        "| figure | measured | target | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {v} |" for a, b, c, v in verdicts(records)]
    lines += [
        "",
        "## Every run",
        "",
        "| partition | algorithm | upload codec | downlink | final accuracy | vs fp32 (points) | rounds to 97% | bytes "
        "per update | vs fp32 | MB up to 97% | vs fp32 | MB moved to 97% (up + down) | vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        points = "-" if "points" not in r else f"{r['points']:+.2f}"
        lines.append(
            f"| {r['partition']} | {r['algorithm']} | {r['codec']} | {r['downlink']} | {r['final_accuracy']:.4f} | "
            f"{points} | {r['rounds_to_target'] or 'not reached'} | {r['bytes_per_update']:,.0f} | "
            f"{_pct(r.get('bytes_ratio'))} | {_mb(r['bytes_up_to_target'])} | {_pct(r.get('up_to_target_ratio'))} | "
            f"{_mb(r['bytes_to_target'])} | {_pct(r.get('all_to_target_ratio'))} |"
        )
    lines += [
        "",
        "## Codec speed",
        "",
        "GB/s of float32 (4 d bytes), wall clock (`time.perf_counter`), median of interleaved repeats; decode is "
        "`protocol.decode` of a whole update frame (header parse, checks, expansion into a new float32 vector; fp32 "
        "returns a zero-copy view). The copy floor copies d float32 into a fresh array in the same loop: it bounds "
        "what a decode that allocates its output can reach, and shows how loaded the machine was.",
        "",
        "| d | codec | frame bytes | vs fp32 | encode GB/s | decode GB/s | copy floor GB/s | decode >= 1 GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in data["speed"]:
        ok = s["codec"] == "fp32" or s["decode_gbs"] >= DECODE_GBS
        lines.append(
            f"| {s['params']:,} | {s['codec']} | {s['frame_bytes']:,} | {s['frame_ratio']:.4f} | "
            f"{s['encode_gbs']:.2f} | {s['decode_gbs']:.2f} | {s['copy_floor_gbs']:.2f} | {'PASS' if ok else 'MISS'} |"
        )
    lines += ["", data.get("notes", "").strip()]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bandwidth", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="digits, 3 clients, 2 rounds, two codecs")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--work", type=Path, default=None, help="run directories (default runs/bench-bandwidth)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 20; quick 2)")
    parser.add_argument("--notes", type=Path, default=None, help="a Markdown file appended to the result (context)")
    for key in ("algorithms", "partitions", "codecs"):
        parser.add_argument(f"--{key}", default=None, help=f"comma-separated subset of the {key} to run")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    p = plan(args.quick, args.rounds)
    for key in ("algorithms", "partitions", "codecs"):
        if getattr(args, key):
            p[key] = getattr(args, key).split(",")
    p["downlink"] = [(a, c) for a, c in p["downlink"] if a in p["algorithms"] and c in p["codecs"]]
    work = args.work or (args.out or Path("runs")) / ("bench-bandwidth-quick" if args.quick else "bench-bandwidth")
    cells = [(part, alg, codec, "fp32") for codec in p["codecs"] for part in p["partitions"] for alg in p["algorithms"]]
    cells += [(part, alg, codec, "int8") for part in p["partitions"] for alg, codec in p["downlink"]]
    records = []
    for cell in cells:
        records.append(run_cell(p, *cell, work))
        print(f"{' '.join(cell)}: accuracy {records[-1]['final_accuracy']:.4f}", flush=True)
    ratios(records)
    data = {
        "argv": sys.argv[1:] if argv is None else argv,
        "quick": args.quick,
        "plan": p,
        "machine": machine(),
        "runs": records,
        "speed": speed(p["speed_sizes"], p["repeats"]),
        "notes": args.notes.read_text() if args.notes else "",
    }
    write_results(NAME, data, render(data), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
