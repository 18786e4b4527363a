"""`edge-client check` against a real mosquitto (the session's broker: devices c0..c9, the edgefl ACL).

A good device runs the whole command as a real process (exit 0, every item ok, and the server user really receives
its probe message); the failures are each checked on their own item: a wrong password, an unreachable broker, a
login whose ACL does not cover the client id, a probe that dies of SIGILL. The data file's item:
tests/unit/edge_client/tools/test_check.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_client.tools import check
from edge_client.wire.messages import Presence
from edge_client.wire.topics import Topics
from edge_client.wire.transport import LinkConfig, MqttLink
from edgefl_testkit.mqtt import require_mosquitto, throwaway_certificate
from server.broker import Broker, BrokerSettings, free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def write_password(tmp_path: Path, password: str) -> Path:
    path = tmp_path / "password"
    path.write_text(password + "\n")
    path.chmod(0o600)
    return path


def write_data(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "data.npz"
    np.savez(path, x=rng.random((30, 1, 28, 28), dtype=np.float32), y=np.arange(30) % 3)
    return path


def by_name(items: list[check.Item]) -> dict[str, check.Item]:
    return {item.name: item for item in items}


def test_good_device_is_ready(broker: Broker, tmp_path: Path) -> None:
    job = "check-good"
    login = LinkConfig(broker.url, broker.server.username, broker.server.password, session_expiry_s=0)
    server = MqttLink(login, "check-server", [Topics(job).all_up]).start()  # returns after the SUBACK
    cmd = [
        sys.executable, "-m", "edge_client.cli", "check", "--broker", broker.url, "--client-id", "c3",
        "--password-file", str(write_password(tmp_path, broker.devices["c3"].password)),
        "--data", str(write_data(tmp_path)), "--job", job,
    ]  # fmt: skip
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ))
        received = server.receive(timeout=10)  # the ACL probe really reached the broker's subscribers
    finally:
        server.stop()
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if line.split()[:1] != ["ready:"]}
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("broker", "acl", "data", "torch", "onnxruntime"):
        assert lines[name].startswith("ok "), lines[name]
    assert "30 samples, 3 classes, samples of 1x28x28" in lines["data"]
    assert lines["device"].startswith("info ") and "memory" in lines["device"] and "throttling" in lines["device"]
    assert result.stdout.rstrip().endswith("ready: device 'c3' can join job 'check-good'")
    assert received is not None
    topic, msg = received
    assert topic == Topics(job).up("c3") and isinstance(msg, Presence) and msg.client_id == "c3" and msg.online


def test_wrong_password_fails_the_broker_item(broker: Broker) -> None:
    items = by_name(list(check.check_broker(lambda: LinkConfig(broker.url, "c4", "not-the-password"), "c4", "j")))
    assert items["broker"].ok is False and "refused" in items["broker"].detail
    assert "check the username and password" in items["broker"].detail
    assert items["acl"].ok is None
    assert check.report(iter(items.values()), "c4", "j", out=lambda _: None) == 1


def test_unreachable_broker_fails_the_broker_item() -> None:
    url = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens there
    items = by_name(list(check.check_broker(lambda: LinkConfig(url, "c5", "pw"), "c5", "j")))
    assert items["broker"].ok is False and "cannot reach 127.0.0.1" in items["broker"].detail
    assert items["acl"].ok is None


def test_the_wrong_scheme_for_a_tls_listener_says_use_mqtts(tmp_path: Path) -> None:
    """A real mosquitto with TLS: mqtt:// fails at once naming mqtts:// and --ca-file (not "no answer within 10 s"),
    and the server's own link says the same after its timeout; mqtts:// with the CA file is ready."""
    require_mosquitto()
    cert, key = throwaway_certificate(tmp_path)
    settings = BrokerSettings(devices=["tls-1"], certfile=str(cert), keyfile=str(key))
    with Broker(tmp_path / "broker", settings).start() as tls_broker:
        port, password = tls_broker.port, tls_broker.devices["tls-1"].password
        plain = LinkConfig(f"mqtt://127.0.0.1:{port}", "tls-1", password, connect_timeout_s=1)
        items = by_name(list(check.check_broker(lambda: plain, "tls-1", "j")))
        assert items["broker"].ok is False and items["acl"].ok is None
        assert f"speaks TLS: use mqtts://127.0.0.1:{port} with --ca-file" in items["broker"].detail
        with pytest.raises(ConnectionError, match=r"no answer within 1 s; the listener at .* speaks TLS: use mqtts://"):
            MqttLink(plain, "edgefl-j-tls-1-link", []).start()
        good = LinkConfig(f"mqtts://127.0.0.1:{port}", "tls-1", password, ca_file=str(cert))
        assert by_name(list(check.check_broker(lambda: good, "tls-1", "j")))["broker"].ok is True


def test_tls_against_a_plain_listener_says_so(broker: Broker) -> None:
    """The other way round: mqtts:// to the session's plain mosquitto fails at once, naming the handshake."""
    _, port, _ = LinkConfig(broker.url).endpoint()
    config = LinkConfig(f"mqtts://127.0.0.1:{port}", "c9", broker.devices["c9"].password)
    items = by_name(list(check.check_broker(lambda: config, "c9", "j")))
    assert items["broker"].ok is False and "does not complete a TLS handshake" in items["broker"].detail


def test_acl_denial_is_detected(broker: Broker) -> None:
    """Logged in as c6 but checking as c7: mosquitto's ACL refuses c6 on c7's up topic (PUBACK 0x87)."""
    config = LinkConfig(broker.url, "c6", broker.devices["c6"].password)
    items = by_name(list(check.check_broker(lambda: config, "c7", "j")))
    assert items["broker"].ok is True
    assert items["acl"].ok is False and "Not authorized" in items["acl"].detail


def test_unreadable_password_file_fails_the_broker_item(broker: Broker, tmp_path: Path) -> None:
    def config() -> LinkConfig:
        return LinkConfig(broker.url, "c8", (tmp_path / "missing").read_text())

    items = by_name(list(check.check_broker(config, "c8", "j")))
    assert items["broker"].ok is False and "missing" in items["broker"].detail


def test_a_probe_dying_of_sigill_is_a_fail_line(tmp_path: Path) -> None:
    """The probe runs in a subprocess: an illegal instruction there is reported with the fix, the check goes on."""
    dies = tmp_path / "python"
    dies.write_text("#!/bin/sh\nkill -ILL $$\n")
    dies.chmod(0o755)
    item = check.check_import("torch", python=str(dies))
    assert item.ok is False
    assert "died with SIGILL" in item.detail and "torch>=2.5,<2.10" in item.detail
