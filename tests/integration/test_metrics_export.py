"""Prometheus metrics (--metrics): a real Prometheus scraping a real simulation over mosquitto, promtool on what is
served and shipped (the alerting rules, with unit tests of when they fire), the Grafana dashboard's queries, the
endpoint's access rule and last scrape, and labels that stay bounded whatever devices send. The endpoint's address
rule: tests/unit/server/test_metrics_endpoint.py."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge_client.loop.device import THROTTLE_BITS
from edgefl_testkit.basics import in_ci, poll
from edgefl_testkit.mqtt import require_mosquitto
from server.broker import free_port
from server.dashboard.server import Address
from server.fleet_metrics import METRICS, OTHER, UNREGISTERED, FleetMetrics, declared_reasons
from server.fleet_summary import device_class
from server.live_state import LiveState
from server.metrics_endpoint import MetricsEndpoint
from server.recorder import Silent
from server.target import Target

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "monitoring" / "edgefl-alerts.yml"
DASHBOARD = ROOT / "monitoring" / "grafana-dashboard.json"
NAME = re.compile(r"\bedgefl_[a-z0-9_]+")
HOSTILE_HELLO = {"device_class": "x" * 300 + "\n", "machine": '"}\n#', "cpu_count": 10**18}


def _tool(name: str) -> str:
    """Debian's prometheus package's binary: skip on a developer machine without it, fail in CI."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is missing: scripts/setup.sh installs Debian's prometheus"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return path


def _samples(registry: CollectorRegistry) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets served."""
    served: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            served.setdefault(sample.name, []).append(sample.labels)
    return served


def _report(compute_s: Any, flags: Any = None, **fields: Any) -> dict[str, Any]:
    facts = {"temperature_c_after": 61.5, "cpu_freq_mhz_after": 1500.0, "peak_rss_mb": 300.0, "throttled_flags": flags}
    return {"device_class": "pi4", "compute_s": compute_s, "local_steps": 5, "upload_s": 0.5, "download_s": 0.25,
            "bytes_up": 1000, "bytes_down": 2000, "device": {"round": facts}, **fields}  # fmt: skip


def _row(round_: int, clients: dict[str, Any], **fields: Any) -> dict[str, Any]:
    told = {cid: {"codec": "fp16"} for cid in clients}
    return {"round": round_, "elapsed_s": 2.0 * round_, "round_s": 2.0, "aggregate_s": 0.1, "eval_s": 0.2,
            "accuracy": 0.5 + 0.1 * round_, "clients": clients, "missing": [], "instructions": told,
            "train_only": [], **fields}  # fmt: skip


def _fleet(run_dir: Path, hostile: bool) -> tuple[FleetMetrics, CollectorRegistry, LiveState]:
    """An exporter of a run in ``run_dir`` whose devices c0 and c1 registered (c1 with a hostile hello)."""
    live = LiveState(run_dir, {"algorithm": "fedavg", "rounds": 10})
    fleet = FleetMetrics(run_dir, Target.accuracy(0.65), "fedavg", Silent())
    live.start()
    live.registered("c0", {"device_class": "pi4"})
    live.registered(
        "c1", {"device_class": "x" * 300 + "\n", "machine": '"}\n#', "cpu_count": 10**18} if hostile else {}
    )
    registry = CollectorRegistry()
    registry.register(fleet)
    return fleet, registry, live


def _live(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "live.json").read_text())
    except (OSError, ValueError):
        return {"clients": {}}


# ------------------------------------------------------------------------------------------ what devices may send
def test_labels_stay_bounded_when_devices_send_unexpected_strings(tmp_path: Path) -> None:
    """Rounds full of new strings (ids, reasons, flags, codecs, classes) add no series after the first round, and
    every label value is a registered id or a declared name, else ``other``/``unregistered``."""
    fleet, registry, live = _fleet(tmp_path, hostile=True)
    hostile_class = device_class(HOSTILE_HELLO)
    counts = []
    for r in range(1, 8):
        junk = f'junk-{r}\n{{}}"' + "é" * r
        live.rejected("c0", f"reason {junk}")  # a reason no code declares
        live.rejected("c1", "malformed")
        live.rejected(f"stranger-{r}", "malformed")  # heard from, never registered
        live.rejected(None, junk)
        flags = ["under_voltage", junk, f"bit_{r}", 7]
        clients = {
            "c0": _report(float("nan"), flags, local_steps=float("inf"), bytes_up=-5),
            "c1": _report(1.0, None, device_class=hostile_class, upload_s="soon"),
            f"dev/{junk}": _report(1.0),  # no client id can look like this
        }
        row = _row(r, clients, missing=["c1", junk], instructions={"c0": {"codec": junk}, "c1": {"codec": "topk:0.1"}})
        fleet.round_done(row)
        seen = lambda r=r: r in _live(tmp_path)["clients"].get("c1", {}).get("rejected", {}).values()  # noqa: E731
        poll(seen, 30, "this round's rejections in live.json")
        served = _samples(registry)
        counts.append(sum(len(v) for k, v in served.items() if k.startswith("edgefl_")))
    live.close()

    assert len(set(counts[1:])) == 1, f"series grew with new strings: {counts}"
    devices = {s["device"] for v in served.values() for s in v if "device" in s}
    assert devices == {"c0", "c1", UNREGISTERED}
    reasons = {s["reason"] for s in served["edgefl_rejected_messages_total"]}
    assert reasons == {"malformed", OTHER} and reasons <= declared_reasons() | {OTHER}
    flags = {s["flag"]: s for s in served["edgefl_device_throttled"]}
    assert set(flags) == {*THROTTLE_BITS.values(), OTHER}
    assert {s["codec"] for s in served["edgefl_device_codec_info"]} == {OTHER, "topk:0.1"}
    classes = {s["device_class"] for v in served.values() for s in v if "device_class" in s}
    assert classes == {"pi4", hostile_class} and all(len(c) <= 64 and "\n" not in c for c in classes)
    # what was not a finite amount added nothing; the rest counted
    compute = {s["device"]: s for s in served["edgefl_device_compute_seconds_total"]}
    assert set(compute) == {"c0", "c1"}
    values = {s.name + "|" + s.labels.get("device", ""): s.value for f in registry.collect() for s in f.samples}
    assert values["edgefl_device_compute_seconds_total|c0"] == 0.0
    assert values["edgefl_device_compute_seconds_total|c1"] == 7.0
    assert values["edgefl_device_upload_bytes_total|c0"] == 0.0
    assert values["edgefl_device_upload_seconds_total|c1"] == 0.0
    assert values["edgefl_device_rounds_missed_total|c1"] == 7.0


def test_run_metrics_follow_the_rows(tmp_path: Path) -> None:
    """Time-to-target is the first row reaching it; epsilon appears only once a row carries it."""
    fleet, registry, live = _fleet(tmp_path, hostile=False)
    fleet.round_done(_row(1, {"c0": _report(1.0)}))
    assert "edgefl_run_dp_epsilon" not in _samples(registry)
    assert "edgefl_run_time_to_target_seconds" not in _samples(registry)
    fleet.round_done(_row(2, {"c0": _report(1.0), "c1": _report(2.0)}, epsilon=1.25))
    fleet.round_done(_row(3, {"c0": _report(1.0)}, epsilon=2.5))
    live.close()
    values = {(s.name, s.labels.get("device")): s.value for f in registry.collect() for s in f.samples}
    assert values["edgefl_run_time_to_target_seconds", None] == 4.0  # round 2's accuracy 0.7 >= 0.65
    assert values["edgefl_run_dp_epsilon", None] == 2.5
    assert values["edgefl_run_round", None] == 3 and values["edgefl_run_rounds_total", None] == 3
    assert values["edgefl_run_finished", None] == 1
    assert values["edgefl_run_accuracy", None] == pytest.approx(0.8)
    assert values["edgefl_device_rounds_since_update", "c1"] == 1
    assert values["edgefl_device_online", "c1"] == 1
    assert values["edgefl_device_compute_seconds_total", "c0"] == 3.0


# ------------------------------------------------------------------------------------------------------- promtool
def test_served_metrics_pass_promtool(tmp_path: Path) -> None:
    """Every metric served at once (throttling flags, epsilon, time-to-target, rejections) passes the linter."""
    fleet, registry, live = _fleet(tmp_path, hostile=True)
    live.heard("c0")
    live.rejected("c0", "malformed")
    for r in (1, 2):  # round 2 reaches the target
        fleet.round_done(_row(r, {"c0": _report(1.0, ["throttled"])}, epsilon=0.5 * r, delta=1e-5))
    live.close()
    served = {n for n in _samples(registry) if n.startswith("edgefl_")}
    assert served == set(METRICS), "every declared metric is served"
    text = generate_latest(registry)
    done = subprocess.run([_tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done


def test_alert_rules_pass_promtool_and_fire_when_they_say(tmp_path: Path) -> None:
    promtool = _tool("promtool")
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    device = {"device": "c1", "device_class": "pi4"}
    on = '{device="c1",device_class="pi4"}'
    cases = {  # alert: input series, when it is quiet, when it fires, with which labels and summary
        "EdgeflDeviceOffline": (
            {f"edgefl_device_online{on}": "1 1 0 0 0 0 0 0", f"edgefl_device_rounds_since_update{on}": "0+1x7"},
            "3m", "6m", device, "device c1 (pi4) offline for 6+ rounds"),
        "EdgeflDeviceThrottled": (
            {'edgefl_device_throttled{device="c1",device_class="pi4",flag="throttled"}': "0 0 0 1 1 1 1 1"},
            "2m", "6m", {**device, "flag": "throttled"}, "device c1 throttled (throttled)"),
        "EdgeflRejectionsRising": (
            {'edgefl_rejected_messages_total{device="c1",reason="norm"}': "0 0 0 0+5x20"},
            "2m", "10m", {"device": "c1", "reason": "norm"}, "over 10 messages from c1 refused (norm) in 10 minutes"),
        "EdgeflRunStalled": (
            {'edgefl_run_finished{algorithm="fedavg"}': "0x40", 'edgefl_run_round{algorithm="fedavg"}': "1 2 3 3x37"},
            "10m", "25m", {"algorithm": "fedavg"}, "edgefl run (fedavg) made no progress for 20 minutes"),
    }  # fmt: skip
    descriptions = dict(re.findall(r"- alert: (\w+)\n(?:.*\n)*?\s+description: \"(.*)\"", RULES.read_text()))
    for alert, (series, quiet_at, fires_at, labels, summary) in cases.items():
        severity = "critical" if alert == "EdgeflRunStalled" else "warning"
        description = (
            descriptions[alert].replace("{{ $labels.device }}", "c1").replace("{{ $labels.flag }}", "throttled")
        )
        expected = {"exp_labels": {**labels, "severity": severity},
                    "exp_annotations": {"summary": summary, "description": description}}  # fmt: skip
        test = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [{
            "interval": "1m", "input_series": [{"series": k, "values": v} for k, v in series.items()],
            "alert_rule_test": [{"eval_time": quiet_at, "alertname": alert, "exp_alerts": []},
                                {"eval_time": fires_at, "alertname": alert, "exp_alerts": [expected]}]}]}  # fmt: skip
        spec = tmp_path / f"{alert}.json"
        spec.write_text(json.dumps(test))
        done = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{alert}:\n{done.stdout}{done.stderr}"


# ------------------------------------------------------------------------------------------------------- Grafana
def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_grafana_dashboard_queries_name_served_metrics() -> None:
    queries = _dashboard_queries()
    assert len(queries) >= 10
    for expr in queries:
        names = set(NAME.findall(expr))
        assert names, f"a query that reads no edgefl metric: {expr}"
        assert names <= set(METRICS), f"{sorted(names - set(METRICS))} are not served: {expr}"
    for rule in re.findall(r"expr: (.*)", RULES.read_text()):
        assert set(NAME.findall(rule)) <= set(METRICS), rule
    documented = set(re.findall(r"^\| `(edgefl_\w+)`", (ROOT / "docs" / "monitoring.md").read_text(), re.M))
    assert documented == set(METRICS), "docs/monitoring.md's table lists every metric served"


# ------------------------------------------------------------------------------------------------- the endpoint
def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


@pytest.fixture
def endpoint(request: pytest.FixtureRequest) -> Iterator[MetricsEndpoint]:
    registry = CollectorRegistry()
    fleet = FleetMetrics(Path("/nonexistent"), Target.accuracy(0.9), "fedavg", Silent())
    registry.register(fleet)
    server = MetricsEndpoint(Address("127.0.0.1", 0, getattr(request, "param", None)), registry).start()
    yield server
    server.stop()


def test_loopback_endpoint_refuses_a_foreign_host_name(endpoint: MetricsEndpoint) -> None:
    url = f"http://127.0.0.1:{endpoint.port}/metrics"
    status, body = _get(url)
    assert status == 200 and b"edgefl_run_finished" in body
    assert _get(url, {"Host": "attacker.example"})[0] == 403


@pytest.mark.parametrize("endpoint", ["s3cret-tok"], indirect=True)
def test_endpoint_with_a_token_refuses_requests_without_it(endpoint: MetricsEndpoint) -> None:
    url = f"http://127.0.0.1:{endpoint.port}/metrics"
    assert _get(url)[0] == 403
    assert _get(url, {"Authorization": "Bearer s3cret-toK"})[0] == 403
    assert _get(url + "?token=%C3%A9")[0] == 403  # not ASCII: refused, not a server error
    assert _get(url, {"Authorization": "Bearer s3cret-tok"})[0] == 200
    assert _get(url + "?token=s3cret-tok")[0] == 200


def test_after_the_run_the_endpoint_waits_for_one_more_scrape(endpoint: MetricsEndpoint) -> None:
    url = f"http://127.0.0.1:{endpoint.port}/metrics"
    assert endpoint.last_scrape(timeout=60) is None, "nobody scraped: nothing to wait for"
    endpoint._ended = False
    assert _get(url)[0] == 200  # a scraper is there
    result: list[bool | None] = []
    waiting = threading.Thread(target=lambda: result.append(endpoint.last_scrape(timeout=60)))
    waiting.start()
    poll(lambda: endpoint._ended, 30, "the wait began")
    assert not result, "it waits for the scrape"
    assert _get(url)[0] == 200
    waiting.join(timeout=60)
    assert result == [True]


# ------------------------------------------------------------------------------------ a real Prometheus, a real run
def _prometheus(tmp_path: Path, target_port: int) -> tuple[subprocess.Popen, str]:
    """Debian's prometheus on a free port, scraping ``target_port`` every 250 ms with the shipped rules loaded."""
    port = free_port()
    config = {  # JSON is YAML
        "global": {"scrape_interval": "250ms", "scrape_timeout": "200ms", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "edgefl", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [_tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while _ready(url) != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"prometheus did not start:\n{(tmp_path / 'prometheus.log').read_text()}")
        time.sleep(0.1)
    # scraping before the run starts: a run of a few seconds is then scraped while it lasts (a server nobody scraped
    # does not wait for a last scrape), whenever Prometheus's first scrape would have fallen
    poll(lambda: _scraped_once(url), 60, "prometheus tried its first scrape")
    return proc, url


def _scraped_once(url: str) -> bool:
    targets = json.loads(_get(url + "/api/v1/targets")[1])["data"]["activeTargets"]
    return bool(targets) and not targets[0]["lastScrape"].startswith("0001")


def _ready(url: str) -> int:
    try:
        return _get(url + "/-/ready")[0]
    except OSError:
        return 0


def _query(url: str, expr: str) -> dict[str, Any]:
    status, body = _get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    answer = json.loads(body) if body else {"status": f"HTTP {status}"}
    assert answer["status"] == "success", f"{expr}: {answer}"
    return answer["data"]


def _by_device(url: str, expr: str) -> dict[str, float]:
    return {r["metric"].get("device", ""): float(r["value"][1]) for r in _query(url, expr)["result"]}


@pytest.mark.integration
def test_prometheus_scrapes_a_simulation_with_the_values_of_metrics_jsonl(tmp_path: Path) -> None:
    """2 client processes over mosquitto, 3 rounds of digits: Prometheus holds each device's compute seconds and the
    run's accuracy as metrics.jsonl has them, the final round included (the server waits for that scrape); the
    dashboard's queries run on it and the shipped rules load."""
    require_mosquitto()
    metrics_port = free_port()
    prometheus, url = _prometheus(tmp_path, metrics_port)
    try:
        run_dir = tmp_path / "run"
        done = subprocess.run(
            [sys.executable, "-m", "server.cli", "simulate", "--dataset", "digits", "--clients", "2", "--rounds", "3",
             "--local-steps", "5", "--out", str(run_dir), "--metrics", f"127.0.0.1:{metrics_port}"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        compute: dict[str, float] = {}
        for row in rows:
            for cid, report in row["clients"].items():
                compute[cid] = compute.get(cid, 0.0) + report["compute_s"]
            for entry in row["train_only"]:
                compute[entry["client"]] = compute.get(entry["client"], 0.0) + entry["compute_s"]
        assert sorted(compute) == ["client-00", "client-01"]

        def last(name: str) -> dict[str, float]:
            return _by_device(url, f"last_over_time({name}[10m])")

        # the last scrape is served before Prometheus commits it
        poll(lambda: last("edgefl_run_finished") == {"": 1.0}, 30, "Prometheus has the run's last scrape")
        assert last("edgefl_run_round") == {"": float(len(rows))}
        assert last("edgefl_run_accuracy") == {"": pytest.approx(rows[-1]["accuracy"], rel=1e-12)}
        assert last("edgefl_device_compute_seconds_total") == pytest.approx(compute, rel=1e-12)
        assert last("edgefl_device_rounds_reported_total") == {"client-00": 3.0, "client-01": 3.0}
        for expr in _dashboard_queries():  # every panel's query is valid PromQL on a real Prometheus
            _query(url, expr.replace("$__rate_interval", "1m"))
        rules = json.loads(_get(url + "/api/v1/rules")[1])["data"]["groups"]
        loaded = {r["name"]: r["health"] for g in rules for r in g["rules"]}
        assert len(loaded) == 4 and set(loaded.values()) <= {"ok", "unknown"}, loaded
    finally:
        prometheus.send_signal(signal.SIGTERM)
        try:
            prometheus.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()
