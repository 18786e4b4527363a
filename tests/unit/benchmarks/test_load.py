"""The load benchmark's aggregate check (benchmarks/load.py) catches a lost or doubled update, plain or through secure
aggregation's ring, else "exact" would prove nothing; its secure run clips nothing and its command line refuses a
configuration the server would refuse. The benchmark run: tests/integration/benchmarks/test_load.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import load
from edge_client.secagg import parts
from edge_client.secagg.ring import Ring

CLIENTS, SIZE = 5, 1000


class _NoSampler:
    def take(self) -> dict[str, float]:
        return {"server": 0.0, "broker": 0.0}


def _round_row(clients: int) -> dict:
    return {
        "round": 1,
        "round_s": 0.0,
        "aggregate_s": 0.0,
        "eval_s": 0.0,
        "clients_selected": clients,
        "clients_reported": clients,
        "missing": [],
        "rejected": {},
        "clients": {},
        "instructions": {},
        "bytes_out": 0,
    }


def _check(tmp_path: Path, w0: np.ndarray, new: np.ndarray, ring: Ring | None) -> dict:
    checker = load.Checker(tmp_path, w0, CLIENTS, _NoSampler(), ring)  # type: ignore[arg-type]
    np.savez(tmp_path / "checkpoint.npz", weights=new)
    checker.round_done(_round_row(CLIENTS))
    return checker.rounds[0]


@pytest.mark.parametrize(("counted", "exact"), [(range(5), True), (range(4), False), ([0, 1, 2, 3, 4, 4], False)])
def test_checker_detects_a_lost_or_doubled_update(tmp_path: Path, counted: list[int], exact: bool) -> None:
    w0 = np.random.default_rng(0).normal(0, 0.05, SIZE).astype(np.float32)
    base = load.base_vector(SIZE)
    deltas = [load.delta_for(base, i, CLIENTS, 1) for i in counted]
    assert _check(tmp_path, w0, w0 - np.mean(deltas, axis=0, dtype=np.float32), None)["aggregate_exact"] is exact


def _secure_mean(ring: Ring, counted: list[int], leftover_mask: bool) -> np.ndarray:
    """What the server's unmasking gives: the devices' quantised updates (``parts.quantise``, as a device masks it)
    summed in the ring, decoded, divided by the counted devices' weights."""
    terms = {"weight": 1 / CLIENTS, "devices": CLIENTS}
    base, summed = load.base_vector(SIZE), (("delta", "weighted"),)
    total = np.zeros(SIZE, np.uint32)
    for i in counted:
        q, _ = parts.quantise(ring, summed, {"delta": load.delta_for(base, i, CLIENTS, 1)}, terms, 1)
        total = ring.add(total, q)
    if leftover_mask:  # one pairwise mask whose partner's never came: the sum is noise
        total = ring.add(total, np.random.default_rng(1).integers(0, 2**32, SIZE, dtype=np.uint32))
    return ring.decode(total) / np.float32(len(counted) / CLIENTS)


@pytest.mark.parametrize(
    ("counted", "leftover_mask", "exact"),
    [(range(5), False, True), (range(4), False, False), ([0, 1, 2, 3, 4, 4], False, False), (range(5), True, False)],
)
def test_secure_checker_allows_the_rings_rounding_and_nothing_more(
    tmp_path: Path, counted: list[int], leftover_mask: bool, exact: bool
) -> None:
    """Through the ring the mean is off by up to the quantisation error: allowed. A masked input lost or doubled, or
    masks that do not cancel, are not."""
    ring = load.round_ring(load.privacy_for(SIZE, CLIENTS, 1, 0), CLIENTS)
    w0 = np.random.default_rng(0).normal(0, 0.05, SIZE).astype(np.float32)
    record = _check(tmp_path, w0, w0 - _secure_mean(ring, list(counted), leftover_mask), ring)
    assert record["aggregate_exact"] is exact
    assert record["tolerance_share"] <= load.TOLERANCE_SHARE


def test_the_secure_tolerance_is_the_rings_rounding_and_far_below_one_client_at_100_devices() -> None:
    """At the issue's largest size (100 devices, the default 100k parameters and 10 rounds) the ring's rounding stays
    far below one client's least contribution, and the clip norm is above every update (nothing is clipped)."""
    clients, params, rounds = 100, 100_000, 10
    privacy = load.privacy_for(params, clients, rounds, 0)
    ring = load.round_ring(privacy, clients)
    assert (ring.bits, ring.clip, ring.devices) == (32, privacy["clip_norm"], clients)
    assert load.quantisation_error(ring) == clients / 2 / ring.scale
    assert load.quantisation_error(ring) < 0.1 * load.SCALE * 1 / clients  # round 1, client 0, element of base 1
    base = load.base_vector(params).astype(np.float64)
    longest = max(np.linalg.norm(load.delta_for(base, i, clients, rounds)) for i in range(clients))
    assert longest * load.CLIP_MARGIN == pytest.approx(privacy["clip_norm"], rel=1e-6)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--sizes", "1,10"], "expected sizes >= 2"),
        (["--sizes", "ten"], "expected sizes like 10,50,100"),
        (["--sizes", "10", "--clients", "20"], "--sizes and --clients are exclusive"),
        (["--secure", "--neighbours", "3"], "privacy.neighbours must be"),
    ],
)
def test_command_line_refusals_name_the_flag_or_key(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        load.main(argv)
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err


def test_the_command_line_is_reported_as_given() -> None:
    cfg = {"clients": 100, "sizes": [10, 50, 100], "sizes_given": True, "rounds": 10, "params_requested": 100_000,
           "workers": 4, "chunk_size": 131072, "neighbours": 14}  # fmt: skip
    assert load.command({"config": cfg, "quick": False, "secure": True}) == (
        "python -m benchmarks.load --sizes 10,50,100 --rounds 10 --params 100000 --workers 4 --chunk-size 131072 "
        "--secure --neighbours 14"
    )
    plain = {**cfg, "sizes": [250, 500, 1000], "sizes_given": False, "clients": 1000}
    assert load.command({"config": plain, "quick": False}).startswith("python -m benchmarks.load --clients 1000 ")
