"""What the device is and what it is doing: identity facts for the hello, metrics for every update.

psutil first, sysfs as the fallback (RESEARCH.md section 3): ``cpu_freq()`` may be None and
``sensors_temperatures()`` may be empty or use ``cpu_thermal`` or ``cpu-thermal`` depending on the kernel.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import psutil

SYSFS_FREQ = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")
SYSFS_TEMP = Path("/sys/class/thermal/thermal_zone0/temp")


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


def throttled_flags() -> int | None:
    """Raspberry Pi ``vcgencmd get_throttled`` bits (0 under-voltage, 1 capped, 2 throttled, 3 soft limit)."""
    binary = shutil.which("vcgencmd")
    if not binary:
        return None
    try:
        out = subprocess.run([binary, "get_throttled"], capture_output=True, text=True, timeout=2).stdout
        return int(out.strip().split("=")[1], 16)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


def snapshot() -> dict[str, Any]:
    """Metrics sampled around the local optimisation loop; missing sensors are None, never an error."""
    proc = psutil.Process()
    return {
        "cpu_percent": psutil.cpu_percent(interval=None),
        "cpu_freq_mhz": cpu_freq_mhz(),
        "temperature_c": temperature_c(),
        "rss_mb": round(proc.memory_info().rss / 2**20, 1),
        "throttled": throttled_flags(),
    }
