"""The device's Python on an emulated Raspberry Pi 4, in the reduced size that fits the test suite.

The whole check (the bundle installed by install-edge-client.sh, a real server and mosquitto, two rounds of the TACO
CNN, fetch-model, predict, benchmark) is ``firmware_scripts/qemu-smoke.sh``, a release check whose output is recorded
in firmware_scripts/README.md. Here, with the arm64 root and the wheel bundle that ``scripts/setup.sh`` prepares
(in ``$EDGEFL_QEMU_WORKDIR``, default /var/tmp/edgefl-qemu): ``qemu-smoke.sh --probe-only`` imports every binary
wheel of the bundle on an emulated Cortex-A72 and trains one step of the TACO CNN with the bundle's edgefl; and the
emulator really refuses what a Cortex-A72 lacks (the LSE atomics behind torch 2.4's SIGILL on a Pi 4), so a wheel
built for newer cores cannot pass unnoticed.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from edgefl_testkit.basics import in_ci

REPO = Path(__file__).resolve().parents[2]
WORKDIR = Path(os.environ.get("EDGEFL_QEMU_WORKDIR", "/var/tmp/edgefl-qemu"))
ROOTFS = WORKDIR / "rootfs"
EMULATED = ROOTFS / "usr/bin/python3-emulated"
BUNDLE = WORKDIR / "bundle"
FULL = bool(os.environ.get("EDGEFL_FULL"))  # the release checks (docs/testing.md)
pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: ``ldaddal w1, w0, [x0]; ret`` as ``int f(int *p, int v)``: an ARMv8.1 LSE atomic add, which a Cortex-A72
#: (ARMv8.0) does not have
LSE_ATOMIC = """
import ctypes, mmap
code = bytes.fromhex("0000e1b8" "c0035fd6")
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
add = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int)(
    ctypes.addressof(ctypes.c_char.from_buffer(page)))
value = ctypes.c_int(5)
old = add(ctypes.byref(value), 3)
print(old, value.value)
"""


@pytest.fixture(scope="module")
def emulated_pi() -> None:
    if not EMULATED.exists() or not list(BUNDLE.glob("torch-*aarch64*.whl")):
        message = f"no emulated Raspberry Pi in {WORKDIR} (bash scripts/setup.sh prepares it)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    if os.geteuid() != 0:
        pytest.skip("qemu-smoke.sh runs as root")


def test_bundle_imports_and_trains_on_an_emulated_cortex_a72(emulated_pi: None) -> None:
    result = subprocess.run(
        ["bash", REPO / "firmware_scripts/qemu-smoke.sh", "--probe-only", "--bundle", BUNDLE, "--workdir", WORKDIR],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    torch_wheel = next(BUNDLE.glob("torch-*aarch64*.whl")).name
    assert re.search(rf"^  ok +{re.escape(torch_wheel)}$", out, re.M), out
    assert re.search(r"^  ok +onnxruntime-\S+aarch64\S*\.whl$", out, re.M), out
    trained = re.search(r"^  ok +training: loss \S+, update norm (\S+) over (\d+) parameters, torch (\S+),", out, re.M)
    assert trained, out
    assert float(trained[1]) > 0 and int(trained[2]) > 40_000  # the TACO CNN's 44,426 parameters moved
    assert trained[3].split("+")[0] == torch_wheel.split("-")[1]  # the bundle's torch, not this machine's
    assert "every binary wheel imports and the TACO CNN trains on an emulated cortex-a72" in out
    if list(BUNDLE.glob("cryptography-*aarch64*.whl")):  # the extra "secure" (setup.sh: make-wheel-bundle.sh --secure)
        masked = re.search(r"^  ok +secure aggregation: cryptography \S+, two masked inputs of (\d+) ", out, re.M)
        assert masked and int(masked[1]) == int(trained[2]), out  # X25519, HKDF, AES-GCM, ChaCha20 on a Cortex-A72
    else:
        assert "no cryptography wheel in the bundle" in (WORKDIR / "probe" / "probe.log").read_text()


@pytest.mark.skipif(not FULL, reason="the whole release check with --secure (many minutes): EDGEFL_FULL=1")
def test_the_secure_extra_installs_from_the_bundle_and_a_masked_round_runs(emulated_pi: None) -> None:
    """Issue 26's device path: ``qemu-smoke.sh --secure`` installs ``edgefl-mqtt[secure]`` from the offline bundle
    into the emulated device's venv, and one round aggregates securely between the emulated device and a device on
    this machine (step 7)."""
    if not list(BUNDLE.glob("cryptography-*aarch64*.whl")):
        pytest.fail(f"{BUNDLE} has no cryptography wheel: make-wheel-bundle.sh --secure --out {BUNDLE} adds it")
    result = subprocess.run(
        ["bash", REPO / "firmware_scripts/qemu-smoke.sh", "--secure", "--no-footprint", "--bundle", BUNDLE,
         "--workdir", WORKDIR],
        capture_output=True, text=True, timeout=3600, check=False,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-5000:]
    masked = re.search(r"^  secure_rounds 1, masked inputs 2, threshold 2, the device's own seconds", out, re.M)
    assert masked, out


def test_the_emulator_refuses_instructions_a_cortex_a72_lacks(emulated_pi: None) -> None:
    a72 = subprocess.run([EMULATED, "-c", LSE_ATOMIC], capture_output=True, text=True, timeout=120, check=False)
    assert a72.returncode == -4, (a72.returncode, a72.stdout, a72.stderr)  # SIGILL
    # the same code is valid on a newer core: only the CPU model refuses it
    newer = subprocess.run(
        ["/usr/bin/qemu-aarch64", "-cpu", "max", "-L", ROOTFS, ROOTFS / "usr/bin/python3", "-c", LSE_ATOMIC],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert newer.returncode == 0 and newer.stdout.split() == ["5", "8"], (newer.stdout, newer.stderr)
