"""A two-node ejabberd cluster (mod_mqtt, MQTT 5) set up by firmware_scripts/ejabberd-cluster.sh from Debian's package.

The federation runs unchanged: clients on node a, the server on node b, the same client processes and server code as
over mosquitto, with the packet limit ejabberd does not advertise given by configuration. Starting the cluster takes
about 15 s (two Erlang nodes, one join), so it is started once for the module; the federation is 2 clients and 2
rounds in the suite, 4 and 3 with EDGEFL_FULL=1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_client.tools.fetch import fetch_model
from edge_client.wire.messages import Hello, ModelFile
from edge_client.wire.protocol import MessageTooLarge, encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import LinkConfig, MqttLink
from edgefl_testkit.basics import CHANCE, full_size, in_ci
from edgefl_testkit.federation import run_to_end, start_federation
from server.broker import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "firmware_scripts" / "ejabberd-cluster.sh"
CLIENTS, ROUNDS = (4, 3) if full_size() else (2, 2)  # the release check's size with EDGEFL_FULL=1
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    """The cluster's credentials.json; the nodes run in a directory of their own the ejabberd user can enter."""
    missing = "ejabberd is not installed (bash scripts/setup.sh installs it)"
    if not os.access("/usr/sbin/ejabberdctl", os.X_OK) or os.geteuid() != 0:
        reason = missing if os.geteuid() == 0 else "ejabberdctl runs only as root or the ejabberd user"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="edgefl-cluster-"))
    base.chmod(0o711)
    directory = base / "cluster"
    up = ["bash", str(SCRIPT), "up", str(directory), "--clients", str(CLIENTS), "--name", f"edgefl{os.getpid()}",
          "--port-a", str(free_port()), "--port-b", str(free_port())]  # fmt: skip
    try:
        result = subprocess.run(up, capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stderr
        yield json.loads((directory / "credentials.json").read_text())
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", str(directory)], capture_output=True, timeout=120, check=False)
        shutil.rmtree(base, ignore_errors=True)


def node_link(cluster: dict[str, Any], node: int, who: str) -> LinkConfig:
    """A login on node 0 (a) or 1 (b), told the packet limit ejabberd does not advertise."""
    creds = cluster["server"] if who == "server" else cluster["devices"][who]
    url = cluster["urls"][node]
    return LinkConfig(url, creds["username"], creds["password"], max_packet_size=cluster["max_packet_size"])


def test_federation_runs_unchanged_with_clients_on_one_node_and_the_server_on_the_other(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    def on_node_a(cid: str) -> tuple[str, str]:
        return cluster["urls"][0], cluster["devices"][cid]["password"]

    server = node_link(cluster, 1, "server")
    orch, procs = start_federation(tmp_path, server, on_node_a, "cluster", clients=CLIENTS, rounds=ROUNDS)
    summary, rows = run_to_end(orch, procs)
    assert summary["final_accuracy"] > CHANCE + 0.4, summary
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert all(r["clients_reported"] == CLIENTS and r["missing"] == [] for r in rows)
    assert orch.link.max_packet_size == cluster["max_packet_size"], "the configured limit, none advertised"
    # The model the server retained on its node b: fetched there (node a keeps its own retained index: see docs).
    meta = fetch_model(node_link(cluster, 1, "client-00"), "client-00", tmp_path / "m.onnx", job="cluster")
    assert (tmp_path / "m.onnx").read_bytes() == (orch.out_dir / "model.onnx").read_bytes()
    assert meta["round"] == max(rows, key=lambda r: r["accuracy"])["round"]


def test_cluster_acl_and_packet_limit_hold_across_nodes(cluster: dict[str, Any]) -> None:
    """client-00 on node a cannot speak for client-01; a message above the limit is refused before it is sent, and
    the same message chunked crosses to the other node whole."""
    topics = Topics("acl")
    server = MqttLink(node_link(cluster, 1, "server"), "acl-server", [topics.all_up]).start()
    device = MqttLink(node_link(cluster, 0, "client-00"), "acl-client-00", []).start()
    try:
        device.publish(topics.up("client-01"), encode(Hello(client_id="client-01", num_samples=1)))
        device.publish(topics.up("client-00"), encode(Hello(client_id="client-00", num_samples=1)))
        assert device.wait_published(TIMEOUT)
        received = server.receive(TIMEOUT)
        assert received is not None and received[0] == topics.up("client-00"), received
        assert server.receive(0) is None, "the forged hello crossed the cluster"

        limit = cluster["max_packet_size"]
        big = encode(ModelFile(round=1, sha256="0" * 64, meta={}, data=bytes(limit)))
        with pytest.raises(MessageTooLarge):
            device.publish(topics.up("client-00"), big, chunked=False)
        assert device.publish(topics.up("client-00"), big) >= limit  # chunked below the limit
        received = server.receive(TIMEOUT)
        assert received is not None and isinstance(received[1], ModelFile) and len(received[1].data) == limit
        assert device.connected, "nothing above the limit reached ejabberd (it would have dropped the connection)"
    finally:
        device.stop()
        server.stop()
