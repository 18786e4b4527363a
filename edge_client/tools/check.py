"""`edge-client check`: is this device ready to join a federation? One line per item; exit status 0 when ready.

What a device owner wants to know before the service starts, each item checked for real:

* **broker**: the broker's port answers (a TCP connect, so "unreachable" is told apart from "refused"), then an
  MQTT 5 login with these credentials (the CONNACK reason code).
* **acl**: the broker lets this device publish on its own up topic. How: one QoS 1 publish there and the PUBACK's
  reason code. mosquitto (2.0 included, checked against 2.0.11) answers a publish its ACL denies with PUBACK 0x87
  "Not authorized" to an MQTT 5 client; MQTT 3.1.1 has no reason codes (a denied publish is acknowledged like any
  other) and a SUBACK says nothing about ACLs (eclipse-mosquitto/mosquitto#2042), so only this detects a denial.
  The message is a ``Presence`` "online" from this device, which the server already accepts from it; a server that
  knows the device sees it online while the check runs and its next hello or last will sets the state again.
* **data**: the data file loads (samples, classes, sample shape), with the loader the runtime uses.
* **torch** and **onnxruntime**: each is imported and used on this CPU in a subprocess of its own (``python -m
  edge_client.tools.check --probe NAME``), so a wheel built for newer ARM cores shows up as "SIGILL" on this line
  instead of killing the check (torch 2.10 and onnxruntime 1.21.0 on a Raspberry Pi 4, RESEARCH.md section 3).
* **device**: CPU, frequency, temperature, throttling flags, memory (information; never fails the check).
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge_client.wire.transport import LinkConfig

#: seconds a probe subprocess may take: importing torch under emulation takes tens of seconds
PROBE_TIMEOUT_S = 600.0
#: the Raspberry Pi 4 pins (pyproject.toml, firmware_scripts/make-wheel-bundle.sh), named when a probe dies of SIGILL
PI_PINS = "torch>=2.5,<2.10 and onnxruntime>=1.21.1 (torch 2.10 and onnxruntime 1.21.0 die on a Raspberry Pi 4)"


@dataclass(frozen=True)
class Item:
    """One line of the report; ``ok`` is None for information that cannot fail (or an item that was skipped)."""

    name: str
    ok: bool | None
    detail: str

    def line(self) -> str:
        status = {True: "ok", False: "FAIL", None: "info" if self.name == "device" else "skip"}[self.ok]
        return f"{status:<4}  {self.name:<11}  {self.detail}"


# ------------------------------------------------------------------------------------------------ broker and ACL
def _reachable(config: LinkConfig) -> str | None:
    """None when the broker's TCP port accepts a connection, else why not."""
    host, port, _ = config.endpoint()
    try:
        with socket.create_connection((host, port), timeout=min(config.connect_timeout_s, 10.0)):
            return None
    except OSError as exc:
        return f"cannot reach {host}:{port} ({exc.strerror or exc}): is the broker running and the URL right?"


def check_broker(make_config: Callable[[], LinkConfig], client_id: str, job: str) -> Iterator[Item]:
    """The broker and acl items: reachable, login accepted, a QoS 1 publish on this device's up topic acknowledged."""
    from edge_client.wire.messages import Presence
    from edge_client.wire.protocol import encode
    from edge_client.wire.topics import Topics
    from edge_client.wire.transport import MqttLink, scheme_mismatch

    try:
        config = make_config()
        config.endpoint()
        topic = Topics(job).up(client_id)
    except (OSError, ValueError) as exc:
        yield Item("broker", False, str(exc))
        yield Item("acl", None, "not checked: no broker connection")
        return
    unreachable = _reachable(config) or scheme_mismatch(config)
    if unreachable:
        yield Item("broker", False, unreachable)
        yield Item("acl", None, "not checked: no broker connection")
        return
    # its own MQTT client id: the service's session (edgefl-<job>-<id>) is never taken over
    link = MqttLink(config, f"edgefl-{job}-{client_id}-check", [])
    try:
        link.start()
    except ConnectionError as exc:
        yield Item("broker", False, str(exc))
        yield Item("acl", None, "not checked: no broker connection")
        return
    try:
        yield Item("broker", True, f"{config.url}: login as {config.username!r} accepted (MQTT 5)")
        link.publish(topic, encode(Presence(client_id=client_id, online=True, reason="edge-client check")))
        if not link.wait_published(config.connect_timeout_s):
            yield Item("acl", False, f"no PUBACK for a publish on {topic} within {config.connect_timeout_s:.0f} s")
        elif link.refused_publishes:
            reasons = ", ".join(sorted(link.refused_publishes))
            yield Item(
                "acl",
                False,
                f"the broker refused a publish on {topic} ({reasons}): its ACL must let user {config.username!r} "
                "write there (firmware_scripts/provision-broker.sh writes that ACL)",
            )
        else:
            yield Item("acl", True, f"may publish its updates on {topic} (QoS 1 PUBACK: success)")
    finally:
        link.stop()


# ---------------------------------------------------------------------------------------------------------- data
def check_data(path: str | None, label_column: str | None = None) -> Item:
    """The data item: the runtime's loader reads the file (a CSV with its label column); samples, classes and the
    sample shape."""
    if not path:
        return Item("data", None, "not checked: no --data given")
    import numpy as np

    from edge_client.learning.data import load_local_data

    try:
        data = load_local_data(path, label_column)
    except Exception as exc:  # any reason the runtime would fail on: missing, unreadable, corrupt, wrong arrays
        return Item("data", False, f"{path}: {type(exc).__name__}: {exc}")
    if len(data) == 0:
        return Item("data", False, f"{path}: no samples")
    classes = len(np.unique(data.y))
    shape = "x".join(str(d) for d in data.x.shape[1:])
    return Item("data", True, f"{path}: {len(data)} samples, {classes} classes, samples of {shape}")


# ------------------------------------------------------------------------------------------------ torch, onnxruntime
def _probe_torch() -> dict[str, str]:
    """One SGD step of the TACO CNN through edgefl's own model code (convolutions: where SIGILLs have hidden)."""
    import torch

    from edge_client.learning.models import build_model

    torch.manual_seed(0)
    model = build_model({"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28})
    loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,)))
    loss.backward()
    with torch.no_grad():  # the runtime's own SGD step; torch.optim would import torch._dynamo (seconds, ~70 MiB)
        for param in model.parameters():
            param -= 0.01 * param.grad
    if not torch.isfinite(loss):
        raise RuntimeError(f"the training step gave a loss of {loss.item()}")
    return {"version": torch.__version__, "detail": f"trains a step of the CNN, {torch.get_num_threads()} threads"}


def _probe_onnxruntime() -> dict[str, str]:
    import onnxruntime

    providers = onnxruntime.get_available_providers()
    if "CPUExecutionProvider" not in providers:
        raise RuntimeError(f"no CPUExecutionProvider among {providers}")
    return {"version": onnxruntime.__version__, "detail": f"providers {', '.join(providers)}"}


PROBES: dict[str, Callable[[], dict[str, str]]] = {"torch": _probe_torch, "onnxruntime": _probe_onnxruntime}


def _installed(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def check_import(name: str, *, python: str = sys.executable, timeout: float = PROBE_TIMEOUT_S) -> Item:
    """Import and use ``name`` in a subprocess of ``python``: a crash of the probe is a FAIL line, not the check's."""
    cmd = [python, "-m", "edge_client.tools.check", "--probe", name]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return Item(name, False, f"{name} {_installed(name)}: the probe did not finish within {timeout:.0f} s")
    except OSError as exc:
        return Item(name, False, f"cannot start {python} for the probe: {exc}")
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode)
        why = f"{name} {_installed(name)} died with {sig.name}"
        if sig == signal.SIGILL:
            why += f": it uses instructions this CPU ({platform.machine()}) does not have; install {PI_PINS}"
        return Item(name, False, why)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return Item(name, False, f"{name} {_installed(name)}: {last}")
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Item(name, False, f"the {name} probe printed no result: {proc.stdout[-200:]!r}")
    return Item(name, True, f"{result['version']} imports on this CPU ({platform.machine()}); {result['detail']}")


# -------------------------------------------------------------------------------------------------------- device
def check_device_metrics() -> Item:
    """CPU, frequency, temperature, throttling flags and memory, as the runtime reports them with every update."""
    import psutil

    from edge_client.loop import device

    info, snap = device.device_info(), device.snapshot()
    mem = psutil.virtual_memory()

    def val(v: float | None, unit: str) -> str:
        return "unknown" if v is None else f"{v:.0f} {unit}" if unit == "MHz" else f"{v:.1f} {unit}"

    flags = snap["throttled_flags"]
    throttling = "unknown (no vcgencmd)" if flags is None else ", ".join(flags) or "none"
    return Item(
        "device",
        None,
        f"{info['cpu_count']} x {info['machine']} CPU at {val(snap['cpu_freq_mhz'], 'MHz')}, "
        f"temperature {val(snap['temperature_c'], 'C')}, throttling {throttling}, "
        f"memory {mem.total / 2**30:.1f} GiB ({mem.available / 2**30:.1f} GiB available)",
    )


# ----------------------------------------------------------------------------------------------------------- run
def check_all(
    make_config: Callable[[], LinkConfig], client_id: str, job: str, data: str | None, label_column: str | None = None
) -> Iterator[Item]:
    """Every item in order, each yielded as soon as it is known (the torch probe takes a while on a device)."""
    yield from check_broker(make_config, client_id, job)
    yield check_data(data, label_column)
    for name in PROBES:
        yield check_import(name)
    yield check_device_metrics()


def report(items: Iterator[Item], client_id: str, job: str, out: Callable[[str], None] | None = None) -> int:
    """Print each item as it comes (flushed: an installer shows it live) and a verdict; 0 when nothing failed."""
    out = out or (lambda text: print(text, flush=True))
    failed = []
    for item in items:
        out(item.line())
        if item.ok is False:
            failed.append(item.name)
    if failed:
        out(f"NOT READY: fix {', '.join(failed)}, then run edge-client check again")
        return 1
    out(f"ready: device {client_id!r} can join job {job!r}")
    return 0


def _probe_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one probe of edge-client check (run in a subprocess)")
    parser.add_argument("--probe", choices=sorted(PROBES), required=True)
    args = parser.parse_args(argv)
    print(json.dumps(PROBES[args.probe]()))
    return 0


if __name__ == "__main__":
    sys.exit(_probe_main())
