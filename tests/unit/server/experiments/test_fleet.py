"""Heterogeneous fleets (issue 14): device profiles, CPU quotas per client process, per-device deadlines, the deadline
steps policy, FedUmf's compute reports and the parallel clock.

The steps policy and the compute reports run the real server on the in-process bus, with fake devices where the test
needs hand-made speeds; the cgroups are written in a hierarchy the test makes. Real client processes under the kernel's
quotas, and the `edge-server fleet` commands: tests/integration/test_fleet.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_client.algorithms import CONTRACTS
from edge_client.loop.trainer import TrainResult
from edge_client.wire.messages import Assignment, ComputeReport, RoundFacts
from edge_client.wire.plan import Plan
from edge_client.wire.protocol import DuplicateMessage, OutOfRound, encode
from edge_client.wire.topics import Topics
from edgefl_testkit.fakes import FakeDevice, zero_update
from edgefl_testkit.fleet import assert_throttled, throttle_run
from edgefl_testkit.messages import assignment
from server.admission import WrongSteps
from server.assembly import make_orchestrator, split_clients
from server.compute_reports import ComputeReports
from server.config import ConfigError, from_dict, load_config, override
from server.datasets import load_dataset
from server.deadlines import MAX_DEVICE_S, MIN_S_PER_STEP, DeviceTimes, Prediction, round_deadline
from server.device_profiles import REFERENCE_S_PER_100, SHIPPED, calibrated, profile_toml
from server.experiments import cgroups
from server.experiments.cgroups import CpuLimits
from server.experiments.fleet import Fleet, slowed
from server.experiments.inprocess import NO_DEADLINE_S, LocalBus, LocalLink, run_inprocess
from server.experiments.simulate import client_ids, prepare_shards
from server.fleet_summary import parallel_round_s
from server.steps_policy import StepsPolicy

MLP = {"name": "mlp", "in_features": 64, "num_classes": 10, "hidden": [16]}


# ------------------------------------------------------------------------------------------------ profiles, config
def test_a_fleet_assigns_classes_in_client_order_and_knows_its_shares() -> None:
    fleet = Fleet.of("pi5:2,pi4:5,pi3:3", client_ids(10))
    assert [p.name for p in fleet.by_client.values()] == ["pi5"] * 2 + ["pi4"] * 5 + ["pi3"] * 3
    assert fleet.total_share == pytest.approx(2 * SHIPPED["pi5"].cpu_share + 5 * SHIPPED["pi4"].cpu_share
                                              + 3 * SHIPPED["pi3"].cpu_share)  # fmt: skip
    assert fleet.total_share < 2  # the shipped fleet fits the two cores this project is measured on
    for p in SHIPPED.values():  # every shipped number says where it comes from
        assert "estimate" in p.source or "measured" in p.source
        assert p.cpu_share == pytest.approx(REFERENCE_S_PER_100 / float(p.source.split(": ")[1].split()[0]), 1e-3)
    with pytest.raises(ValueError, match="unknown device class 'pi9'; known: pi3, pi4, pi5"):
        Fleet.of("pi9:1", ["a"])
    with pytest.raises(ValueError, match="expected CLASS:COUNT"):
        Fleet.of("pi4:0", ["a"])


def test_config_fleet_table_profiles_and_the_client_count() -> None:
    config = from_dict({"fleet": {"devices": "pi5:1,mine:2", "profiles": {"mine": {
        "cpu_share": 0.2, "uplink_mbps": 5, "downlink_mbps": 10, "source": "calibrated"}}}})  # fmt: skip
    assert config.clients.count == 3  # follows the fleet when not given
    assert Fleet.of(config.fleet.devices, client_ids(3), config.fleet.profiles).by_client["client-02"].cpu_share == 0.2
    with pytest.raises(ConfigError, match=r"names 3 devices but clients.count = 4"):
        from_dict({"clients": {"count": 4}, "fleet": {"devices": "pi3:3"}})
    with pytest.raises(ConfigError, match=r"\[fleet.profiles.mine\]: cpu_share must be at most 1"):
        from_dict({"fleet": {"profiles": {"mine": {"cpu_share": 2.0, "uplink_mbps": 1, "downlink_mbps": 1}}}})
    with pytest.raises(ConfigError, match=r"\[fleet.profiles.mine\]: unknown key 'speed'"):
        from_dict({"fleet": {"profiles": {"mine": {"speed": 1}}}})
    flags = override(load_config(None), fleet__devices="pi4:2,pi3:1", clients__count=None)
    assert flags.clients.count == 3 and flags.fleet.devices == "pi4:2,pi3:1"


def test_a_calibrated_profile_round_trips_through_the_config() -> None:
    profile = calibrated("pi4", 3.0, 0.6)
    assert profile.cpu_share == pytest.approx(0.2) and profile.uplink_mbps == SHIPPED["pi4"].uplink_mbps
    import tomllib

    table = tomllib.loads(profile_toml(profile))["fleet"]["profiles"]
    assert from_dict({"fleet": {"profiles": table}}).fleet.profiles["pi4"]["cpu_share"] == pytest.approx(0.2)
    assert calibrated("fast", 0.1, 0.6).cpu_share == 1.0  # faster than one core here: capped


# --------------------------------------------------------------------------------------------------------- cgroups
def fake_proc(tmp_path: Path, mountinfo: str, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def test_cgroup_v2_quotas_in_a_directory_of_our_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A v2 hierarchy with cpu delegated to this process's cgroup: cpu.max per client, unlimited until enforce."""
    mount = tmp_path / "cg2"
    own = mount / "user.slice" / "me"
    own.mkdir(parents=True)
    (own / "cgroup.subtree_control").write_text("cpu memory\n")
    info = f"36 25 0:31 / {mount} rw,nosuid shared:11 - cgroup2 cgroup2 rw,nsdelegate\n"
    monkeypatch.setattr(cgroups, "PROC", fake_proc(tmp_path, info, "0::/user.slice/me\n"))
    assert cgroups.find_hierarchy() == cgroups.Hierarchy(2, own)
    with CpuLimits({"client-00": 0.25, "client-01": 0.5}) as limits:
        assert limits.enforced and limits.run_dir is not None and limits.run_dir.parent == own
        assert (limits.run_dir / "cgroup.subtree_control").read_text() == "+cpu"
        assert (limits.run_dir / "cpu.weight").read_text() == "200"  # weighs as two processes would
        assert (limits.run_dir / "client-00" / "cpu.max").read_text() == "max 100000"
        limits.place("client-00", 4242)
        assert (limits.run_dir / "client-00" / "cgroup.procs").read_text() == "4242"
        limits.enforce()
        assert (limits.run_dir / "client-00" / "cpu.max").read_text() == "25000 100000"
        assert (limits.run_dir / "client-01" / "cpu.max").read_text() == "50000 100000"
        run_dir = limits.run_dir
        for f in run_dir.rglob("*"):  # what the kernel does on rmdir of a cgroup: its files go with it
            if f.is_file():
                f.unlink()
    assert not run_dir.exists()
    (own / "cpu.max").write_text("50000 100000")  # this process may use half a core: the quotas must fit in it
    with pytest.raises(ValueError, match=r"add up to 0.60 cores, more than the 0.5"), CpuLimits({"a": 0.3, "b": 0.3}):
        pass


def test_cgroup_v1_and_no_cgroup_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    mount = tmp_path / "cpu,cpuacct"
    mount.mkdir()
    info = f"30 25 0:26 / {mount} rw - cgroup cgroup rw,cpu,cpuacct\n"
    monkeypatch.setattr(cgroups, "PROC", fake_proc(tmp_path / "v1", info, "4:cpu,cpuacct:/\n"))
    with CpuLimits({"client-00": 0.1}) as limits:
        assert limits.enforced and limits.describe().startswith("cgroup v1 CPU quotas in")
        assert (limits.run_dir / "cpu.shares").read_text() == "1024"  # type: ignore[operator]
        limits.enforce()
        assert (limits.run_dir / "client-00" / "cpu.cfs_quota_us").read_text() == "10000"  # type: ignore[operator]
        assert (limits.run_dir / "client-00" / "cpu.cfs_period_us").read_text() == "100000"  # type: ignore[operator]
        for f in limits.run_dir.rglob("*"):  # type: ignore[union-attr]
            if f.is_file():
                f.unlink()
    info = f"36 25 0:31 / {tmp_path} rw - cgroup2 cgroup2 rw\n"  # v2 without the cpu controller, no v1 cpu
    monkeypatch.setattr(cgroups, "PROC", fake_proc(tmp_path / "none", info, "0::/\n"))
    with CpuLimits({"client-00": 0.1}) as limits:
        assert not limits.enforced
        limits.place("client-00", 1)  # no-ops
        limits.enforce()
    assert "no cpu controller" in limits.describe() and "no cgroup v1 hierarchy" in limits.describe()
    assert "cgroups cannot be written here" in caplog.text and "the fallback is --in-process" in caplog.text


# ------------------------------------------------------------------------------------- deadlines and the policy
def test_the_deadline_comes_from_each_clients_own_prediction() -> None:
    clients = from_dict({"clients": {"deadline_factor": 1.5, "deadline_margin_s": 1.0, "deadline_floor_s": 2.0,
                                     "round_deadline_s": 60.0}}).clients  # fmt: skip
    fast, slow = Prediction(50, 0.01, 0.1), Prediction(50, 0.2, 0.5)
    assert round_deadline(clients, {"a": fast, "b": slow}) == pytest.approx(1.5 * 10.5 + 1.0)  # the slow one's
    assert round_deadline(clients, {"a": fast}) == 2.0  # floor
    assert round_deadline(clients, {"a": fast, "new": None}) == 60.0  # someone unmeasured: the fixed one
    assert round_deadline(clients, {"a": Prediction(50, 10.0, 0.0)}) == 60.0  # never above round_deadline_s


def hand_made(speeds: dict[str, float]) -> DeviceTimes:
    times = DeviceTimes(links={})
    for cid, s_per_step in speeds.items():
        times.record_compute(1, cid, s_per_step * 10, 10)
    return times


def test_deadline_policy_on_hand_made_speeds() -> None:
    train = from_dict({"train": {"algorithm": "fednova", "steps_policy": "deadline", "round_budget_s": 2.0,
                                 "tau_min": 2, "tau_max": 100}}).train  # fmt: skip
    times = hand_made({"fast": 0.01, "mid": 0.05, "slow": 0.2, "snail": 5.0})
    policy = StepsPolicy(train, CONTRACTS["fednova"], times)
    got = {cid: policy.steps(cid, 50) for cid in ("fast", "mid", "slow", "snail", "new")}
    assert got == {"fast": 100, "mid": 40, "slow": 10, "snail": 2, "new": 50}
    fedveca = StepsPolicy(replace(train, algorithm="fedveca"), CONTRACTS["fedveca"], times)
    assert {c: fedveca.steps(c, 20) for c in ("fast", "mid", "slow")} == {"fast": 20, "mid": 20, "slow": 10}
    assert fedveca.steps("snail", 1) == 1  # never more than FedVeca's own tau, not even for tau_min
    fixed = StepsPolicy(replace(train, steps_policy="fixed"), CONTRACTS["fednova"], times)
    assert fixed.steps("slow", 50) == 50


def test_the_deadline_policy_is_refused_with_fedavg_and_needs_a_budget() -> None:
    with pytest.raises(ConfigError, match=r"fedavg cannot aggregate.*objective inconsistency.*\(fednova, fedveca\)"):
        from_dict({"train": {"algorithm": "fedavg", "steps_policy": "deadline", "round_budget_s": 2.0}})
    with pytest.raises(ConfigError, match=r"train.round_budget_s must be seconds > 0"):
        from_dict({"train": {"algorithm": "fednova", "steps_policy": "deadline"}})
    assert from_dict({"train": {"algorithm": "fedavg", "steps_policy": "fixed"}}).train.steps_policy == "fixed"


def fake_fleet_run(
    tmp_path: Path, algorithm: str, times: dict[str, tuple[float, float]], job: str = "steps"
) -> list[dict[str, Any]]:
    """Fake devices (in-process) that report ``compute_s = overhead + s_per_step x steps`` and ``overhead_s`` from
    ``times[cid] = (s_per_step, overhead)``; the deadline policy fits round 2 into a 2 s budget; the metrics rows."""
    config = from_dict({
        "run": {"rounds": 2, "out": str(tmp_path), "job": job},
        "clients": {"count": len(times), "round_deadline_s": NO_DEADLINE_S, "register_timeout_s": 30.0},
        "data": {"dataset": "digits"},
        "train": {"algorithm": algorithm, "local_steps": 50, "batch_size": 16, "lr": 0.05,
                  "steps_policy": "deadline", "round_budget_s": 2.0, "tau_min": 2, "tau_max": 100},
        "model": MLP,
        "algorithm": {"fednova": {"local_steps_mode": "fixed"}},
    })  # fmt: skip
    bus, topics, contract = LocalBus(), Topics(job), CONTRACTS[algorithm]
    for cid, (s_per_step, overhead) in times.items():

        def respond(a: Assignment, cid: str = cid, s: float = s_per_step, o: float = overhead) -> list[bytes]:
            update = replace(zero_update(a, cid, 100, contract), compute_s=o + s * a.plan.steps, overhead_s=o)
            return [encode(update)]

        device = FakeDevice(None, topics, cid, 100, respond)  # type: ignore[arg-type]
        device.link = bus.connect([topics.down(cid), topics.broadcast, topics.server], device.hello)
        bus.add_client(device)
    link = LocalLink(bus, [topics.all_up], drives_clients=True)
    make_orchestrator(config, load_dataset("digits"), tmp_path, link=link, times=DeviceTimes(links={})).run()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("algorithm", "first", "second"), [
    ("fednova", 50, {"fast": 100, "mid": 30, "slow": 7}),
    ("fedveca", 20, {"fast": 20, "mid": 20, "slow": 7}),  # FedVeca's own tau (20) caps the policy
])  # fmt: skip
def test_the_server_fits_each_clients_steps_to_the_budget_after_its_overhead(
    algorithm: str, first: int, second: dict[str, int], tmp_path: Path
) -> None:
    """Three fake devices report hand-made speeds and a 0.5 s per-round overhead in round 1; round 2's assignments
    fit the 2 s budget as overhead + steps x seconds per step (the overhead is not spread over the steps)."""
    speeds = {"fast": 0.01, "mid": 0.05, "slow": 0.2}
    rows = fake_fleet_run(tmp_path, algorithm, {cid: (s, 0.5) for cid, s in speeds.items()})
    assert {c: t["local_steps"] for c, t in rows[0]["instructions"].items()} == dict.fromkeys(speeds, first)
    assert {c: t["local_steps"] for c, t in rows[1]["instructions"].items()} == second
    for cid, p in rows[1]["predictions"].items():  # each prediction: its overhead + its own speed x the steps told
        assert p["s_per_step"] == pytest.approx(speeds[cid]) and p["steps"] == second[cid]
        assert p["overhead_s"] == pytest.approx(0.5)
        assert p["predicted_s"] == pytest.approx(0.5 + speeds[cid] * second[cid])
    for row in rows:
        # these fake devices miss the broadcast and ask for the model: in round 1 the server sent it once to all and
        # once more to each of the three, and each device's link carried its assignment, the broadcast and its own
        # copy; round 2 starts from the same model (zero updates), which nobody is sent again
        assignments = sum(i["bytes_down"] for i in row["instructions"].values())
        model, rest = divmod(row["bytes_out"] - assignments, 1 + len(speeds))
        assert rest == 0 and (model > 1000) == (row["round"] == 1) and (model == 0) == (row["broadcast"] == "")
        for cid, c in row["clients"].items():
            assert c["overhead_s"] == pytest.approx(0.5) and c["compute_s"] == pytest.approx(0.5 + speeds[cid] * (
                row["instructions"][cid]["local_steps"]))  # fmt: skip
            assert c["bytes_down"] == row["instructions"][cid]["bytes_down"] + 2 * model
    assert rows[0]["predictions"] == dict.fromkeys(speeds)  # nothing measured before round 1


def test_a_tiny_reported_compute_time_gives_the_most_steps_and_the_run_goes_on(tmp_path: Path) -> None:
    """Issue 23: ``compute_s = 1e-310`` made the next round's ``math.floor(inf)`` raise OverflowError."""
    rows = fake_fleet_run(tmp_path, "fednova", {"liar": (1e-312, 0.0), "honest": (0.05, 0.0)}, job="tiny")
    assert 0 < rows[0]["clients"]["liar"]["compute_s"] < 1e-300
    assert {c: t["local_steps"] for c, t in rows[1]["instructions"].items()} == {"liar": 100, "honest": 40}
    assert rows[1]["predictions"]["liar"]["s_per_step"] == MIN_S_PER_STEP


def test_reported_times_enter_the_policy_clamped_to_physical_ranges() -> None:
    train = from_dict({"train": {"algorithm": "fednova", "steps_policy": "deadline", "round_budget_s": 2.0,
                                 "tau_min": 2, "tau_max": 100}}).train  # fmt: skip
    times = DeviceTimes(links={})
    policy = StepsPolicy(train, CONTRACTS["fednova"], times)
    a = assignment(None, 10, 0.1, 8, round=1, model_version=0, algorithm="fednova")
    for cid, compute, overhead in (("tiny", 1e-310, 0.0), ("huge", 1e300, 0.0), ("over", 1.0, 5.0)):
        update = replace(zero_update(a, cid, 10, CONTRACTS["fednova"]), compute_s=compute, overhead_s=overhead)
        times.record(1, update, 0, 0)
    e = times.estimates
    assert e["tiny"].s_per_step == MIN_S_PER_STEP and policy.steps("tiny", 50) == 100
    assert e["huge"].s_per_step == MAX_DEVICE_S / 10 and policy.steps("huge", 50) == 2  # tau_min
    assert e["over"].overhead_s == 1.0 and e["over"].s_per_step == MIN_S_PER_STEP  # overhead at most the compute
    assert policy.steps("over", 50) == 100  # 1 s of overhead within 2 s
    unbounded = StepsPolicy(replace(train, round_budget_s=float("inf")), CONTRACTS["fednova"], times)
    assert unbounded.steps("tiny", 50) == unbounded.steps("huge", 50) == 100  # no floor of inf


# ---------------------------------------------------------------------------------------- FedUmf's compute reports
def test_compute_reports_are_taken_once_from_clients_told_to_train_only() -> None:
    reports = ComputeReports()
    reports.told(1, {"a": 5})
    entry = reports.take("a", ComputeReport(1, "a", 5, 0.5, 0.4, run_id="r"), "r")
    assert entry == {"client": "a", "round": 1, "local_steps": 5, "compute_s": 0.5, "cpu_s": 0.4}
    with pytest.raises(DuplicateMessage):
        reports.take("a", ComputeReport(1, "a", 5, 0.5, 0.4, run_id="r"), "r")
    reports.told(2, {"b": 5})
    with pytest.raises(WrongSteps):
        reports.take("b", ComputeReport(2, "b", 6, 0.5, 0.4, run_id="r"), "r")
    with pytest.raises(OutOfRound, match="was not told to train without uploading"):
        reports.take("a", ComputeReport(2, "a", 5, 0.5, 0.4, run_id="r"), "r")
    with pytest.raises(OutOfRound, match="belongs to run"):
        reports.take("b", ComputeReport(2, "b", 5, 0.5, 0.4, run_id="other"), "r")
    assert reports.drain() == [entry] and reports.drain() == []


def test_fedumf_unselected_clients_report_their_compute_and_it_is_counted(tmp_path: Path) -> None:
    config = from_dict({
        "run": {"rounds": 4, "out": str(tmp_path), "job": "umf"},
        "clients": {"count": 4, "fraction": 0.5},
        "data": {"dataset": "digits"},
        "train": {"algorithm": "fedumf", "local_steps": 5, "batch_size": 16, "lr": 0.05},
        "model": MLP,
    })  # fmt: skip
    bundle, root = split_clients(config, load_dataset("digits"))
    shards, _ = prepare_shards(bundle, client_ids(4), "iid", 0, tmp_path / "shards")
    summary = run_inprocess(config, shards, bundle, tmp_path, root=root)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    told = {(r["round"], c) for r in rows for c in r["algorithm"]["train_only"]}
    got = [(e["round"], e["client"]) for r in rows for e in r["train_only"]]
    assert got and len(got) == len(set(got)) and set(got) <= told
    # a client handles its assignments in order: every train-only round before one it uploaded in was reported
    uploaded = {(r["round"], c) for r in rows for c in r["clients"]}
    assert {(t, c) for t, c in told if any(c == u and t < s for s, u in uploaded)} <= set(got)
    assert all(e["local_steps"] == 5 and e["compute_s"] > 0 for r in rows for e in r["train_only"])
    uploads = sum(c["compute_s"] for r in rows for c in r["clients"].values())
    train_only = sum(e["compute_s"] for r in rows for e in r["train_only"])
    assert summary["fleet_compute_s"] == pytest.approx(uploads + train_only)
    [cls] = summary["per_class"].values()
    assert cls["train_only_compute_s"] == pytest.approx(train_only)
    steps = sum(c["local_steps"] for r in rows for c in r["clients"].values()) + 5 * len(got)
    assert cls["local_steps"] == steps


# ------------------------------------------------------------------------------------ the parallel clock, in-process
def test_the_parallel_clock_adds_the_servers_cpu_seconds_and_not_the_evaluation_beside_the_next_round() -> None:
    """A round: 3 s of assigning and 4 s of aggregating on the wall clock of a loaded machine, 0.02 and 0.05 CPU
    seconds of it; 9 s of evaluation running beside the next round; its slowest device 1 + 5 + 2 s."""
    row = {
        "assign_s": 3.0, "aggregate_s": 4.0, "assign_cpu_s": 0.02, "aggregate_cpu_s": 0.05, "eval_s": 9.0,
        "clients": {"a": {"download_s": 1.0, "compute_s": 5.0, "upload_s": 2.0},
                    "b": {"download_s": 0.1, "compute_s": 1.0, "upload_s": 0.1}},
    }  # fmt: skip
    assert parallel_round_s(row) == pytest.approx(0.02 + 8.0 + 0.05)


def test_slowed_divides_the_measured_cpu_seconds_by_the_share() -> None:
    def measured(*_: Any) -> TrainResult:
        return TrainResult(np.zeros(1, np.float32), 10, 0.3, 0.2, 0.0, overhead_s=0.06, overhead_cpu_s=0.05)

    plan, facts = Plan(steps=10, lr=0.1, batch_size=8), RoundFacts(round=1)
    result = slowed(measured, replace(SHIPPED["pi4"], cpu_share=0.1))(None, None, None, None, plan, None, facts)  # type: ignore[arg-type]
    assert (result.compute_s, result.cpu_s) == pytest.approx((2.0, 2.0))  # CPU seconds: what contention cannot inflate
    assert (result.overhead_s, result.overhead_cpu_s) == pytest.approx((0.5, 0.5))  # the overhead's, likewise


def test_a_throttling_profile_is_a_pi4_whose_share_drops_from_a_round_on() -> None:
    config = from_dict({"fleet": {"devices": "pi4-hot:2,pi4:1", "profiles": {"pi4-hot": {
        "like": "pi4", "throttle_from_round": 10, "throttle_share": 0.5}}}})  # fmt: skip
    fleet = Fleet.of(config.fleet.devices, client_ids(3), config.fleet.profiles)
    hot = fleet.by_client["client-00"]
    assert (hot.cpu_share, hot.uplink_mbps) == (SHIPPED["pi4"].cpu_share, SHIPPED["pi4"].uplink_mbps)
    assert [hot.share_at(r) for r in (9, 10, 30)] == pytest.approx(
        [hot.cpu_share, hot.cpu_share / 2, hot.cpu_share / 2]
    )
    assert fleet.shares(10)["client-02"] == SHIPPED["pi4"].cpu_share and fleet.throttles() == {
        10: ["client-00", "client-01"]}  # fmt: skip
    assert fleet.describe()["profiles"]["pi4-hot"]["throttle_from_round"] == 10
    for table, match in (({"like": "pi9"}, "like = 'pi9' is not a profile"),
                         ({"like": "pi4", "throttle_share": 1.5}, "throttle_share must be a fraction in"),
                         ({"like": "pi4", "throttle_from_round": -1}, "throttle_from_round must be a round >= 1"),
                         ({"throttle_from_round": 3}, "cpu_share must be a number > 0")):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"\[fleet.profiles.hot\]: {match}"):
            from_dict({"fleet": {"profiles": {"hot": table}}})


def test_a_throttling_device_in_process_reports_its_flags_and_is_told_fewer_steps(tmp_path: Path) -> None:
    config = load_config(throttle_run(tmp_path, 2))
    config = replace(config, run=replace(config.run, out=str(tmp_path), job="hot"))
    bundle = load_dataset("digits")
    shards, _ = prepare_shards(bundle, client_ids(2), "iid", 0, tmp_path / "shards")
    run_inprocess(config, shards, bundle, tmp_path)
    assert_throttled([json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()], 2)


def test_an_inprocess_fleet_keeps_the_parallel_clock_and_draws_the_timeline(tmp_path: Path) -> None:
    config = from_dict({
        "run": {"rounds": 2, "out": str(tmp_path), "job": "pc"},
        "data": {"dataset": "digits"},
        "train": {"local_steps": 10, "batch_size": 16},
        "fleet": {"devices": "pi5:1,pi3:1"},
    })  # fmt: skip
    bundle = load_dataset("digits")
    shards, _ = prepare_shards(bundle, client_ids(2), "iid", 0, tmp_path / "shards")
    summary = run_inprocess(config, shards, bundle, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    pi3 = SHIPPED["pi3"]
    for row in rows:
        c = row["clients"]["client-01"]
        assert c["device_class"] == "pi3" and row["clients"]["client-00"]["device_class"] == "pi5"
        broadcast = row["bytes_out"] - sum(i["bytes_down"] for i in row["instructions"].values())  # the round model
        assert broadcast > 10 * row["instructions"]["client-01"]["bytes_down"]
        # what the device's link carried down: its assignment and the model, sent once to all
        assert c["bytes_down"] == row["instructions"]["client-01"]["bytes_down"] + broadcast
        assert (c["download_s"], c["upload_s"]) == pytest.approx(pi3.transfer_s(c["bytes_down"], c["bytes_up"]))
        slowest = max(x["download_s"] + x["compute_s"] + x["upload_s"] for x in row["clients"].values())
        server = row["assign_cpu_s"] + row["aggregate_cpu_s"]  # CPU seconds; the evaluation runs beside the next round
        assert row["eval_s"] > 0 and server >= 0
        assert row["parallel_round_s"] == parallel_round_s(row) == pytest.approx(slowest + server)
        assert row["deadline_s"] == NO_DEADLINE_S  # in-process every client is waited for
    assert rows[1]["parallel_elapsed_s"] == pytest.approx(rows[0]["parallel_round_s"] + rows[1]["parallel_round_s"])
    assert summary["parallel_clock_s"] == rows[-1]["parallel_elapsed_s"]
    assert summary["fleet"]["spec"] == "pi5:1,pi3:1" and set(summary["per_class"]) == {"pi3", "pi5"}
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
