"""A site broker's bridge to the central broker: mosquitto's own bridge, set up for edgefl's topics.

A fleet spread over sites keeps one mosquitto per site; the server talks to one central broker. The site broker
forwards its devices' `up` topics to the centre and brings their `down` topics and the job-wide topics back, over
TLS, logged in with the site's own credentials. Only the listed devices' topics cross: the central broker's ACL
(`server.acl.site_rules`) allows the site's login nothing else, and the site's own ACL is the usual per-device one.
Facts this rests on (Debian's mosquitto 2.0.11, measured in tests/integration/test_bridge.py and docs/scaling.md):
- The bridge speaks MQTT 3.1.1, not 5: a 2.0.11 bridge with `bridge_protocol_version mqttv50` sends no session
  expiry interval, so the central broker ends its session at every disconnect and whatever the server sends to a
  site while its link is down is lost. With 3.1.1 and `cleansession false` the centre keeps the session and queues,
  and the site does the same for its devices' updates (`local_cleansession false`). Nothing edgefl sends needs MQTT 5
  between brokers; the packet limit a v5 CONNACK would carry is set with `bridge_max_packet_size` instead.
- mosquitto does not reload bridges on SIGHUP: a site's device list is fixed when its broker starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_client.wire.transport import LinkConfig
from server.acl import SHARED_TOPICS

#: Where mosquitto finds the system's CA certificates when the bridge is given no CA file of its own (Debian).
SYSTEM_CA_PATH = "/etc/ssl/certs"


@dataclass
class BridgeSettings:
    """The central broker a site bridges to, and the site's login there (its username is also its client id)."""

    url: str  # mqtts://central.example:8883; mqtt:// only to a loopback address (tests)
    username: str
    password: str
    ca_file: str | None = None  # CA of the central broker's certificate; None: the system's CAs

    def endpoint(self) -> tuple[str, int, bool]:
        """Host, port and whether TLS is on, parsed as any edgefl broker URL is."""
        return LinkConfig(self.url).endpoint()


def bridge_topics(devices: list[str], job: str = "+") -> list[str]:
    """mosquitto `topic` lines: each device's updates out, its assignments and the job-wide topics in, QoS 1.

    Directions are never `both`, so nothing the centre sends can loop back to it.
    """
    base = f"edgefl/{job}"
    lines = []
    for device in devices:
        lines += [f"topic {base}/c/{device}/up out 1", f"topic {base}/c/{device}/down in 1"]
    return lines + [f"topic {base}/{name} in 1" for name in SHARED_TOPICS]


def bridge_config(bridge: BridgeSettings, devices: list[str], max_packet_size: int) -> list[str]:
    """The `connection` section of a site's mosquitto.conf (why each line is there: the module docstring)."""
    host, port, tls = bridge.endpoint()
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if any(ch.isspace() for ch in bridge.password) or not bridge.password:
        raise ValueError("the bridge password must be non-empty and without whitespace (it goes into mosquitto.conf)")
    lines = [
        f"connection edgefl-{bridge.username}",
        f"address {address}",
        f"remote_clientid {bridge.username}",
        f"remote_username {bridge.username}",
        f"remote_password {bridge.password}",
        "bridge_protocol_version mqttv311",  # not mqttv50: see the module docstring
        "cleansession false",  # the centre keeps the site's subscriptions and queues its messages across outages
        "local_cleansession false",  # and the site queues its devices' updates while the centre is unreachable
        "try_private true",  # the centre knows a bridge: retained messages (model, presence) stay retained, no loops
        "notifications true",
        "notifications_local_only true",  # bridge state on the site only: the centre's ACL allows the site no $SYS
        "restart_timeout 1 30",
        "keepalive_interval 60",
        f"bridge_max_packet_size {max_packet_size}",  # the site's own limit: the centre's must be at least as large
    ]
    if tls:
        lines += [f"bridge_cafile {bridge.ca_file}" if bridge.ca_file else f"bridge_capath {SYSTEM_CA_PATH}"]
        lines += ["bridge_insecure false"]
    return lines + bridge_topics(devices)
