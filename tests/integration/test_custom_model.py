"""Bring your own model, task and data (issue 13): examples/custom_model run as docs/own-model.md says, over a real
mosquitto with real ``edge-server run`` and ``edge-client run`` processes, the server without data and the devices
evaluating; a device whose model differs is refused at registration and told which parameter differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from edge_client.exits import ExitStatus
from edge_client.learning.models import build_model, set_flat
from edge_client.learning.predictor import Predictor
from server.broker import Broker

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_model"
GOOD = ("sensor-a", "sensor-b", "sensor-c")
STALE = "sensor-old"  # runs an older copy of sensor_model.py: kernel 5, not 7


def _start(cmd: list[str], password: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "EDGEFL_PASSWORD": password, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=EXAMPLE.parents[1])


def _client(broker: Broker, cid: str, data: Path, model_path: Path, job: str, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "edge_client.cli", "run", "--broker", broker.url, "--client-id", cid,
        "--data", str(data), "--holdout", "0.2", "--model-path", str(model_path), "--job", job, "--threads", "1",
        "--once",
    ]  # fmt: skip
    return _start(cmd, broker.add_device(cid).password, log)


@pytest.mark.integration
def test_the_example_trains_a_custom_model_evaluated_on_the_devices(broker: Broker, tmp_path: Path) -> None:
    job, out = f"sensor-{uuid.uuid4().hex[:8]}", tmp_path / "run"
    stale = tmp_path / "old-model"
    stale.mkdir()
    (stale / "sensor_model.py").write_text(
        (EXAMPLE / "sensor_model.py").read_text().replace("kernel: int = 7", "kernel: int = 5")
    )
    server_cmd = [
        sys.executable, "-m", "server.cli", "run", "--config", str(EXAMPLE / "federation.toml"),
        "--model-path", str(EXAMPLE), "--broker", broker.url, "--username", broker.server.username,
        "--out", str(out), "--job", job,
    ]  # fmt: skip
    tmp_logs = tmp_path / "logs"
    tmp_logs.mkdir()
    server = _start(server_cmd, broker.server.password, tmp_logs / "server.log")
    procs = {
        cid: _client(broker, cid, EXAMPLE / "data" / f"{cid}.npz", EXAMPLE, job, tmp_logs / f"{cid}.log")
        for cid in GOOD
    }
    procs[STALE] = _client(broker, STALE, EXAMPLE / "data" / "sensor-a.npz", stale, job, tmp_logs / f"{STALE}.log")
    try:
        assert server.wait(timeout=300) == 0, (tmp_logs / "server.log").read_text()[-4000:]
        codes = {cid: p.wait(timeout=60) for cid, p in procs.items()}
    finally:
        for p in [server, *procs.values()]:
            if p.poll() is None:
                p.kill()
                p.wait()

    # The stale device was refused at registration, told which parameter differs, and exited with EX_CONFIG (78).
    stale_log = (tmp_logs / f"{STALE}.log").read_text()
    assert codes == {**dict.fromkeys(GOOD, 0), STALE: ExitStatus.CONFIG}, stale_log[-2000:]
    assert "refused" in stale_log and "'0.weight' [8, 1, 5]" in stale_log and "[8, 1, 7]" in stale_log

    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["rejected"].get("model", 0) >= 1 and summary["clients"] == 3  # it says hello on each announcement
    assert summary["dataset"] == "none" and summary["evaluated_by"] == "devices' held-out splits"
    assert summary["target_metric"] == "rmse" and summary["higher_is_better"] is False and summary["target"] == 0.5
    # Every round was evaluated by the three devices on their 48 held-out samples each, not by the server.
    assert all("accuracy" not in r and "loss" not in r for r in rows)
    evals = [r["client_eval"] for r in rows]
    assert all(sorted(e["devices"]) == list(GOOD) and e["num_samples"] == 3 * 48 for e in evals)
    rmse = [e["rmse"] for e in evals]
    assert rmse[-1] < 0.6 * rmse[0], rmse  # the metric improves
    assert summary["final_rmse"] == rmse[-1] and summary["best_rmse"] == min(rmse)
    first = next(i for i, v in enumerate(rmse) if v <= 0.5)
    assert summary["rounds_to_target"] == rows[first]["round"]
    assert summary["time_to_target_s"] == rows[first]["elapsed_s"]
    # Evaluation time is reported apart from training compute, per device and in total.
    assert summary["client_eval_total_s"] == pytest.approx(sum(e["slowest_eval_s"] for e in evals))
    assert all(summary["per_client"][cid]["evaluations"] == len(rows) for cid in GOOD)

    # The exported model is the user's, with a dynamic batch axis, and onnxruntime agrees with torch.
    spec = json.loads((out / "model-final.onnx.json").read_text())["model"]
    predictor = Predictor(out / "model-final.onnx")
    with np.load(out / "checkpoint.npz") as ckpt:
        weights = ckpt["weights"]
    sys.path.insert(0, str(EXAMPLE))
    try:
        model = build_model(spec)
    finally:
        sys.path.remove(str(EXAMPLE))
    set_flat(model, weights)
    with np.load(EXAMPLE / "data" / "sensor-b.npz") as data:
        x = data["x"]
    import torch

    with torch.no_grad():
        expected = model.eval()(torch.from_numpy(x)).numpy()[:, 0]
    np.testing.assert_allclose(predictor.predict(x), expected, atol=1e-4)
    np.testing.assert_allclose(predictor.predict(x[:1]), expected[:1], atol=1e-4)
