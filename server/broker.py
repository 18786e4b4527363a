"""Run a mosquitto broker for edgefl as a child process: config, password file and ACL on a free port.

mosquitto (not a Python broker) because it speaks MQTT 5, is fast and keeps sessions across restarts; see
/work/shared/RESEARCH.md section 1 for the facts the config below is built on.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from server.acl import acl_rules, site_rules
from server.bridge import BridgeSettings, bridge_config

INSTALL_HINT = (
    "mosquitto is not installed: run `sudo apt-get install -y mosquitto mosquitto-clients` (Debian/Raspberry Pi OS) "
    "or set the EDGEFL_MOSQUITTO environment variable to the path of a mosquitto binary elsewhere"
)
_FORBIDDEN_ID_CHARS = set(":/#+")
_RUNNING = re.compile(rb"mosquitto version \S+ running")  # logged once every listener is open
_RELOADED = re.compile(rb"Reloading config\.")


class MosquittoNotInstalled(RuntimeError):
    """mosquitto or mosquitto_passwd is missing; the message says how to install it."""


def find_mosquitto() -> str:
    """Locate the broker: $EDGEFL_MOSQUITTO, then PATH, then /usr/sbin (Debian puts it there, off a user's PATH).

    A set but wrong EDGEFL_MOSQUITTO is an error rather than a silent fallback: the user asked for that binary.
    """
    env = os.environ.get("EDGEFL_MOSQUITTO")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise MosquittoNotInstalled(f"{INSTALL_HINT} (EDGEFL_MOSQUITTO={env!r} is not an executable file)")
    found = shutil.which("mosquitto")
    if found:
        return found
    if os.access("/usr/sbin/mosquitto", os.X_OK):
        return "/usr/sbin/mosquitto"
    raise MosquittoNotInstalled(INSTALL_HINT)


def find_mosquitto_passwd(mosquitto: str) -> str:
    """Locate mosquitto_passwd next to the broker binary, then on PATH, then in /usr/bin (Debian)."""
    for candidate in (
        Path(mosquitto).with_name("mosquitto_passwd"),
        shutil.which("mosquitto_passwd"),
        "/usr/bin/mosquitto_passwd",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise MosquittoNotInstalled(f"{INSTALL_HINT} (mosquitto_passwd not found)")


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now; mosquitto's `listener 0` means a unix socket, so we must pick one ourselves."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _check_username(name: str) -> str:
    """Usernames go into the password file (`user:hash`) and ACL patterns (%u), so keep them to one topic level."""
    if not name or any(ch.isspace() or ch in _FORBIDDEN_ID_CHARS for ch in name):
        raise ValueError(f"invalid client id / username {name!r}: empty, whitespace, ':', '/', '#' or '+'")
    return name


@dataclass
class Credentials:
    username: str
    password: str


@dataclass
class BrokerSettings:
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port chosen when the Broker is created
    max_packet_size: int = 16 * 2**20  # bytes; paho senders check payloads against this (CONNACK MaximumPacketSize)
    # What the broker queues for one session beyond its messages in flight: at most this many messages and bytes
    # (mosquitto's max_queued_messages and max_queued_bytes; past either, it drops what comes and logs "Outgoing
    # messages are being dropped"). Bytes too because a count alone let one device's offline session hold 246 MB of
    # models (issue 23). A device or the server that lost queued messages gets them again: a device asks for its
    # assignment and model (resync, model request), an update is sent again until the server acknowledges it.
    max_queued_messages: int = 10000
    max_queued_bytes: int = 256 * 2**20
    server_user: str = "edgefl-server"
    devices: list[str] = field(default_factory=list)  # client ids to create credentials for
    allow_anonymous: bool = False
    persistence: bool = True
    # Seconds between persistence snapshots: a SIGKILL loses what changed since the last one. Not mosquitto's 30: a
    # broker killed in its first half minute then lost every session (tests/integration/test_faults.py, broker SIGKILL
    # test).
    # A snapshot holds the sessions, retained messages (the model) and messages in flight: a few MB at most.
    autosave_interval: int = 5
    # PEM server certificate and key (e.g. server.crt / server.key from firmware_scripts/provision-broker.sh init):
    # the listener then speaks TLS (mqtts://). Required for any host that is not a loopback address.
    certfile: str | None = None
    keyfile: str | None = None
    # Central broker: each site's bridge login -> the devices it may carry (server.acl.site_rules).
    sites: dict[str, list[str]] = field(default_factory=dict)
    # Site broker: bridge these devices' topics to the central broker the server uses (server.bridge).
    bridge: BridgeSettings | None = None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only: 'localhost' or a loopback IP (0.0.0.0 is every address)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve to a network address


def check_transport(settings: BrokerSettings) -> None:
    """Refuse a broker that devices would reach over a network without TLS: their passwords would travel in clear."""
    if bool(settings.certfile) != bool(settings.keyfile):
        raise ValueError(
            "BrokerSettings.certfile and BrokerSettings.keyfile go together: set both (the server certificate and "
            f"its private key) or neither; got certfile={settings.certfile!r}, keyfile={settings.keyfile!r}"
        )
    if not settings.certfile and not is_loopback(settings.host):
        raise ValueError(
            f"refusing to start a broker on host {settings.host!r} without TLS: devices would send their passwords "
            "over the network in clear text. Set BrokerSettings.certfile and BrokerSettings.keyfile to a server "
            "certificate and key (firmware_scripts/provision-broker.sh init makes them), or listen on 127.0.0.1"
        )
    if settings.bridge is not None:
        host, _, tls = settings.bridge.endpoint()
        if not tls and not is_loopback(host):
            raise ValueError(
                f"refusing to bridge to {settings.bridge.url} without TLS: the site's password and its devices' "
                "updates would cross the network in clear text; use an mqtts:// URL (and the central broker's CA file)"
            )


class Broker:
    """One mosquitto process with its files in `workdir` (0700; files 0600 because they hold secrets).

    The port and all passwords are fixed at construction, so `start()` after `stop()`/`kill()` comes back on the same
    URL with the same credentials and, with persistence, the same sessions and queued messages.
    """

    def __init__(self, workdir: Path, settings: BrokerSettings | None = None) -> None:
        self.workdir = Path(workdir).resolve()  # mosquitto changes directory: relative paths would break
        self.settings = settings if settings is not None else BrokerSettings()
        check_transport(self.settings)
        self.port = self.settings.port or free_port(self.settings.host)
        self.server = Credentials(_check_username(self.settings.server_user), secrets.token_urlsafe(24))
        self.devices: dict[str, Credentials] = {}
        for client_id in self.settings.devices:
            self.devices[_check_username(client_id)] = Credentials(client_id, secrets.token_urlsafe(24))
        self.sites: dict[str, Credentials] = {}  # central broker: the bridge login of each site
        for site, members in self.settings.sites.items():
            if site in self.devices or site == self.server.username:
                raise ValueError(f"site login {site!r} is already the name of a device or of the server")
            self.sites[_check_username(site)] = Credentials(site, secrets.token_urlsafe(24))
            for device in members:
                _check_username(device)
        self.process: subprocess.Popen[bytes] | None = None
        self.conf_path = self.workdir / "mosquitto.conf"
        self.passwd_path = self.workdir / "passwd"
        self.acl_path = self.workdir / "acl"
        self.log_path = self.workdir / "mosquitto.log"

    @property
    def url(self) -> str:
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        return f"{'mqtts' if self.settings.certfile else 'mqtt'}://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def died(self) -> str | None:
        """Why mosquitto is gone though nobody stopped it (reaping the dead child), or None while it runs."""
        if self.process is None or self.process.poll() is None:
            return None
        code = self.process.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"mosquitto (pid {self.process.pid}) {how}; {self.log_path}:\n{self._log_tail()}"

    def config_text(self) -> str:
        """The mosquitto.conf contents (see RESEARCH.md section 1 for why each line is there)."""
        s = self.settings
        lines = [
            "# generated by server.broker; edits are overwritten on start",
            f"listener {self.port} {s.host}",
            *([f"certfile {Path(s.certfile).resolve()}", f"keyfile {Path(s.keyfile).resolve()}"] if s.certfile else []),
            f"allow_anonymous {'true' if s.allow_anonymous else 'false'}",
            f"password_file {self.passwd_path}",
            f"acl_file {self.acl_path}",
            f"max_packet_size {s.max_packet_size}",
            "set_tcp_nodelay true",
            "max_inflight_messages 20",
            f"max_queued_messages {s.max_queued_messages}",
            f"max_queued_bytes {s.max_queued_bytes}",
            f"log_dest file {self.log_path}",  # flushed per line, unlike a redirected stdout; early errors go to stderr
            "log_timestamp_format %Y-%m-%dT%H:%M:%S",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
        ]
        if s.persistence:
            lines += [
                "persistence true",
                f"persistence_location {self.workdir}/",
                f"autosave_interval {s.autosave_interval}",
            ]
        else:
            lines.append("persistence false")
        if os.geteuid() == 0:
            lines.append("user root")  # else mosquitto drops to user mosquitto and cannot read our 0700 dir
        if s.bridge is not None:  # a connection section ends the general settings: it comes last
            lines += ["", *bridge_config(s.bridge, list(self.devices), s.max_packet_size)]
        return "\n".join(lines) + "\n"

    def acl_text(self) -> str:
        """The device and server rules, then one section per site bridged to this broker."""
        sites = [site_rules(site, self.settings.sites[site]) for site in self.sites]
        return "\n".join([acl_rules(self.server.username), *sites])

    def _write_private(self, path: Path, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, 0o600)  # O_CREAT's mode does not apply to an existing file

    def _write_passwd(self, mosquitto: str) -> None:
        """Write all users in plaintext, then hash them in ONE mosquitto_passwd call (one process, not one per user)."""
        users = [self.server, *self.devices.values(), *self.sites.values()]
        self._write_private(self.passwd_path, "".join(f"{c.username}:{c.password}\n" for c in users))
        result = subprocess.run(
            [find_mosquitto_passwd(mosquitto), "-U", str(self.passwd_path)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"mosquitto_passwd -U failed ({result.returncode}): {result.stderr.strip()}")
        os.chmod(self.passwd_path, 0o600)

    def _write_files(self, mosquitto: str) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o700)
        self._write_passwd(mosquitto)
        self._write_private(self.acl_path, self.acl_text())
        self._write_private(self.conf_path, self.config_text())

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _log_has(self, offset: int, message: re.Pattern[bytes]) -> bool:
        """Whether a log line after byte `offset` matches `message` (after the timestamp)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return any(message.fullmatch(raw.partition(b": ")[2].rstrip()) for raw in f)
        except OSError:
            return False

    def _log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def start(self, timeout: float = 10.0) -> Broker:
        """Write the files, start mosquitto and return once it logged "running" and its port accepts a TCP connect."""
        if self.running:
            return self
        mosquitto = find_mosquitto()
        self._write_files(mosquitto)
        log_start = self._log_size()
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [mosquitto, "-c", str(self.conf_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise RuntimeError(
                    f"mosquitto exited with {code} during start-up; {self.log_path}:\n{self._log_tail()}"
                )
            # "running" is logged once every listener is open: ours is up, not some other process on the port
            if self._log_has(log_start, _RUNNING):
                try:
                    with socket.create_connection((self.settings.host, self.port), timeout=0.2):
                        return self
                except OSError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"mosquitto did not accept connections on {self.url} within {timeout} s; "
                    f"{self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.01)  # poll interval, not a synchronisation delay

    def add_device(self, client_id: str, timeout: float = 30.0) -> Credentials:
        """Create (or return) a device's credentials; a running broker reloads its password file (SIGHUP).

        Returns after mosquitto logged "Reloading config.": its main loop is single-threaded, so every CONNECT it
        handles after that line sees the new password file and the device can connect at once. SIGHUP is repeated
        every second until then: a busy broker (writing a large snapshot) can fold signals that arrive close
        together into one reload, and reloading twice is harmless.
        """
        if client_id in self.devices:
            return self.devices[client_id]
        if self.settings.bridge is not None and self.running:
            raise RuntimeError(
                f"cannot add {client_id!r} to a running site broker: mosquitto does not reload its bridge, which "
                "carries the devices it started with; stop it, add the device here and at the central broker's "
                "site entry, then start it again"
            )
        creds = Credentials(_check_username(client_id), secrets.token_urlsafe(24))
        self.devices[client_id] = creds
        if not self.running:
            return creds  # written on the next start()
        assert self.process is not None
        self._write_passwd(find_mosquitto())
        offset = self._log_size()
        deadline = time.monotonic() + timeout
        next_signal = 0.0
        while not self._log_has(offset, _RELOADED):
            now = time.monotonic()
            if now > deadline or not self.running:
                raise RuntimeError(f"mosquitto did not reload within {timeout} s; {self.log_path}:\n{self._log_tail()}")
            if now >= next_signal:
                self.process.send_signal(signal.SIGHUP)
                next_signal = now + 1.0
            time.sleep(0.005)  # poll interval
        return creds

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (mosquitto saves its persistence file), wait, then SIGKILL if it hangs."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, no snapshot: simulates a crash (messages since the last autosave come back again)."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def write_credentials(self, path: Path) -> None:
        """Write the URL and all credentials as JSON (mode 0600) for the server and device launchers."""
        data = {
            "url": self.url,
            "server": {"username": self.server.username, "password": self.server.password},
            "devices": {cid: {"username": c.username, "password": c.password} for cid, c in self.devices.items()},
            "sites": {
                site: {"username": c.username, "password": c.password, "devices": self.settings.sites[site]}
                for site, c in self.sites.items()
            },
        }
        self._write_private(Path(path), json.dumps(data, indent=2) + "\n")

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
