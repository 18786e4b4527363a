"""The live dashboard served: who may read it, and the page in a real headless Chromium following a real
`edge-server simulate` over mosquitto with client processes, one of which is killed mid-run. What it builds from a run
directory, and its address rules: tests/unit/server/dashboard/."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from PIL import Image

from edgefl_testkit.basics import in_ci, poll
from edgefl_testkit.mqtt import require_mosquitto
from edgefl_testkit.runs import client_report, metrics_row, write_run
from server.dashboard.server import Address, DashboardServer

CHROMIUM = "/usr/bin/chromium"
# As root, and on a machine whose network is closed: no sandbox, no GPU, no background connections.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
URL = re.compile(r"http://\S+")


# ------------------------------------------------------------------------------------------------------- access


def _status(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _wait_for_url(log: Path, proc: subprocess.Popen, timeout: float) -> str:
    """The dashboard address the command prints at start (a poll of its log, with a deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = URL.search(log.read_text())
        if found:
            return found.group(0)
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    raise AssertionError(f"no dashboard address printed within {timeout} s:\n{log.read_text()}")


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen, str]]]:
    """Start an `edge-server` command that serves a dashboard; returns it and the address it printed. Stopped after."""
    procs: list[subprocess.Popen] = []

    def run(*args: str, name: str = "server") -> tuple[subprocess.Popen, str]:
        log = tmp_path / f"{name}.log"
        with log.open("w") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "server.cli", *args], stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its own group: what it started dies with it  # fmt: skip
        procs.append(proc)
        return proc, _wait_for_url(log, proc, timeout=120)

    yield run
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # as Ctrl-C; SIGINT is ignored when the suite runs in the background
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a command that does not stop: not it alone, what it started too
                os.killpg(proc.pid, signal.SIGKILL)  # with the mosquitto and clients it started, not only itself
                proc.wait()
                warnings.warn(f"{proc.args[3:5]} ignored SIGTERM for 30 s: killed with its group", stacklevel=1)


@pytest.mark.integration
def test_a_dashboard_off_loopback_refuses_requests_without_its_token(tmp_path: Path, start, browser) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, [metrics_row(1, 0.5, {"c0": client_report(1.0)})])
    proc, url = start("dashboard", "--out", str(run_dir), "--dashboard", "0.0.0.0:0")
    token = url.split("?token=")[1]
    port = url.split(":")[2].split("/")[0]
    base = f"http://127.0.0.1:{port}"
    for path in ("/", "/state", "/events", "/static/app.js", "/timeline.png"):
        assert _status(base + path) == 403, path
    wrong = token[:-1] + ("y" if token.endswith("x") else "x")  # differs from the token in its last character
    assert _status(f"{base}/state?token={wrong}") == 403
    assert _status(f"{base}/state?token={token}") == 200
    assert _status(f"{base}/state", {"Authorization": f"token {token}"}) == 200
    page = browser.new_page()  # the printed address works in a browser: its assets and stream come with the cookie
    page.goto(f"{base}/?token={token}")
    page.wait_for_function("() => document.querySelectorAll('#chart-rounds circle.point').length === 1")
    assert page.locator("#clients td.id").all_text_contents() == ["c0"]
    page.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@pytest.mark.integration
def test_loopback_dashboard_refuses_a_foreign_host_name(tmp_path: Path, start) -> None:
    """No token on loopback, but a page that rebinds its own host name to 127.0.0.1 is still refused."""
    write_run(tmp_path / "run", [])
    _, url = start("dashboard", "--out", str(tmp_path / "run"), "--dashboard", "127.0.0.1:0")
    assert _status(url + "state") == 200
    assert _status(url + "state", {"Host": "attacker.example:80"}) == 403


# ------------------------------------------------------------------------------------------------ in the browser
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} is missing: scripts/setup.sh installs Debian's chromium"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)  # a fresh profile
        yield chromium
        chromium.close()


def _metrics_rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _not_blank(png: Path) -> None:
    pixels = np.asarray(Image.open(png).convert("RGB"), dtype=np.float32)
    assert pixels.std() > 10, "the screenshot is one flat colour"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, "the screenshot has almost no colours"


@pytest.mark.integration
def test_page_follows_a_live_simulation(tmp_path: Path, start, browser) -> None:
    """3 client processes over mosquitto, 400 local steps a round (about a second each on digits): the page lists
    every device, charts every finished round, and shows a client killed mid-run as offline while the others train."""
    require_mosquitto()
    run_dir = tmp_path / "run"
    sim, url = start(
        "simulate", "--dataset", "digits", "--clients", "3", "--rounds", "200", "--local-steps", "400",
        "--out", str(run_dir), "--dashboard", "127.0.0.1:0", name="simulate",
    )  # fmt: skip
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(url)
    rows = "#clients tbody tr"
    page.wait_for_function(
        f"() => [...document.querySelectorAll('{rows} td.status')].filter(td => td.textContent === 'online').length"
        " === 3",
        timeout=120_000,
    )
    assert page.locator(f"{rows} td.id").all_text_contents() == ["client-00", "client-01", "client-02"]

    def charts_match_metrics() -> bool:
        before = _metrics_rows(run_dir)
        points = [page.locator(f"#chart-{c} circle.point").count() for c in ("rounds", "time")]
        return before >= 2 and points == [before, before] == [_metrics_rows(run_dir)] * 2

    poll(charts_match_metrics, 60, "the charts show as many points as metrics.jsonl has rounds")

    (victim,) = [p for p in psutil.Process(sim.pid).children() if "client-02" in p.cmdline()]
    victim.kill()  # SIGKILL: the broker publishes its last will
    page.wait_for_function(
        """() => {
            const status = id => document.querySelector(`tr[data-client="${id}"] td.status`).textContent;
            return status('client-02') === 'offline' && status('client-00') === 'online'
                && status('client-01') === 'online' && !document.getElementById('status').textContent.startsWith('fin');
        }""",
        timeout=60_000,
    )
    assert sim.poll() is None, "the run must go on without the killed client"
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    _not_blank(shot)
    page.close()


@pytest.mark.integration
def test_page_shows_the_run_facts_at_once_and_says_when_the_run_ended(tmp_path: Path, browser) -> None:
    """Before the server wrote anything the page heads with the command's run facts; at the run's end it says so."""
    facts = {"algorithm": "fedavg", "dataset": "digits", "partition": "iid", "job": "j", "rounds": 3, "target": 0.9}
    server = DashboardServer(tmp_path, Address.parse("127.0.0.1:0"), facts).start()
    page = browser.new_page()
    try:
        page.goto(server.url)
        page.wait_for_function("() => document.getElementById('status').textContent.startsWith('starting')")
        assert page.locator("#algorithm").text_content() == "fedavg"
    finally:
        server.stop()
    page.wait_for_function("() => document.getElementById('status').textContent.includes('dashboard server stopped')")
    page.close()


def test_a_token_that_is_not_ascii_is_refused_not_a_server_error(tmp_path: Path) -> None:
    """Issue 23: ``?token=%C3%A9`` made secrets.compare_digest raise (500 and a traceback); compared as bytes: 403."""
    from server.dashboard.server import DashboardServer

    write_run(tmp_path, [metrics_row(1, 0.5, {})])
    server = DashboardServer(tmp_path, Address("127.0.0.1", 0, "s3cret-token")).start()
    try:
        base = f"http://127.0.0.1:{server.port}/state"
        assert _status(f"{base}?token=%C3%A9") == 403
        assert _status(base, {"Authorization": "token \u00e9"}) == 403  # a header is Latin-1 on the wire
        assert _status(f"{base}?token=s3cret-token") == 200
    finally:
        server.stop()
