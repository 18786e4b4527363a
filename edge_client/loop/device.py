"""What the device is and what it is doing: identity facts for the hello, metrics for every update.

psutil first, sysfs as the fallback (RESEARCH.md section 3): ``cpu_freq()`` may be None and
``sensors_temperatures()`` may be empty or use ``cpu_thermal`` or ``cpu-thermal`` depending on the kernel. The sysfs
paths are module attributes (tests point them at temporary files). On a Raspberry Pi, ``vcgencmd get_throttled``
adds the throttling flags; whether ``vcgencmd`` exists is looked up once, and it is only run when it does.

:func:`snapshot` is taken right before and right after the local optimisation loop (runtime puts both into
``Update.metrics``); it costs well under a millisecond without ``vcgencmd`` (a subprocess, some ms, on a Pi).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

SYSFS_FREQ = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")
SYSFS_TEMP = Path("/sys/class/thermal/thermal_zone0/temp")
PROC_STATUS = Path("/proc/self/status")


def device_info() -> dict[str, Any]:
    """Static facts sent once with the hello."""
    from edge_client import __version__

    return {
        "hostname": socket.gethostname(),
        "system": platform.system(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count() or 1,
        "memory_mb": round(psutil.virtual_memory().total / 2**20),
        "edgefl": __version__,
    }


def cpu_freq_mhz() -> float | None:
    try:
        freq = psutil.cpu_freq()
    except (OSError, NotImplementedError):
        freq = None
    if freq and freq.current:
        return round(float(freq.current), 1)
    try:
        return round(int(SYSFS_FREQ.read_text()) / 1000, 1)
    except (OSError, ValueError):
        return None


def temperature_c() -> float | None:
    try:
        sensors = psutil.sensors_temperatures()
    except (AttributeError, OSError):
        sensors = {}
    for key in ("cpu_thermal", "cpu-thermal", "coretemp", "k10temp", "soc_thermal"):
        if sensors.get(key):
            return round(float(sensors[key][0].current), 1)
    try:
        return round(int(SYSFS_TEMP.read_text()) / 1000, 1)
    except (OSError, ValueError):
        return None


#: ``vcgencmd get_throttled`` bits (RESEARCH.md section 3): 0-3 "now", 16-19 "has occurred since boot"
THROTTLE_BITS: dict[int, str] = {
    0: "under_voltage",
    1: "freq_capped",
    2: "throttled",
    3: "soft_temp_limit",
    16: "under_voltage_occurred",
    17: "freq_capped_occurred",
    18: "throttled_occurred",
    19: "soft_temp_limit_occurred",
}

#: A simulated device's stand-in for ``vcgencmd get_throttled``: a file holding the value (``0xe000e``) that its
#: simulator (server.experiments.simulate) writes when the device's CPU quota drops; absent: not throttled.
EMULATED_ENV = "EDGEFL_THROTTLED_FILE"

_UNKNOWN = object()
#: path of ``vcgencmd``, None when absent (or when it failed once), ``_UNKNOWN`` until first looked up
_vcgencmd: Any = _UNKNOWN


def vcgencmd_path() -> str | None:
    """``vcgencmd``'s path, looked up once per process (``shutil.which`` scans PATH on every call)."""
    global _vcgencmd
    if _vcgencmd is _UNKNOWN:
        _vcgencmd = shutil.which("vcgencmd")
    return _vcgencmd


def decode_throttled(value: int | str | None) -> list[str]:
    """Names of the set bits of a ``get_throttled`` value (int or ``"0x50005"``); unknown bits as ``bit_N``."""
    if value is None:
        return []
    if isinstance(value, str):
        value = int(value.strip().split("=")[-1], 0)
    value = int(value)
    if value < 0:
        raise ValueError(f"throttled value must be >= 0, got {value}")
    return [THROTTLE_BITS.get(bit, f"bit_{bit}") for bit in range(value.bit_length()) if value >> bit & 1]


def throttled_flags() -> int | None:
    """Raspberry Pi ``vcgencmd get_throttled`` bits (see THROTTLE_BITS), None when there is no ``vcgencmd``; a
    simulated device's from its ``EMULATED_ENV`` file.

    A ``vcgencmd`` that fails (e.g. no access to ``/dev/vcio`` under systemd's ``PrivateDevices=yes``) is not run
    again in this process, so every later snapshot stays cheap.
    """
    global _vcgencmd
    emulated = os.environ.get(EMULATED_ENV)
    if emulated:
        try:
            return int(Path(emulated).read_text().strip() or "0", 0)
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            log.warning("%s=%s unreadable (%s); throttling flags are not reported", EMULATED_ENV, emulated, exc)
            return None
    binary = vcgencmd_path()
    if not binary:
        return None
    try:
        out = subprocess.run([binary, "get_throttled"], capture_output=True, text=True, timeout=2).stdout
        return int(out.strip().split("=")[1], 16)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError) as exc:
        log.warning("vcgencmd get_throttled failed (%s); throttling flags are not reported", exc)
        _vcgencmd = None
        return None


def peak_rss_mb() -> float | None:
    """Peak resident memory of this process in MiB: its own high-water mark, ``VmHWM`` in ``/proc/self/status``.

    Not ``ru_maxrss`` on Linux: a forked child starts with its parent's high-water mark and keeps it as its
    ``maxrss`` through exec, so a client started by a large process (a server, a benchmark, a test) would report
    the parent's peak. ``VmHWM`` belongs to the process's own address space and starts afresh at exec. Where there
    is no /proc (macOS), ``ru_maxrss`` is the best there is.
    """
    try:
        with open(PROC_STATUS, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)  # kB
    except (OSError, ValueError, IndexError):
        pass
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def net_bytes() -> tuple[int | None, int | None]:
    """Bytes sent and received by all interfaces since boot (system-wide; None when unavailable)."""
    try:
        io = psutil.net_io_counters()
    except (OSError, RuntimeError):
        io = None
    if io is None:
        return None, None
    return int(io.bytes_sent), int(io.bytes_recv)


def torch_threads() -> int | None:
    """torch's intra-op threads if torch is already loaded (never imports it: the inference path has no torch)."""
    torch = sys.modules.get("torch")
    try:
        return int(torch.get_num_threads()) if torch is not None else None
    except Exception:  # a half-imported torch
        return None


def snapshot() -> dict[str, Any]:
    """Metrics sampled around the local optimisation loop; missing sensors are None, never an error.

    Every value is a JSON/msgpack scalar or a list of strings.
    """
    proc = psutil.Process()
    throttled = throttled_flags()
    sent, recv = net_bytes()
    try:
        process_threads: int | None = proc.num_threads()
    except (OSError, psutil.Error):
        process_threads = None
    return {
        "time": round(time.time(), 3),
        "cpu_percent": psutil.cpu_percent(interval=None),
        "cpu_freq_mhz": cpu_freq_mhz(),
        "temperature_c": temperature_c(),
        "rss_mb": round(proc.memory_info().rss / 2**20, 1),
        "peak_rss_mb": peak_rss_mb(),
        "throttled": throttled,
        "throttled_flags": decode_throttled(throttled) if throttled is not None else None,
        "process_threads": process_threads,
        "torch_threads": torch_threads(),
        "net_bytes_sent": sent,
        "net_bytes_recv": recv,
    }


def summarise(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One flat record of a round from the snapshots around it (for reports and ``metrics.jsonl``).

    Throttling flags are the union of both snapshots; network bytes are the difference (system-wide counters, so
    they include other traffic of the device: the MQTT bytes themselves are counted by the link).
    """

    def diff(key: str) -> int | None:
        a, b = before.get(key), after.get(key)
        return b - a if isinstance(a, int) and isinstance(b, int) and b >= a else None

    flags = None
    if before.get("throttled_flags") is not None or after.get("throttled_flags") is not None:
        seen = [*(before.get("throttled_flags") or []), *(after.get("throttled_flags") or [])]
        flags = sorted(set(seen), key=seen.index)
    return {
        "cpu_freq_mhz_before": before.get("cpu_freq_mhz"),
        "cpu_freq_mhz_after": after.get("cpu_freq_mhz"),
        "temperature_c_before": before.get("temperature_c"),
        "temperature_c_after": after.get("temperature_c"),
        "throttled_flags": flags,
        "peak_rss_mb": after.get("peak_rss_mb"),
        "torch_threads": after.get("torch_threads"),
        "net_bytes_sent": diff("net_bytes_sent"),
        "net_bytes_recv": diff("net_bytes_recv"),
    }
