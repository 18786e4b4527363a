"""A throttling device's run, shared by its in-process test (tests/unit) and its cgroup test (tests/integration)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgefl_testkit.basics import full_size

#: the deadline policy's budget and ceiling: the release check's, and the suite's (fewer steps under the tenth of a
#: share, the same 10x drop to see and the same adaptation to assert)
BUDGET_S, TAU_MAX = (1.0, 300) if full_size() else (0.3, 100)


def throttle_run(tmp_path: Path, hot_from: int) -> str:
    """A run configuration of two clients on digits, FedNova with the deadline steps policy; ``client-00`` drops to a
    tenth of its share from round ``hot_from`` on."""
    path = tmp_path / "run.toml"
    path.write_text(f"""
[run]
rounds = {hot_from + 1}
[clients]
register_timeout_s = 120.0
[data]
dataset = "digits"
[train]
algorithm = "fednova"
local_steps = 100
batch_size = 64
steps_policy = "deadline"
round_budget_s = {BUDGET_S}
tau_min = 1
tau_max = {TAU_MAX}
[algorithm.fednova]
local_steps_mode = "fixed"
[fleet]
devices = "hot:1,cool:1"
[fleet.profiles.hot]
cpu_share = 0.5
uplink_mbps = 1000
downlink_mbps = 1000
throttle_from_round = {hot_from}
throttle_share = 0.1
[fleet.profiles.cool]
like = "hot"
throttle_from_round = 0
""")
    return str(path)


def assert_throttled(rows: list[dict[str, Any]], hot_from: int) -> None:
    """The hot device's measured seconds per step rise about 10x from ``hot_from`` on, its flags say it is throttled
    (and not before), and the deadline policy tells it fewer steps the round after."""
    hot = [r["clients"]["client-00"] for r in rows]
    per_step = [c["compute_s"] / c["local_steps"] for c in hot]
    before, after = per_step[hot_from - 2], per_step[hot_from - 1]
    assert after > 2.5 * before, per_step  # a 10x drop in CPU share, with ample room for this machine's noise
    flags = [c["device"]["round"]["throttled_flags"] or [] for c in hot]
    assert all("throttled" not in f for f in flags[: hot_from - 1]), flags
    assert all({"throttled", "soft_temp_limit", "throttled_occurred"} <= set(f) for f in flags[hot_from - 1 :]), flags
    told = [r["instructions"]["client-00"]["local_steps"] for r in rows]
    assert told[hot_from] < 0.5 * told[hot_from - 1], told  # adapted in the round after the drop
    cool = [r["instructions"]["client-01"]["local_steps"] for r in rows]
    assert cool[hot_from] > 0.5 * cool[hot_from - 1], cool  # the other device keeps its steps
