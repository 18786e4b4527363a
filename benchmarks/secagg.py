"""Secure aggregation's cost for the TACO CNN on MNIST: a device's work and bytes per round, and the server's unmasking.

A device's cost depends on its number of neighbours ``k`` alone (the complete graph of the original SecAgg:
``k = n - 1``; SecAgg+'s sparse graph: ``k`` fixed). For each configuration the real library code
(``edge_client.secagg``) runs one device's round among ``k + 1`` devices in memory: its keys, its encrypted shares
for ``k`` neighbours, decrypting theirs and masking its update (``k`` pairwise streams and its own), and its reveal;
the wall clock of each stage is timed on this machine (median of the repeats). Its bytes are the real frames of its
messages (``edge_client.wire.protocol.encode``), up and down, against the plain fp32 update it would upload otherwise.
The server's unmasking of ``n`` inputs (one seed rebuilt from ``t`` shares and one stream per survivor, plus a mask
key and ``k`` streams per dropped device) is timed the same way. The target: the device's overhead per round below
the time of 10 local steps of the same model (FedAvg, batch 64, one torch thread, ``edge_client.tools.speed``); total
bytes per device below 1.5x the plain fp32 upload at 100 devices with SecAgg+'s graph.

    python -m benchmarks.secagg [--quick] [--emulated] [--out DIR]

``--emulated`` labels a run made under the emulated Cortex-A72 (``qemu-aarch64 -cpu cortex-a72``, as
``firmware_scripts/qemu-smoke.sh`` runs a device) and writes ``secagg-emulated.json/.md``: the emulator's times, not a
Pi's (it translates every instruction, so it is slower than the real core), and the 10 local steps of the target are
timed under the same emulation.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.common import machine, machine_line, write_results

NAME = "secagg"
MODEL = {"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28}  # TACO's CNN on MNIST
THRESHOLD = 0.6  # [privacy] threshold's default
#: (devices n, neighbours k): the complete graph at 10, 50 and 100 devices, and SecAgg+'s graph at 100
CONFIGS = [(10, 9), (50, 49), (100, 99), (100, 14)]
QUICK_CONFIGS = [(10, 9), (100, 14)]
DROPPED = 0.1  # the server's unmasking is also timed with this fraction dropped before masking
BYTES_TARGET = 1.5
STEPS = 10


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def device_round(k: int, size: int, delta: np.ndarray, n: int) -> dict[str, Any]:
    """One device's stages among ``k + 1`` devices (all in memory), timed, and the frames it sends and receives."""
    from edge_client.secagg.device import DeviceRound
    from edge_client.secagg.ring import Ring
    from edge_client.wire import messages as M
    from edge_client.wire.protocol import encode

    ids = [f"d{i:03d}" for i in range(k + 1)]
    me, others = ids[0], ids[1:]
    t = max(2, math.ceil(THRESHOLD * (k + 1)))
    device, keys_s = _timed(lambda: DeviceRound(me, "bench", 1))
    peers = {v: DeviceRound(v, "bench", 1) for v in others}
    keys = {v: p.keys() for v, p in peers.items()}
    (commit, sealed), share_s = _timed(lambda: device.share(keys, t))
    incoming = {}
    for v, p in peers.items():  # each neighbour's shares for this device (their sharing is their cost)
        p.roster = {me: device.keys()}
        incoming[v] = p.share({me: device.keys()}, 2)[1][me]
    ring = Ring(32, 2.0, n)

    def mask() -> np.ndarray:
        device.receive(incoming)
        return device.masked(ring.quantise(delta, 1.0 / n), ring)

    masked, mask_s = _timed(mask)
    shares, reveal_s = _timed(lambda: device.reveal(ids, []))
    up = [
        M.SecAggKeys(1, me, device.keys().enc, device.keys().mask, "bench"),
        M.SecAggShares(1, me, commit, [[v, s] for v, s in sealed.items()], "bench"),
        M.MaskedInput(1, 0, me, STEPS, 1.0, 1.0, 0.5, masked.astype("<u4").tobytes(), run_id="bench"),
        M.SecAggReveal(1, me, [list(s) for s in shares], "bench"),
    ]
    down = [
        M.SecAggRoster(1, t, [[v, keys[v].enc, keys[v].mask] for v in others], "bench"),
        M.SecAggRelay(1, [[v, incoming[v]] for v in others], "bench"),
        M.SecAggUnmask(1, ids, [], "bench"),
    ]
    plain = M.Update(1, 0, me, 600, STEPS, 1.0, 1.0, 0.5, delta.astype(np.float32), run_id="bench")
    return {
        "keys_s": keys_s,
        "share_s": share_s,
        "mask_s": mask_s,
        "reveal_s": reveal_s,
        "bytes_up": sum(len(encode(m)) for m in up),
        "bytes_down": sum(len(encode(m)) for m in down),
        "plain_up": len(encode(plain)),
        "threshold": t,
        "size": size,
    }


def server_unmask(n: int, k: int, size: int) -> dict[str, float]:
    """The server's unmasking work for ``n`` inputs: a seed rebuilt from ``t`` shares and its stream per survivor, a
    mask key and ``k`` pairwise streams per dropped device (``DROPPED`` of them)."""
    from edge_client.secagg import crypto, shamir

    t = max(2, math.ceil(THRESHOLD * (k + 1)))
    seed = crypto.random_seed()
    shares = shamir.split(seed, t, list(range(1, t + 1)))
    dropped = round(DROPPED * n)

    def work() -> None:
        total = np.zeros(size, np.uint32)
        for _ in range(n - dropped):
            total -= crypto.mask(shamir.combine(shares), size)
        for _ in range(dropped):
            key = crypto.KeyPair.from_secret(shamir.combine(shares))
            for _ in range(k):
                total += crypto.mask(crypto.agree(key.secret, key.public, b"bench", b"mask"), size)

    return {"unmask_s": _timed(work)[1], "dropped": dropped}


def measure(quick: bool, emulated: bool = False) -> dict[str, Any]:
    from edge_client.learning.models import build_model, get_flat
    from edge_client.tools.speed import benchmark

    size = get_flat(build_model(MODEL)).size
    delta = np.random.default_rng(0).normal(0, 1e-3, size).astype(np.float32)
    repeats = 1 if quick else 3
    steps = benchmark({"cnn-mnist": MODEL}, ["fedavg"], steps=STEPS, repeats=3, inference=False)[0]
    ten_steps_s = steps["s_per_100"] * STEPS / 100
    device_round(2, size, delta, 3)  # untimed: the cryptography backend's first use initialises it
    rows = []
    for n, k in QUICK_CONFIGS if quick else CONFIGS:
        runs = [device_round(k, size, delta, n) for _ in range(repeats)]
        row: dict[str, Any] = {"devices": n, "neighbours": k, **runs[0]}
        for key in ("keys_s", "share_s", "mask_s", "reveal_s"):
            row[key] = statistics.median(r[key] for r in runs)
        row["device_s"] = row["keys_s"] + row["share_s"] + row["mask_s"] + row["reveal_s"]
        row["bytes_ratio"] = (row["bytes_up"] + row["bytes_down"]) / row["plain_up"]
        row.update(server_unmask(n, k, size))
        rows.append(row)
    return {
        "quick": quick, "emulated": emulated, "machine": machine(), "params": size, "ten_steps_s": ten_steps_s,
        "rows": rows,
    }  # fmt: skip


def render(data: dict[str, Any]) -> str:
    emulated = data.get("emulated", False)
    where = (
        "under the emulated Cortex-A72 (qemu-aarch64 on this machine): every time is the emulator's wall clock, not a "
        "Pi's"
        if emulated
        else "every time on this machine's wall clock (a device's stages run here, not on a Pi)"
    )
    flags = "".join(f" --{f}" for f in ("quick", "emulated") if data.get(f))
    lines = [
        f"## Secure aggregation{', emulated Cortex-A72' if emulated else ''}",
        "",
        machine_line(data["machine"]),
        f"Command: `python -m benchmarks.secagg{flags}`; TACO CNN on MNIST, {data['params']} parameters; {where}; "
        f"bytes are the frames each device's own link carries. {STEPS} local steps (FedAvg, batch 64, one thread, "
        f"timed the same way): {data['ten_steps_s']:.3f} s.",
        "",
        "| devices | neighbours | t | keys s | share s | mask s | reveal s | device s | target < 10 steps | up B | "
        "down B | plain fp32 up B | bytes / plain | server unmask s (10% dropped) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        verdict = "PASS" if r["device_s"] < data["ten_steps_s"] else "MISS"
        lines.append(
            f"| {r['devices']} | {r['neighbours']} | {r['threshold']} | {r['keys_s']:.4f} | {r['share_s']:.4f} | "
            f"{r['mask_s']:.4f} | {r['reveal_s']:.4f} | {r['device_s']:.3f} | {verdict} | {r['bytes_up']} | "
            f"{r['bytes_down']} | {r['plain_up']} | {r['bytes_ratio']:.3f} | {r['unmask_s']:.3f} |"
        )
    secagg_plus = [r for r in data["rows"] if r["devices"] == 100 and r["neighbours"] < 99]
    for r in secagg_plus:
        verdict = "PASS" if r["bytes_ratio"] < BYTES_TARGET else "MISS"
        lines += ["", f"{verdict}: bytes per device at 100 devices, SecAgg+ degree {r['neighbours']}: "
                  f"{r['bytes_ratio']:.3f}x the plain fp32 upload (target < {BYTES_TARGET}x)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.secagg", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 devices complete and 100 with SecAgg+, one repeat")
    parser.add_argument("--emulated", action="store_true", help="label a run under the emulated Cortex-A72")
    parser.add_argument("--out", default=None, help="directory for secagg.json and secagg.md")
    args = parser.parse_args(argv)
    data = measure(args.quick, args.emulated)
    name = f"{NAME}-emulated" if args.emulated else NAME
    _, md_path = write_results(name, data, render(data), args.out)
    print(md_path.read_text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
