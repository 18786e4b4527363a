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

Speeds that change: a profile may throttle, as a Pi 4 in the sun does (its firmware caps the clock at the soft
temperature limit). From round ``throttle_from_round`` on, its CPU share is ``throttle_share`` of its own
(``cpu.max`` lowered in broker mode, the CPU seconds divided by the lower share in-process), and the device reports
the Raspberry Pi flags a throttled board reports (``EMULATED_THROTTLED``, what ``vcgencmd get_throttled`` says then).
``like = "pi4"`` takes every key not given from another profile, so a throttling Pi 4 is three lines::

    [fleet.profiles.pi4-hot]
    like = "pi4"
    throttle_from_round = 10
    throttle_share = 0.5
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_client import device
from edge_client.algorithms.base import ClientAlgorithm
from edge_client.data import ArrayDataset, BatchSampler
from edge_client.flat import FlatModel
from edge_client.messages import RoundFacts
from edge_client.plan import Plan
from edge_client.runtime import TrainFn
from edge_client.trainer import TrainResult
from server.config import RunConfig

#: The measurement every shipped share is relative to: this repository's machine, one core.
REFERENCE_MODEL = "cnn-mnist"
REFERENCE_S_PER_100 = 0.387
REFERENCE_SOURCE = (
    "measured: 0.387 s per 100 local steps (cnn-mnist, FedAvg, batch 64, 1 thread; median of 11) on this repository's "
    "2-core AMD EPYC, benchmarks/results/client_overhead.json"
)

_NAME_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_PROFILE_KEYS = {"cpu_share", "uplink_mbps", "downlink_mbps", "source", "like", "throttle_from_round", "throttle_share"}
#: What a throttled board's ``vcgencmd get_throttled`` says (edge_client.device.THROTTLE_BITS): frequency capped,
#: throttled and at the soft temperature limit now (bits 1-3), and each "has occurred" since boot (bits 17-19).
EMULATED_THROTTLED = 0xE000E


@dataclass(frozen=True)
class DeviceProfile:
    """One device class: ``cpu_share`` of one core of this machine, its link rates, and where the numbers come from."""

    name: str
    cpu_share: float
    uplink_mbps: float
    downlink_mbps: float
    source: str
    throttle_from_round: int = 0  # 0: never throttles
    throttle_share: float = 1.0  # the fraction of cpu_share left once throttled

    def throttled_at(self, round_: int) -> bool:
        """Whether the device is throttled in this round (1-based)."""
        return 0 < self.throttle_from_round <= round_

    def share_at(self, round_: int) -> float:
        """Its CPU share of one core of this machine in this round."""
        return self.cpu_share * self.throttle_share if self.throttled_at(round_) else self.cpu_share

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


def profile_from_table(name: str, table: Mapping[str, Any], known: Mapping[str, DeviceProfile]) -> DeviceProfile:
    """A ``[fleet.profiles.NAME]`` table as a profile (keys it leaves out from its ``like`` profile among ``known``);
    ValueError names the key and what it must be."""
    where = f"[fleet.profiles.{name}]"
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"{where}: a profile name is lower-case letters, digits, '-' or '_' (at most 32)")
    unknown = sorted(set(table) - _PROFILE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(_PROFILE_KEYS))}")
    base: dict[str, Any] = {}
    if "like" in table:
        like = table["like"]
        if like not in known:
            raise ValueError(f"{where}: like = {like!r} is not a profile; known: {', '.join(sorted(known))}")
        base = dataclasses.asdict(known[like])
        base["source"] = f"like {like} ({base['source']})"
    merged = {**base, **{k: v for k, v in table.items() if k != "like"}}
    values: dict[str, float] = {}
    for key in ("cpu_share", "uplink_mbps", "downlink_mbps"):
        v = merged.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f'{where}: {key} must be a number > 0 (or like = "pi4" to take it from pi4); got {v!r}')
        values[key] = float(v)
    if values["cpu_share"] > 1.0:
        raise ValueError(
            f"{where}: cpu_share must be at most 1 (one core of this machine: a client trains on one thread); got "
            f"{values['cpu_share']!r}"
        )
    source = merged.get("source", "user profile")
    if not isinstance(source, str):
        raise ValueError(f"{where}: source must be a string (where the numbers come from)")
    start = merged.get("throttle_from_round", 0)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"{where}: throttle_from_round must be a round >= 1 (0: never throttles); got {start!r}")
    fraction = merged.get("throttle_share", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise ValueError(f"{where}: throttle_share must be a fraction in (0, 1] of cpu_share; got {fraction!r}")
    return DeviceProfile(name, values["cpu_share"], values["uplink_mbps"], values["downlink_mbps"], source,
                         start, float(fraction))  # fmt: skip


def profiles(user: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, DeviceProfile]:
    """The shipped profiles, with the user's tables added or replacing shipped ones of the same name."""
    out = dict(SHIPPED)
    for name, table in (user or {}).items():
        if not isinstance(table, Mapping):
            raise ValueError(f"[fleet.profiles.{name}] must be a table of cpu_share, uplink_mbps, downlink_mbps")
        out[name] = profile_from_table(name, table, out)
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

    def shares(self, round_: int = 1) -> dict[str, float]:
        """Each client's CPU share in this round (its cgroup quota, in cores)."""
        return {cid: p.share_at(round_) for cid, p in self.by_client.items()}

    def throttles(self) -> dict[int, list[str]]:
        """The clients that start throttling, by the round they do."""
        out: dict[int, list[str]] = {}
        for cid, p in self.by_client.items():
            if p.throttle_from_round:
                out.setdefault(p.throttle_from_round, []).append(cid)
        return out

    def describe(self) -> dict[str, Any]:
        """The fleet for summary.json: the spec and each class's profile as used."""
        used = {p.name: p for p in self.by_client.values()}
        return {
            "spec": self.spec,
            "profiles": {n: {"cpu_share": p.cpu_share, "uplink_mbps": p.uplink_mbps,
                             "downlink_mbps": p.downlink_mbps, "source": p.source,
                             **({"throttle_from_round": p.throttle_from_round, "throttle_share": p.throttle_share}
                                if p.throttle_from_round else {})} for n, p in used.items()},
        }  # fmt: skip


def fleet_of(config: RunConfig, ids: list[str]) -> Fleet | None:
    """The configured fleet (``[fleet]``, ``--fleet``) over these client ids, or None without one."""
    return Fleet.of(config.fleet.devices, ids, config.fleet.profiles) if config.fleet.devices else None


def fleet_size(spec: str, user: Mapping[str, Mapping[str, Any]] | None = None) -> int:
    """How many devices ``spec`` names (``clients.count`` follows it when not given)."""
    return sum(count for _, count in parse_fleet(spec, profiles(user)))


def slowed(train: TrainFn, profile: DeviceProfile, facts: DeviceFacts | None = None) -> TrainFn:
    """In-process: ``train`` whose reported compute and CPU seconds are what a device of ``profile`` would have spent
    in the plan's round: the CPU seconds measured here divided by its share then (CPU seconds, not wall time, so
    other work on this machine does not slow the simulated device; shares are calibrated on CPU seconds too). These
    are the device seconds the server and the parallel clock work with. ``facts`` learns the round, so the device's
    metrics say when it is throttled."""

    def run(
        flat: FlatModel, weights: np.ndarray, data: ArrayDataset, sampler: BatchSampler, plan: Plan,
        algorithm: ClientAlgorithm, round_facts: RoundFacts,
    ) -> TrainResult:  # fmt: skip
        if facts is not None:
            facts.round = round_facts.round
        result = train(flat, weights, data, sampler, plan, algorithm, round_facts)
        share = profile.share_at(round_facts.round)
        result.cpu_s /= share
        result.compute_s = result.cpu_s
        result.overhead_s = result.overhead_cpu_s = result.overhead_cpu_s / share
        return result

    return run


@dataclass
class DeviceFacts:
    """In-process: one simulated device's metrics snapshot (``EdgeClient(snapshot=...)``), this machine's except the
    Raspberry Pi throttling flags, which say what its profile does in the round it is training."""

    profile: DeviceProfile
    round: int = 0

    def snapshot(self) -> dict[str, Any]:
        snap = device.snapshot()
        if self.profile.throttled_at(self.round):
            snap["throttled"] = EMULATED_THROTTLED
            snap["throttled_flags"] = device.decode_throttled(EMULATED_THROTTLED)
        return snap


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
