"""Device metrics: throttling bits, sysfs fallbacks, vcgencmd handling, the snapshot record."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import psutil
import pytest

from edge_client.loop import device

Temp = namedtuple("Temp", "label current high critical")
Freq = namedtuple("Freq", "current min max")


@pytest.fixture(autouse=True)
def fresh_vcgencmd_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test looks vcgencmd up afresh, and no test leaves its fake behind."""
    monkeypatch.setattr(device, "_vcgencmd", device._UNKNOWN)


def fake_vcgencmd(directory: Path, output: str, exit_code: int = 0) -> Path:
    """An executable ``vcgencmd`` that prints ``output`` and counts its calls in ``calls``."""
    script = directory / "vcgencmd"
    script.write_text(f'#!/bin/sh\necho x >> "{directory / "calls"}"\necho "{output}"\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def calls(directory: Path) -> int:
    path = directory / "calls"
    return len(path.read_text().splitlines()) if path.exists() else 0


# ------------------------------------------------------------------ decode_throttled
def test_decode_throttled_known_values() -> None:
    assert device.decode_throttled(0x50005) == [
        "under_voltage",
        "throttled",
        "under_voltage_occurred",
        "throttled_occurred",
    ]
    assert device.decode_throttled(0) == []
    assert device.decode_throttled(None) == []
    assert device.decode_throttled(0x2) == ["freq_capped"]
    assert device.decode_throttled(0x80008) == ["soft_temp_limit", "soft_temp_limit_occurred"]
    assert device.decode_throttled(0xF000F) == [device.THROTTLE_BITS[b] for b in (0, 1, 2, 3, 16, 17, 18, 19)]


def test_decode_throttled_strings_and_unknown_bits() -> None:
    assert device.decode_throttled("throttled=0x50005") == device.decode_throttled(0x50005)
    assert device.decode_throttled("0x20002") == ["freq_capped", "freq_capped_occurred"]
    assert device.decode_throttled(1 << 30) == ["bit_30"]
    with pytest.raises(ValueError):
        device.decode_throttled(-1)


# ------------------------------------------------------------------ sysfs fallbacks
def test_cpu_freq_falls_back_to_sysfs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    freq_file = tmp_path / "scaling_cur_freq"
    freq_file.write_text("1500000\n")
    monkeypatch.setattr(device, "SYSFS_FREQ", freq_file)
    monkeypatch.setattr(psutil, "cpu_freq", lambda: None)
    assert device.cpu_freq_mhz() == 1500.0

    def unsupported() -> None:
        raise NotImplementedError

    monkeypatch.setattr(psutil, "cpu_freq", unsupported)
    assert device.cpu_freq_mhz() == 1500.0
    monkeypatch.setattr(device, "SYSFS_FREQ", tmp_path / "absent")
    assert device.cpu_freq_mhz() is None
    monkeypatch.setattr(psutil, "cpu_freq", lambda: Freq(600.0, 600.0, 1500.0))
    assert device.cpu_freq_mhz() == 600.0  # psutil first


def test_temperature_falls_back_to_sysfs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    temp_file = tmp_path / "temp"
    temp_file.write_text("48312\n")
    monkeypatch.setattr(device, "SYSFS_TEMP", temp_file)
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: {}, raising=False)
    assert device.temperature_c() == 48.3
    monkeypatch.delattr(psutil, "sensors_temperatures", raising=False)  # e.g. macOS
    assert device.temperature_c() == 48.3
    temp_file.write_text("garbage")
    assert device.temperature_c() is None
    # both kernel spellings of the Pi's sensor
    for key in ("cpu_thermal", "cpu-thermal"):
        sensors = {key: [Temp("", 61.5, None, None)]}
        monkeypatch.setattr(psutil, "sensors_temperatures", lambda s=sensors: s, raising=False)
        assert device.temperature_c() == 61.5


# ------------------------------------------------------------------ vcgencmd
def test_no_vcgencmd_runs_no_subprocess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("no subprocess without vcgencmd")

    monkeypatch.setattr(subprocess, "run", forbidden)
    assert device.throttled_flags() is None
    snap = device.snapshot()
    assert snap["throttled"] is None and snap["throttled_flags"] is None


def test_vcgencmd_is_looked_up_once_and_decoded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_vcgencmd(tmp_path, "throttled=0x50005")
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    assert device.throttled_flags() == 0x50005
    snap = device.snapshot()
    assert snap["throttled"] == 0x50005
    assert snap["throttled_flags"] == ["under_voltage", "throttled", "under_voltage_occurred", "throttled_occurred"]
    assert calls(tmp_path) == 2
    monkeypatch.setenv("PATH", "/nonexistent")  # cached: found once, kept
    assert device.throttled_flags() == 0x50005


def test_failing_vcgencmd_is_not_run_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_vcgencmd(tmp_path, "VCHI initialization failed", exit_code=255)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    assert device.throttled_flags() is None
    assert device.throttled_flags() is None
    assert calls(tmp_path) == 1


# ------------------------------------------------------------------ snapshot and friends
SNAPSHOT_KEYS = {
    "time",
    "cpu_percent",
    "cpu_freq_mhz",
    "temperature_c",
    "rss_mb",
    "peak_rss_mb",
    "throttled",
    "throttled_flags",
    "process_threads",
    "torch_threads",
    "net_bytes_sent",
    "net_bytes_recv",
}


def test_snapshot_keys_and_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    snap = device.snapshot()
    assert set(snap) == SNAPSHOT_KEYS
    assert json.loads(json.dumps(snap)) == snap
    assert snap["rss_mb"] > 0
    if sys.platform != "win32":
        assert snap["peak_rss_mb"] > 0
    assert snap["process_threads"] is None or snap["process_threads"] >= 1


def test_snapshot_with_no_sensors_at_all(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(psutil, "cpu_freq", lambda: None)
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: {}, raising=False)
    monkeypatch.setattr(psutil, "net_io_counters", lambda: None)
    monkeypatch.setattr(device, "SYSFS_FREQ", tmp_path / "no-freq")
    monkeypatch.setattr(device, "SYSFS_TEMP", tmp_path / "no-temp")
    snap = device.snapshot()
    assert set(snap) == SNAPSHOT_KEYS
    assert snap["cpu_freq_mhz"] is None and snap["temperature_c"] is None
    assert snap["net_bytes_sent"] is None and snap["net_bytes_recv"] is None
    json.dumps(snap)


def test_snapshot_runs_no_subprocess_without_vcgencmd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What keeps a snapshot cheap (well under a millisecond): without vcgencmd it starts no process."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(device, "_vcgencmd", device._UNKNOWN)

    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"snapshot started a process: {args}")

    monkeypatch.setattr(device.subprocess, "run", no_process)
    for _ in range(3):
        assert device.snapshot()["throttled"] is None


def test_peak_rss_is_in_mib() -> None:
    peak = device.peak_rss_mb()
    if sys.platform == "win32":
        assert peak is None
        return
    rss = psutil.Process().memory_info().rss / 2**20
    assert 0.5 * rss <= peak <= 64 * 1024  # KiB read as MiB would be ~1000x too large


def test_peak_rss_is_the_processs_own_not_its_parents() -> None:
    """A child started by a large process reports its own peak (``ru_maxrss`` would report the parent's)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc here")
    block = np.ones(300 * 2**20 // 8)  # the parent touches 300 MiB before starting the child
    code = (
        "import json, resource; from edge_client.loop.device import peak_rss_mb; "
        "print(json.dumps([peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    own, maxrss = json.loads(out.stdout)
    assert block.sum() > 0
    assert maxrss >= 300, "premise: ru_maxrss carries the parent's peak through fork and exec"
    assert own < 150, f"the child reported {own} MiB: not its own high-water mark"


def test_torch_threads_never_imports_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert device.torch_threads() is None
    assert "torch" not in sys.modules


def test_summarise_before_and_after() -> None:
    before = {
        "cpu_freq_mhz": 1500.0,
        "temperature_c": 55.0,
        "throttled_flags": ["freq_capped_occurred"],
        "peak_rss_mb": 100.0,
        "net_bytes_sent": 1000,
        "net_bytes_recv": 5000,
    }
    after = {
        "cpu_freq_mhz": 1000.0,
        "temperature_c": 81.0,
        "throttled_flags": ["soft_temp_limit", "freq_capped_occurred"],
        "peak_rss_mb": 180.0,
        "torch_threads": 4,
        "net_bytes_sent": 1500,
        "net_bytes_recv": 4000,  # counter reset: no difference
    }
    summary = device.summarise(before, after)
    assert summary == {
        "cpu_freq_mhz_before": 1500.0,
        "cpu_freq_mhz_after": 1000.0,
        "temperature_c_before": 55.0,
        "temperature_c_after": 81.0,
        "throttled_flags": ["freq_capped_occurred", "soft_temp_limit"],
        "peak_rss_mb": 180.0,
        "torch_threads": 4,
        "net_bytes_sent": 500,
        "net_bytes_recv": None,
    }
    assert device.summarise({}, {})["throttled_flags"] is None
    json.dumps(device.summarise(device.snapshot(), device.snapshot()))
