"""Simulated fleets: each simulated client gets the profile of its device class (``server.device_profiles``).

A client of a class gets its CPU share through a cgroup quota (``server.experiments.cgroups``) or, in-process, has the
CPU seconds it measured divided by it.

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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.loop import device
from edge_client.loop.runtime import TrainFn
from edge_client.loop.trainer import TrainResult
from edge_client.wire.messages import RoundFacts
from edge_client.wire.plan import Plan
from server.config import RunConfig
from server.device_profiles import DeviceProfile, parse_fleet, profiles

#: What a throttled board's ``vcgencmd get_throttled`` says (edge_client.loop.device.THROTTLE_BITS): frequency capped,
#: throttled and at the soft temperature limit now (bits 1-3), and each "has occurred" since boot (bits 17-19).
EMULATED_THROTTLED = 0xE000E


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
