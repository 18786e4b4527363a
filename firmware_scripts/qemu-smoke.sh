#!/usr/bin/env bash
# Release check, not a CI test (it takes 10+ minutes): build a Debian bookworm arm64 root, install the wheel bundle
# with install-edge-client.sh inside it, then run a short training and an onnxruntime inference under qemu emulating
# a Raspberry Pi 4's Cortex-A72. Catches wheels that die with SIGILL on a Pi 4 (torch 2.10, onnxruntime 1.21.0).
# Needs root, debootstrap, qemu-user-static and binfmt-support (apt-get install -y debootstrap qemu-user-static
# binfmt-support). See firmware_scripts/README.md.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROG=$(basename "$0")
die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }

usage() {
    cat <<EOF
Usage: $PROG --bundle DIR [options]
  --bundle DIR     wheel bundle from make-wheel-bundle.sh (required)
  --workdir DIR    where the arm64 root is built and kept for re-runs (default: /var/tmp/edgefl-qemu)
  --suite NAME     Debian suite (default: bookworm)
  --mirror URL     Debian mirror for debootstrap (default: http://deb.debian.org/debian)
  --cpu MODEL      QEMU_CPU model to emulate (default: cortex-a72, the Raspberry Pi 4)
  --steps N        local SGD steps of the training smoke (default: 5)
  --fresh          delete an existing root first
  -h, --help       this text
Exit status 0 when both the training and the inference ran; a SIGILL shows as exit status 132 of the smoke step.
EOF
}

BUNDLE="" WORKDIR=/var/tmp/edgefl-qemu SUITE=bookworm MIRROR=http://deb.debian.org/debian CPU=cortex-a72 STEPS=5
FRESH=0
need_arg() { if [ "$#" -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi; }
while [ "$#" -gt 0 ]; do
    case "$1" in
        --bundle) need_arg "$@"; BUNDLE=$2; shift 2 ;;
        --workdir) need_arg "$@"; WORKDIR=$2; shift 2 ;;
        --suite) need_arg "$@"; SUITE=$2; shift 2 ;;
        --mirror) need_arg "$@"; MIRROR=$2; shift 2 ;;
        --cpu) need_arg "$@"; CPU=$2; shift 2 ;;
        --steps) need_arg "$@"; STEPS=$2; shift 2 ;;
        --fresh) FRESH=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done
[ -n "$BUNDLE" ] || { usage >&2; die "--bundle is required"; }
[ -d "$BUNDLE" ] || die "--bundle $BUNDLE is not a directory"
find "$BUNDLE" -maxdepth 1 -name 'torch-*aarch64*.whl' | grep -q . || die "$BUNDLE holds no aarch64 torch wheel"
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || die "--steps must be a positive integer"
[ "$(id -u)" -eq 0 ] || die "run as root (debootstrap, chroot, binfmt_misc)"
for tool in debootstrap update-binfmts chroot; do
    command -v "$tool" >/dev/null || die "$tool is missing: apt-get install -y debootstrap qemu-user-static binfmt-support"
done
QEMU=$(command -v qemu-aarch64-static || true)
[ -n "$QEMU" ] || die "qemu-aarch64-static is missing: apt-get install -y qemu-user-static"

ROOTFS=$WORKDIR/rootfs
mounted=()
cleanup() {
    local m i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        m=${mounted[$i]}
        umount -l "$m" 2>/dev/null || true
    done
}
trap cleanup EXIT
mount_in() { # mount_in TYPE SOURCE TARGET
    mkdir -p "$3"
    mountpoint -q "$3" || { mount -t "$1" "$2" "$3"; mounted+=("$3"); }
}

# binfmt: let the kernel run aarch64 ELF files through qemu-aarch64-static
if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
update-binfmts --enable qemu-aarch64 2>/dev/null || true
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || die "binfmt entry qemu-aarch64 is not registered"

if [ "$FRESH" -eq 1 ]; then
    cleanup
    rm -rf "$ROOTFS"
fi
if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
    log "debootstrap $SUITE arm64 into $ROOTFS (about 5 minutes)"
    rm -rf "$ROOTFS"
    mkdir -p "$ROOTFS"
    debootstrap --arch arm64 --foreign --variant=minbase \
        --include=python3,python3-venv,ca-certificates,passwd "$SUITE" "$ROOTFS" "$MIRROR"
    install -m 0755 "$QEMU" "$ROOTFS/usr/bin/qemu-aarch64-static"
    QEMU_CPU=$CPU chroot "$ROOTFS" /debootstrap/debootstrap --second-stage
fi
install -m 0755 "$QEMU" "$ROOTFS/usr/bin/qemu-aarch64-static"
mount_in proc proc "$ROOTFS/proc"
mount_in sysfs sysfs "$ROOTFS/sys"
mount_in tmpfs tmpfs "$ROOTFS/tmp"

# the bundle and the firmware scripts go into the root; no network is used from here on
mkdir -p "$ROOTFS/tmp/bundle" "$ROOTFS/tmp/firmware_scripts"
cp -a "$BUNDLE"/. "$ROOTFS/tmp/bundle/"
cp -a "$HERE"/. "$ROOTFS/tmp/firmware_scripts/"
export QEMU_CPU=$CPU
log "installing the bundle with install-edge-client.sh (about 3 minutes under emulation)"
chroot "$ROOTFS" /bin/bash /tmp/firmware_scripts/install-edge-client.sh --wheels /tmp/bundle --no-start \
    --client-id qemu-smoke --broker mqtt://127.0.0.1:1883

cat >"$ROOTFS/tmp/smoke.py" <<'PY'
"""Short training with edgefl's model code and an onnxruntime inference, on this (emulated) CPU."""
import platform
import sys
import time

import numpy as np

steps = int(sys.argv[1])
print("machine", platform.machine(), "python", platform.python_version(), flush=True)
import torch  # noqa: E402  (a SIGILL here means the torch wheel does not run on this CPU)

from edge_client.models import build_model, get_flat  # noqa: E402
from edge_client.trainer import prepare_process  # noqa: E402

print("torch", torch.__version__, flush=True)
prepare_process(2)
rng = np.random.default_rng(0)
x = rng.random((64, 1, 28, 28), dtype=np.float32)
y = rng.integers(0, 10, 64).astype(np.int64)
np.savez("/tmp/smoke.npz", x=x, y=y)
model = build_model({"name": "cnn"})
opt = torch.optim.SGD(model.parameters(), lr=0.05)
w0 = get_flat(model).copy()
t0 = time.perf_counter()
for _ in range(steps):
    idx = rng.integers(0, 64, 16)
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx]))
    opt.zero_grad()
    loss.backward()
    opt.step()
delta = w0 - get_flat(model)
assert np.isfinite(delta).all() and np.abs(delta).sum() > 0, "training did not change the weights"
print(f"train: {steps} steps, loss {loss.item():.4f}, {time.perf_counter() - t0:.1f} s (emulated)", flush=True)

import onnxruntime as ort  # noqa: E402

print("onnxruntime", ort.__version__, flush=True)
model.eval()
torch.onnx.export(model, torch.from_numpy(x[:1]), "/tmp/smoke.onnx", input_names=["x"], output_names=["logits"],
                  dynamo=False)
session = ort.InferenceSession("/tmp/smoke.onnx", providers=["CPUExecutionProvider"])
(logits,) = session.run(None, {"x": x[:1]})
with torch.no_grad():
    expected = model(torch.from_numpy(x[:1])).numpy()
assert np.allclose(logits, expected, atol=1e-4), "onnxruntime and torch disagree"
print("inference: onnxruntime matches torch", logits.shape, flush=True)
PY
log "smoke: training and inference under QEMU_CPU=$CPU"
set +e
chroot "$ROOTFS" /opt/edgefl/venv/bin/edge-client --version
chroot "$ROOTFS" /opt/edgefl/venv/bin/python /tmp/smoke.py "$STEPS"
rc=$?
set -e
if [ "$rc" -eq 132 ]; then
    die "SIGILL: a wheel in $BUNDLE uses instructions a $CPU does not have"
elif [ "$rc" -ne 0 ]; then
    die "smoke test failed with exit status $rc"
fi
log "OK: the bundle trains and infers on an emulated $CPU"
