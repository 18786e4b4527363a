"""Heterogeneous fleets in real processes (issue 14): `edge-server simulate --fleet` with two real clients in cgroups
of their own (a CPU quota per client, one that drops mid-run), and the `edge-server fleet` commands. The fleet's
logic on the in-process bus and on hand-made cgroup hierarchies: tests/unit/server/experiments/test_fleet.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgefl_testkit.basics import full_size, in_ci
from edgefl_testkit.fleet import assert_throttled, throttle_run
from server.config import load_config
from server.device_profiles import SHIPPED
from server.experiments.cgroups import PERIOD_US

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


# -------------------------------------------------------------------------------------- a throttling device, cgroups
def test_a_throttling_device_under_a_cgroup_quota_slows_down_and_is_told_fewer_steps(tmp_path: Path) -> None:
    """`edge-server simulate` with a device whose cgroup quota drops to a tenth from round 2: the kernel's cap is seen
    in the compute the device measures, in its throttling flags (its emulated vcgencmd) and in the steps it is told."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "server.cli", "simulate", "--config", throttle_run(tmp_path, 2), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    limits = json.loads((out / "summary.json").read_text())["fleet"]["cpu_limits"]
    if not limits.startswith("cgroup v"):
        (pytest.fail if in_ci() else pytest.skip)(limits)
    assert_throttled([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], 2)


# ------------------------------------------------------------------------------------------ kernel-enforced quotas
def test_a_client_under_a_tenth_of_a_core_computes_several_times_slower_and_the_server_knows(tmp_path: Path) -> None:
    """`edge-server simulate --fleet fast:1,slow:1` with user profiles of 50% and 10% of one core: each client never
    gets more than its quota (wall time >= its CPU seconds / its share, whatever else runs on the machine), so the same
    work takes the slow one several times longer whenever the machine gives the fast one more than the slow one's
    cap (about 5x on an idle machine; on one saturated by other work both get less than 10% and the caps are all that
    can be seen); and the overhead and seconds per step the server predicts with are the ones the client measured.
    300 local steps with EDGEFL_FULL set; 100 in the suite (the slow client's rounds, a third as long, still span
    dozens of the kernel's periods)."""
    steps = 300 if full_size() else 100
    (tmp_path / "run.toml").write_text(f"""
[run]
rounds = 2
[clients]
register_timeout_s = 120.0
[data]
dataset = "digits"
[train]
local_steps = {steps}
batch_size = 32
[fleet]
devices = "fast:1,slow:1"
[fleet.profiles.fast]
cpu_share = 0.5
uplink_mbps = 100
downlink_mbps = 100
[fleet.profiles.slow]
cpu_share = 0.1
uplink_mbps = 100
downlink_mbps = 100
""")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "server.cli", "simulate", "--config", str(tmp_path / "run.toml"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    limits = summary["fleet"]["cpu_limits"]
    if not limits.startswith("cgroup v"):
        (pytest.fail if in_ci() else pytest.skip)(limits)
    assert not Path(limits.split(" in ")[1]).exists()  # the run's cgroups are gone
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    fast, slow = ([r["clients"][c] for r in rows] for c in ("client-00", "client-01"))
    wall, cpu = ({k: sum(c[key] for c in runs) for k, runs in (("fast", fast), ("slow", slow))}
                 for key in ("compute_s", "cpu_s"))  # fmt: skip
    # The kernel's cap: a client runs at most share x period per period, after a first period that may fall whole
    # into the round (its quota at once, then the wait): per round at most one period less than CPU / share.
    slack = len(rows) * PERIOD_US / 1e6
    for name, share in (("fast", 0.5), ("slow", 0.1)):
        assert wall[name] >= cpu[name] / share - slack, (wall, cpu)
    if cpu["fast"] / wall["fast"] > 0.2:  # the machine gave the fast client more than twice the slow one's cap
        assert wall["slow"] / cpu["slow"] > 2 * wall["fast"] / cpu["fast"], (wall, cpu)
    logged = re.search(rf"round 1: {steps} steps in ([0-9.]+) s", (out / "clients" / "client-01.log").read_text())
    assert logged, "the slow client's log has no line for round 1"
    predicted = rows[1]["predictions"]["client-01"]
    assert predicted["steps"] == steps
    # its overhead, reported beside compute_s over the broker, and its steps add up to the compute it logged
    assert 0 < predicted["overhead_s"] < predicted["s_per_step"] * steps
    assert predicted["overhead_s"] + predicted["s_per_step"] * steps == pytest.approx(float(logged.group(1)), abs=5e-4)
    assert (out / "timeline.png").stat().st_size > 10_000


# -------------------------------------------------------------------------------------------------- the commands
def test_fleet_list_and_calibrate(tmp_path: Path) -> None:
    listing = subprocess.run([sys.executable, "-m", "server.cli", "fleet", "list"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, check=True).stdout  # fmt: skip
    for name, p in SHIPPED.items():
        assert f"{name}: {p.source[:40]}" in " ".join(listing.split())
    cmd = [sys.executable, "-m", "server.cli", "fleet", "calibrate", "--seconds-per-100-steps", "5", "--name", "slowpi",
           "--repeats", "1"]  # fmt: skip
    text = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    host = float(re.search(r"this machine: ([0-9.]+) CPU s per 100 steps", text).group(1))  # type: ignore[union-attr]
    (tmp_path / "p.toml").write_text(text[text.index("[fleet.profiles.slowpi]") :])
    profile = load_config(tmp_path / "p.toml").fleet.profiles["slowpi"]
    assert profile["cpu_share"] == pytest.approx(min(1.0, host / 5), abs=1e-3)
