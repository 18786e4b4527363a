"""The load benchmark (issues 7, 16 and 26): its quick mode end to end at three sizes, its secure mode (plain and secure
aggregation side by side) at a tiny size, and that the server does not hold a burst of uploads in memory (what made its
peak grow with the fleet). Its aggregate check: tests/unit/benchmarks/test_load.py."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from benchmarks import load
from edge_client.wire import chunking
from edge_client.wire.messages import Update
from edge_client.wire.protocol import encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import MEMORY_QUEUE_BYTES, LinkConfig
from edgefl_testkit.basics import spill_files
from edgefl_testkit.benchmarks import run_benchmark_quick
from edgefl_testkit.messages import make_update
from edgefl_testkit.mqtt import require_mosquitto
from server.admission import RoundState
from server.config import from_dict
from server.datasets import load_dataset
from server.evaluation import Evaluator
from server.orchestrator import Orchestrator


@pytest.mark.integration
def test_quick_load_nothing_lost_or_doubled_one_model_per_round(tmp_path: Path) -> None:
    require_mosquitto()
    data, md = run_benchmark_quick("load", tmp_path)
    cfg = data["config"]
    assert (cfg["sizes"], cfg["rounds"]) == ([5, 10, 20], 3)
    assert (
        data["fd_limit"]["soft"] >= data["fd_limit"]["needed"] or data["fd_limit"]["soft"] == data["fd_limit"]["hard"]
    )
    for run in data["runs"]:
        n, model = run["clients"], run["model_message_bytes"]
        assert len(run["per_round"]) == 3
        for r in run["per_round"]:
            assert r["clients_reported"] == r["clients_selected"] == n, r
            assert r["missing"] == [] and "duplicate" not in r["rejected"], r
            assert r["aggregate_exact"], r
            assert r["bytes_up"] >= n * cfg["update_bytes"]  # every update crossed the broker whole
            # the model went out once, whatever the number of clients; the rest are small assignments
            assert model <= r["bytes_out"] <= model * 1.01 + 2048 * n, r
        assert run["updates_sent"] == 3 * n and run["client_errors"] == []
        assert run["models_received"] == 3 * n and run["model_requests"] == 0  # every device got every broadcast
        assert not run["broker_dropped_messages"]
    assert all(data["checks"].values()), data["checks"]
    assert "| server egress per round |" in md and "MISS" not in md


@pytest.mark.integration
def test_secure_load_aggregates_every_round_securely_beside_a_plain_run(tmp_path: Path) -> None:
    """``--secure`` at 3 devices, 2 rounds: a plain run and then a secure one, each through its own mosquitto, whose
    clients run the real ``SecureClient``. Every secure round has all 3 devices masked, nobody dropped, each stage
    timed and its bytes counted, and the unmasked aggregate matches the closed form within the ring's rounding (masks
    that did not cancel, or a masked input lost or doubled, would not: tests/unit/benchmarks/test_load.py); the
    plain table is not overwritten."""
    require_mosquitto()
    argv = ["--secure", "--sizes", "3", "--rounds", "2", "--params", "2000", "--workers", "2", "--out", str(tmp_path)]
    root = Path(__file__).resolve().parents[3]  # as its users run it (in this process its queues would leave
    cmd = [sys.executable, "-m", "benchmarks.load", *argv]  # multiprocessing's resource tracker running)
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "load-secure.json").read_text())
    md = (tmp_path / "load-secure.md").read_text()
    assert not (tmp_path / "load.json").exists()
    (plain,), (secure,) = data["runs"], data["secure_runs"]
    assert (plain["secure"], secure["secure"]) == (False, True)
    size = data["config"]["update_bytes"]
    for r in secure["per_round"]:
        s = r["secure"]
        assert (r["clients_reported"], s["advertised"], s["shared"], s["masked"]) == (3, 3, 3, 3), r
        assert s["dropped_before_masking"] == s["dropped_after_masking"] == [] and r["dropped"] is None, r
        assert set(s["stage_s"]) == set(s["bytes_up"]) == {"keys", "shares", "masked", "unmask"}, s
        assert r["aggregate_exact"] and r["tolerance_share"] <= load.TOLERANCE_SHARE, r
        assert r["bytes_up"] >= 3 * size  # every masked input (4 bytes per parameter) crossed the broker whole
        assert r["egress_bytes"] == r["bytes_out"] + sum(s["bytes_down"].values()) > r["bytes_out"]
        assert set(r["device_secagg_s"]) == {"keys_s", "quantise_s", "share_s", "mask_s"}, r
    assert all(r["aggregate_exact"] and r["secure"] is None for r in plain["per_round"])
    assert secure["updates_sent"] == 6 and secure["client_errors"] == []
    assert all(data["checks"].values()) and data["checks"]["every_round_secure"], data["checks"]
    assert "| every_round_secure | PASS |" in md and "MISS" not in md and "WRONG" not in md


def test_a_burst_of_uploads_waits_in_the_run_directory_not_in_the_servers_memory(tmp_path: Path) -> None:
    """Issue 16: 200 devices' updates of 100k parameters (76 MiB in 128 KiB chunks) reach the server's link faster
    than its round loop takes them. The link holds at most ``MEMORY_QUEUE_BYTES`` of them in memory (before the spool
    it held all of them: 0.38 MiB per device), the rest wait in a file in the run directory, and every update comes
    back intact and in order; the file is emptied once they are taken."""
    digits = load_dataset("digits", seed=0)
    config = from_dict({"run": {"out": str(tmp_path)}, "data": {"dataset": "digits"}})
    spec = load.model_spec(100_000)  # the benchmark's model: digits-sized inputs
    orch = Orchestrator(config, LinkConfig("mqtt://127.0.0.1:1"), Evaluator(spec, digits.test), spec, tmp_path)
    link, topics, devices, size = orch.link, Topics(config.run.job), 200, orch.num_params  # link: not connected
    orch.current = RoundState(1, 0, {f"d{i}" for i in range(devices)})  # each may send one update of the round
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(devices):  # as paho's network thread hands each frame over
            update = make_update(f"d{i}", np.full(size, i, dtype=np.float32))
            for frame in chunking.split(encode(update), 128 << 10):
                link._offer(topics.up(f"d{i}"), bytes(frame))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= MEMORY_QUEUE_BYTES + (1 << 20), held  # the queue's bookkeeping is a few hundred bytes per frame
    assert sum(spill_files(tmp_path).values()) >= devices * 4 * size - MEMORY_QUEUE_BYTES
    for i in range(devices):
        received = link.receive(timeout=0)
        assert received is not None and received[0] == topics.up(f"d{i}")
        assert isinstance(received[1], Update) and received[1].client_id == f"d{i}"
        np.testing.assert_array_equal(received[1].delta, np.full(size, i, dtype=np.float32))
    assert link.receive(timeout=0) is None and link.rejections == {}
    assert list(spill_files(tmp_path).values()) == [0]
