"""Device profiles and simulated fleets: how fast each device class computes, and how fast its link is.

A profile is a CPU share of one core of this machine (a client of that class gets that share through a cgroup quota,
``server.experiments.cgroups``, or, in-process, has the CPU seconds it measured divided by it) plus uplink and downlink
rates in Mbit/s. The share is this machine's seconds per 100 local steps over the device's, for the same model, batch
and thread count as ``edge-client benchmark`` (cnn-mnist, FedAvg, batch 64, one thread): ``edge-server fleet
calibrate --seconds-per-100-steps X`` measures this machine and prints the profile for a device that reported X.

The shipped Raspberry Pi profiles are derived from one reference measurement of this repository's machine and the
device figures below; every figure says where it comes from, and the ones we could not measure say they are
estimates. ``[fleet.profiles.NAME]`` tables in a configuration add profiles or replace shipped ones (a calibrated
``pi4`` for your machine).

A fleet is written ``pi5:2,pi4:5,pi3:3`` (``--fleet``, ``[fleet] devices``): classes in client order, so
``client-00`` and ``client-01`` are the two ``pi5`` here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.data import ArrayDataset, BatchSampler
from edge_client.flat import FlatModel
from edge_client.runtime import TrainFn
from edge_client.trainer import Plan, TrainResult
from server.config import RunConfig

#: The measurement every shipped share is relative to: this repository's machine, one core.
REFERENCE_MODEL = "cnn-mnist"
REFERENCE_S_PER_100 = 0.387
REFERENCE_SOURCE = (
    "measured: 0.387 s per 100 local steps (cnn-mnist, FedAvg, batch 64, 1 thread; median of 11) on this repository's "
    "2-core AMD EPYC, benchmarks/results/client_overhead.json"
)

_NAME_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_PROFILE_KEYS = {"cpu_share", "uplink_mbps", "downlink_mbps", "source"}


@dataclass(frozen=True)
class DeviceProfile:
    """One device class: ``cpu_share`` of one core of this machine, its link rates, and where the numbers come from."""

    name: str
    cpu_share: float
    uplink_mbps: float
    downlink_mbps: float
    source: str

    def transfer_s(self, bytes_down: int, bytes_up: int) -> tuple[float, float]:
        """Seconds to download and to upload that many bytes at this class's link rates."""
        return 8.0 * bytes_down / (self.downlink_mbps * 1e6), 8.0 * bytes_up / (self.uplink_mbps * 1e6)


def _shipped(name: str, board: str, s_per_100: float, cpu: str, up: float, down: float, link: str) -> DeviceProfile:
    share = round(REFERENCE_S_PER_100 / s_per_100, 4)
    source = f"{board}: {s_per_100:g} s per 100 steps of {REFERENCE_MODEL} ({cpu}); links {link}"
    return DeviceProfile(name, share, up, down, source)


PI4_S_PER_100 = 3.2
SHIPPED: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        _shipped(
            "pi5", "Raspberry Pi 5 (Cortex-A76, 2.4 GHz)", round(PI4_S_PER_100 / 2.5, 3),
            "estimate: the Pi 4B figure / 2.5, the middle of the '2-3x increase in CPU performance relative to "
            "Raspberry Pi 4' of Raspberry Pi Ltd's launch post, raspberrypi.com/news/introducing-raspberry-pi-5",
            40.0, 100.0, "estimate: 5 GHz Wi-Fi shared with other devices, uplink slower than downlink",
        ),
        _shipped(
            "pi4", "Raspberry Pi 4B (Cortex-A72, 1.5 GHz)", PI4_S_PER_100,
            "estimate, no Pi 4B measurement of this model available to us: one A72 core taken as 1/8 of one core of "
            "the reference machine for fp32 CNN training (128-bit NEON at 1.5 GHz against AVX2 at ~2.6 GHz); "
            "calibrate with a real device's edge-client benchmark",
            20.0, 60.0, "estimate: Wi-Fi shared with other devices, uplink slower than downlink",
        ),
        _shipped(
            "pi3", "Raspberry Pi 3B+ (Cortex-A53, 1.4 GHz)", PI4_S_PER_100 * 3,
            "estimate: the Pi 4B figure x 3, the '~3x performance' of the Pi 4B over the 3B+ in Raspberry Pi Ltd's "
            "launch post, raspberrypi.com/news/raspberry-pi-4-on-sale-now-from-35",
            10.0, 30.0, "estimate: 2.4 GHz Wi-Fi; its wired port is Gigabit over USB 2.0, 'maximum throughput "
            "300 Mbps' by the 3B+ product brief, which a field device seldom has",
        ),
    )
}  # fmt: skip


def profile_from_table(name: str, table: Mapping[str, Any]) -> DeviceProfile:
    """A ``[fleet.profiles.NAME]`` table as a profile; ValueError names the key and what it must be."""
    where = f"[fleet.profiles.{name}]"
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"{where}: a profile name is lower-case letters, digits, '-' or '_' (at most 32)")
    unknown = sorted(set(table) - _PROFILE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(_PROFILE_KEYS))}")
    values: dict[str, float] = {}
    for key in ("cpu_share", "uplink_mbps", "downlink_mbps"):
        v = table.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{where}: {key} must be a number > 0; got {v!r}")
        values[key] = float(v)
    if values["cpu_share"] > 1.0:
        raise ValueError(
            f"{where}: cpu_share must be at most 1 (one core of this machine: a client trains on one thread); got "
            f"{values['cpu_share']!r}"
        )
    source = table.get("source", "user profile")
    if not isinstance(source, str):
        raise ValueError(f"{where}: source must be a string (where the numbers come from)")
    return DeviceProfile(name, values["cpu_share"], values["uplink_mbps"], values["downlink_mbps"], source)


def profiles(user: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, DeviceProfile]:
    """The shipped profiles, with the user's tables added or replacing shipped ones of the same name."""
    out = dict(SHIPPED)
    for name, table in (user or {}).items():
        if not isinstance(table, Mapping):
            raise ValueError(f"[fleet.profiles.{name}] must be a table of cpu_share, uplink_mbps, downlink_mbps")
        out[name] = profile_from_table(name, table)
    return out


def parse_fleet(text: str, known: Mapping[str, DeviceProfile]) -> list[tuple[DeviceProfile, int]]:
    """``pi5:2,pi4:5,pi3:3`` as (profile, count) pairs in order; ValueError says what is wrong."""
    out: list[tuple[DeviceProfile, int]] = []
    for part in (p.strip() for p in text.split(",")):
        name, _, count = part.partition(":")
        if name not in known:
            raise ValueError(f"fleet {text!r}: unknown device class {name!r}; known: {', '.join(sorted(known))}")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"fleet {text!r}: expected CLASS:COUNT with COUNT >= 1, e.g. pi4:5; got {part!r}")
        out.append((known[name], int(count)))
    if len({p.name for p, _ in out}) != len(out):
        raise ValueError(f"fleet {text!r}: name each device class once")
    return out


@dataclass(frozen=True)
class Fleet:
    """Which profile each simulated client has (client ids in order, classes in the order the spec names them)."""

    spec: str
    by_client: dict[str, DeviceProfile]

    @classmethod
    def of(cls, spec: str, ids: list[str], user: Mapping[str, Mapping[str, Any]] | None = None) -> Fleet:
        parsed = parse_fleet(spec, profiles(user))
        classes = [p for p, count in parsed for _ in range(count)]
        if len(classes) != len(ids):
            raise ValueError(f"fleet {spec!r} has {len(classes)} devices for {len(ids)} clients")
        return cls(spec, dict(zip(ids, classes, strict=True)))

    @property
    def total_share(self) -> float:
        """Cores of this machine the whole fleet's quotas add up to."""
        return sum(p.cpu_share for p in self.by_client.values())

    def shares(self) -> dict[str, float]:
        """Each client's CPU share (its cgroup quota, in cores)."""
        return {cid: p.cpu_share for cid, p in self.by_client.items()}

    def describe(self) -> dict[str, Any]:
        """The fleet for summary.json: the spec and each class's profile as used."""
        used = {p.name: p for p in self.by_client.values()}
        return {
            "spec": self.spec,
            "profiles": {n: {"cpu_share": p.cpu_share, "uplink_mbps": p.uplink_mbps,
                             "downlink_mbps": p.downlink_mbps, "source": p.source} for n, p in used.items()},
        }  # fmt: skip


def fleet_of(config: RunConfig, ids: list[str]) -> Fleet | None:
    """The configured fleet (``[fleet]``, ``--fleet``) over these client ids, or None without one."""
    return Fleet.of(config.fleet.devices, ids, config.fleet.profiles) if config.fleet.devices else None


def fleet_size(spec: str, user: Mapping[str, Mapping[str, Any]] | None = None) -> int:
    """How many devices ``spec`` names (``clients.count`` follows it when not given)."""
    return sum(count for _, count in parse_fleet(spec, profiles(user)))


def slowed(train: TrainFn, share: float) -> TrainFn:
    """In-process: ``train`` whose reported compute and CPU seconds are what a device with ``share`` of one core of
    this machine would have spent: the CPU seconds measured here divided by the share (CPU seconds, not wall time, so
    other work on this machine does not slow the simulated device; shares are calibrated on CPU seconds too). These
    are the device seconds the server and the parallel clock work with."""

    def run(
        flat: FlatModel, weights: np.ndarray, data: ArrayDataset, sampler: BatchSampler, plan: Plan,
        algorithm: ClientAlgorithm,
    ) -> TrainResult:  # fmt: skip
        result = train(flat, weights, data, sampler, plan, algorithm)
        result.cpu_s /= share
        result.compute_s = result.cpu_s
        result.overhead_s = result.overhead_cpu_s = result.overhead_cpu_s / share
        return result

    return run


def calibrated(
    name: str, device_s_per_100: float, host_s_per_100: float, links: tuple[float, float] | None = None
) -> DeviceProfile:
    """The profile of a device that reported ``device_s_per_100``, for this machine's ``host_s_per_100``; its
    ``links`` (uplink, downlink Mbit/s) as given, else those of the shipped profile of that name (or of ``pi4``)."""
    if device_s_per_100 <= 0 or host_s_per_100 <= 0:
        raise ValueError("seconds per 100 steps must be > 0")
    share = round(min(1.0, host_s_per_100 / device_s_per_100), 4)
    base = SHIPPED.get(name, SHIPPED["pi4"])
    up, down = links or (base.uplink_mbps, base.downlink_mbps)
    link = "as given" if links else f"the shipped {base.name} profile's ({base.source.split('; links ')[-1]})"
    source = (
        f"calibrated: the device's {device_s_per_100:g} s per 100 steps against {host_s_per_100:.4g} s on this "
        f"machine; links {link}"
    )
    return DeviceProfile(name, share, up, down, source)


def profile_toml(p: DeviceProfile) -> str:
    """The ``[fleet.profiles.NAME]`` table of a profile, to paste into a configuration."""
    return (
        f"[fleet.profiles.{p.name}]\ncpu_share = {p.cpu_share:g}\nuplink_mbps = {p.uplink_mbps:g}\n"
        f"downlink_mbps = {p.downlink_mbps:g}\nsource = {json.dumps(p.source)}\n"
    )
