#!/usr/bin/env bash
# Release check of the device path on an emulated Raspberry Pi 4, with no kernel-wide change. An arm64 Debian root
# comes from Debian's packages (mmdebstrap --variant=extract: the packages are only unpacked, no maintainer script
# runs, so nothing arm64 has to be executed while building it) and is kept in --workdir for re-runs. Its python3 runs
# under user-mode emulation by calling the emulator explicitly: ROOT/usr/bin/python3-emulated is a shell script that
# runs `qemu-aarch64 -cpu cortex-a72 -L ROOT -0 "$0" ROOT/usr/bin/python3`. No binfmt_misc entry is registered: a
# venv made by it points at that script, so its entry points (edge-client) and its own subprocesses (ensurepip,
# edge-client check's probes) are started through the emulator as well. See firmware_scripts/README.md.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
PROG=$(basename "$0")
die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }

usage() {
    cat <<EOF
Usage: $PROG --bundle DIR [options]      the whole check (as root, on Debian)
       $PROG --root-only [options]       build (or reuse) the arm64 root and its emulated python, then stop
       $PROG --probe-only --bundle DIR   and step 1 below, then stop (the test suite runs this)

Steps of the whole check, with nothing on the emulated device but the bundle's wheels:
  1. every binary wheel of the bundle imported under emulation, one after another in one process, then one training
     step of the TACO CNN with the bundle's edgefl: a wheel built for newer ARM cores dies with SIGILL, and the
     wheel is named (exit status 3); with the cryptography wheel in the bundle, also a masked round of two devices
     in memory (secure aggregation's X25519, HKDF, AES-GCM and ChaCha20 on the emulated CPU);
  2. install-edge-client.sh --root ROOT --wheels DIR (pip install --no-index), ending with edge-client check;
  3. a real edge-server run and its mosquitto on loopback (per-device login, the edgefl ACL); edge-client run joins
     and trains the TACO CNN on its MNIST shard for --rounds rounds; the server aggregates its updates;
  4. edge-client fetch-model and edge-client predict (onnxruntime) on MNIST test samples;
  5. edge-client benchmark; 6. the footprint benchmark (python -m benchmarks.footprint) under emulation;
  7. with --secure: the device installed with the extra "secure" from the bundle (make-wheel-bundle.sh --secure),
     and one masked round (secure aggregation) of the emulated device and a second device on this machine.

Options:
  --bundle DIR         wheel bundle from make-wheel-bundle.sh
  --workdir DIR        default /var/tmp/edgefl-qemu: rootfs/ is kept for re-runs, probe/ and run/ are remade
  --suite NAME         Debian suite of the root (default: bookworm, Raspberry Pi OS's base)
  --mirror URL         Debian mirror (default: http://deb.debian.org/debian)
  --cpu MODEL          CPU model the emulator presents (default: cortex-a72, the Raspberry Pi 4's)
  --rounds N           federated rounds (default: 2)
  --local-steps N      local SGD steps per round (default: 100: two rounds take the CNN well above chance)
  --server-python PY   this machine's interpreter with edgefl-mqtt[server] (default: $REPO/.venv/bin/python)
  --no-footprint       skip step 6
  --secure             install edgefl-mqtt[secure] (the bundle must hold the aarch64 cryptography wheel) and run
                       step 7
  --fresh              rebuild the root and unpack the wheels again
  -h, --help           this text
Missing tools (qemu-user, mmdebstrap) are installed with apt-get --no-install-recommends: qemu-user recommends
qemu-user-binfmt, which would register binfmt_misc entries. Timing under emulation means nothing.
Exit status: 0 every step passed; 1 a step failed; 2 bad usage or a missing tool; 3 a wheel dies with SIGILL.
EOF
}

BUNDLE="" WORKDIR=/var/tmp/edgefl-qemu SUITE=bookworm MIRROR=http://deb.debian.org/debian CPU=cortex-a72
ROUNDS=2 STEPS=100 SERVER_PY=$REPO/.venv/bin/python FOOTPRINT=1 FRESH=0 MODE=full SECURE=0
need_arg() { if [ "$#" -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi; }
while [ "$#" -gt 0 ]; do
    case "$1" in
        --bundle) need_arg "$@"; BUNDLE=$2; shift 2 ;;
        --workdir) need_arg "$@"; WORKDIR=$2; shift 2 ;;
        --suite) need_arg "$@"; SUITE=$2; shift 2 ;;
        --mirror) need_arg "$@"; MIRROR=$2; shift 2 ;;
        --cpu) need_arg "$@"; CPU=$2; shift 2 ;;
        --rounds) need_arg "$@"; ROUNDS=$2; shift 2 ;;
        --local-steps) need_arg "$@"; STEPS=$2; shift 2 ;;
        --server-python) need_arg "$@"; SERVER_PY=$2; shift 2 ;;
        --no-footprint) FOOTPRINT=0; shift ;;
        --secure) SECURE=1; shift ;;
        --root-only) MODE=root; shift ;;
        --probe-only) MODE=probe; shift ;;
        --fresh) FRESH=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done
if [ "$MODE" != root ]; then
    [ -n "$BUNDLE" ] || { usage >&2; die "--bundle is required"; }
    [ -d "$BUNDLE" ] || die "--bundle $BUNDLE is not a directory"
    BUNDLE=$(cd "$BUNDLE" && pwd)
    find "$BUNDLE" -maxdepth 1 -name 'torch-*aarch64*.whl' | grep -q . || die "$BUNDLE holds no aarch64 torch wheel"
    [ "$SECURE" -eq 0 ] || find "$BUNDLE" -maxdepth 1 -name 'cryptography-*aarch64*.whl' | grep -q . ||
        die "--secure: $BUNDLE holds no aarch64 cryptography wheel (make-wheel-bundle.sh --secure)"
    [ -x "$SERVER_PY" ] || die "--server-python $SERVER_PY is not executable (bash scripts/setup.sh makes .venv)"
fi
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive integer"
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || die "--local-steps must be a positive integer"
# ARM's part numbers (the MIDR) of the cores qemu-aarch64 emulates, for the emulated /proc/cpuinfo (see below)
declare -A PART=([cortex-a53]=0xd03 [cortex-a55]=0xd05 [cortex-a57]=0xd07 [cortex-a72]=0xd08 [cortex-a76]=0xd0b
    [neoverse-n1]=0xd0c)
[ -n "${PART[$CPU]:-}" ] || die "--cpu must be one of: ${!PART[*]}"
[ "$(id -u)" -eq 0 ] || die "run as root (mmdebstrap unpacks the root with its files' owners)"
mkdir -p "$WORKDIR"
WORKDIR=$(cd "$WORKDIR" && pwd)
ROOTFS=$WORKDIR/rootfs
EMULATED=$ROOTFS/usr/bin/python3-emulated
QEMU=/usr/bin/qemu-aarch64
T0=$(date +%s)

step() { echo; echo "=== [$(($(date +%s) - T0)) s] $*"; }

# --- tools: from Debian, without the recommended binfmt registration ---------------------------------------------
missing=()
[ -x "$QEMU" ] || missing+=(qemu-user)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
if [ "${#missing[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    log "installing ${missing[*]} from Debian (--no-install-recommends: no qemu-user-binfmt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- the arm64 root and its emulated python -----------------------------------------------------------------------
# What Raspberry Pi OS Lite has that the wheels need: python3 with venv, and libstdc++ (numpy, onnxruntime, torch)
PACKAGES=python3,python3-venv,libstdc++6
STAMP=$ROOTFS/.edgefl-qemu-root
if [ "$FRESH" -eq 1 ] || [ ! -f "$STAMP" ] || [ "$(head -n1 "$STAMP")" != "$SUITE $PACKAGES" ]; then
    step "arm64 root: mmdebstrap --variant=extract $SUITE ($PACKAGES and what they depend on)"
    rm -rf "$ROOTFS"
    # extract: unpack only (nothing arm64 runs); output/dev: no device nodes; chroot/mount: nothing is mounted
    mmdebstrap --quiet --variant=extract --architectures=arm64 --include="$PACKAGES" \
        --skip=output/dev,chroot/mount "$SUITE" "$ROOTFS" "$MIRROR"
    printf '%s\n' "$SUITE $PACKAGES" >"$STAMP"
else
    log "reusing the arm64 root in $ROOTFS (--fresh rebuilds it)"
fi
cat >"$EMULATED" <<EOF
#!/bin/sh
# Written by qemu-smoke.sh: this root's python3 under user-mode emulation of a $CPU, the emulator called
# explicitly (no binfmt_misc). -L: the root's loader and libraries. -0 "\$0": the path this script was started as
# (a venv's bin/python) becomes sys.executable, so the python's own subprocesses come back through this script.
# No core files: a wheel that dies of SIGILL would leave the emulator's core in the working directory.
ulimit -c 0
exec $QEMU -cpu $CPU -L $ROOTFS -0 "\$0" $ROOTFS/usr/bin/python3 "\$@"
EOF
chmod 0755 "$EMULATED"
# qemu 7.2 shows an emulated aarch64 program this machine's own /proc/cpuinfo (x86): the cpuinfo library inside
# onnxruntime and torch then finds no ARM core, and onnxruntime >= 1.31 dies at import with SIGSEGV (seen here).
# -L sends the emulated programs' reads of /proc/cpuinfo to ROOT/proc/cpuinfo instead: the emulated core (ARM's
# implementer and part number, the features the emulator's HWCAP reports), once per CPU this machine has, as its
# /sys/devices/system/cpu (which they read too) counts them.
mkdir -p "$ROOTFS/proc"
"$EMULATED" - "$(getconf _NPROCESSORS_CONF)" "${PART[$CPU]}" >"$ROOTFS/proc/cpuinfo" <<'PY'
import ctypes, sys
names = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 "
         "sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg").split()
hwcap = ctypes.CDLL(None).getauxval(16)  # AT_HWCAP
features = " ".join(name for bit, name in enumerate(names) if hwcap >> bit & 1)
for n in range(int(sys.argv[1])):
    print(f"processor\t: {n}\nBogoMIPS\t: 108.00\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"
          f"CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: {sys.argv[2]}\nCPU revision\t: 3\n")
PY
# The same for the kernel's MIDR_EL1 file, which oneDNN (inside torch) reads to choose its aarch64 kernels.
for ((n = 0; n < $(getconf _NPROCESSORS_CONF); n++)); do
    mkdir -p "$ROOTFS/sys/devices/system/cpu/cpu$n/regs/identification"
    printf '0x00000000410f%s3\n' "${PART[$CPU]#0x}" >"$ROOTFS/sys/devices/system/cpu/cpu$n/regs/identification/midr_el1"
done
log "emulated python: $EMULATED ($("$EMULATED" -c 'import platform; print(platform.machine(), platform.python_version())');" \
    "emulated CPU features: $(sed -n 's/^Features\t: //p' "$ROOTFS/proc/cpuinfo" | head -n1))"
[ "$MODE" != root ] || exit 0

# --- 1. every binary wheel imported on the emulated CPU, then one training step -----------------------------------
step "1. import every binary wheel of $BUNDLE on an emulated $CPU, then train one step of the TACO CNN"
PROBE=$WORKDIR/probe
rm -rf "$PROBE"
mkdir -p "$PROBE"
# Unpacked by this machine's pip (--target, no resolution: a bundle that edgefl's pins exclude is probed too). The
# other wheels are kept unpacked in WORKDIR/probe-wheels, keyed by their names and sizes, for re-runs (unpacking torch
# takes longer than a test of the probe may); edgefl's own wheel, rebuilt by every setup, is unpacked afresh.
unpack() {
    "$SERVER_PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --target "$1" \
        --only-binary=:all: --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
        --python-version 3.11 --implementation cp "${@:2}"
}
ours=() theirs=()
for whl in "$BUNDLE"/*.whl; do
    case "$(basename "$whl")" in edgefl_mqtt-*) ours+=("$whl") ;; *) theirs+=("$whl") ;; esac
done
KEY=$(for whl in "${theirs[@]}"; do printf '%s %s\n' "$(basename "$whl")" "$(stat -c %s "$whl")"; done)
WHEELS=$WORKDIR/probe-wheels
if [ "$FRESH" -eq 1 ] || [ ! -f "$WHEELS/.key" ] || [ "$(cat "$WHEELS/.key")" != "$KEY" ]; then
    rm -rf "$WHEELS"
    unpack "$WHEELS" "${theirs[@]}"
    printf '%s\n' "$KEY" >"$WHEELS/.key"
else
    log "reusing the unpacked wheels in $WHEELS (--fresh unpacks them again)"
fi
[ "${#ours[@]}" -eq 0 ] || unpack "$PROBE/site" "${ours[@]}"
# The binary wheels in dependency order (Requires-Dist), so a wheel is imported after the ones it loads and a SIGILL
# is blamed on the wheel that has it; then one training step through the bundle's edgefl.
"$SERVER_PY" - "$BUNDLE" >"$PROBE/modules.tsv" <<'PY'
import re, sys, zipfile
from pathlib import Path
wheels = {}
for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    if whl.name.endswith("-none-any.whl"):
        continue
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    tops = {n.split("/")[0] for n in names if "/" in n and not n.split("/")[0].endswith((".dist-info", ".data", ".libs"))}
    mods = [t for t in sorted(tops) if f"{t}/__init__.py" in names]  # packages; namespace ones: their packages
    mods += sorted({n.rsplit("/", 1)[0].replace("/", ".") for n in names
                    if n.count("/") == 2 and n.endswith("/__init__.py") and n.split("/")[0] in tops - set(mods)})
    requires = {re.split(r"[^A-Za-z0-9._-]", line.split(":", 1)[1].strip())[0].lower().replace("_", "-")
                for line in meta.splitlines() if line.startswith("Requires-Dist:")}
    wheels[whl.name.split("-")[0].lower().replace("_", "-")] = (whl.name, mods, requires)
done = []
while len(done) < len(wheels):  # dependencies first; a cycle would fall back to name order
    ready = [k for k in sorted(wheels) if k not in done and not (wheels[k][2] & (set(wheels) - set(done) - {k}))]
    done.append(ready[0] if ready else next(k for k in sorted(wheels) if k not in done))
for key in done:
    print(f"{wheels[key][0]}\t{' '.join(wheels[key][1])}")
PY
cat >"$PROBE/probe.py" <<'PY'
import importlib, sys
for line in open(sys.argv[1]):
    wheel, mods = line.rstrip("\n").split("\t")
    print(f"importing {wheel}: {mods}", flush=True)
    for mod in mods.split():
        importlib.import_module(mod)
    print(f"ok {wheel}", flush=True)
print("importing training: one step of the TACO CNN through the bundle's edgefl (train_local, FedAvg)", flush=True)
import numpy as np, torch
from edge_client.algorithms import client_algorithm
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.learning.models import build_model
from edge_client.wire.plan import Plan
from edge_client.loop.trainer import train_local
spec = {"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28}
rng = np.random.default_rng(0)
data = ArrayDataset(rng.random((64, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 64))
flat = FlatModel(build_model(spec))
plan = Plan(steps=1, lr=0.05, batch_size=64)
result = train_local(flat, flat.numpy().copy(), data, BatchSampler(64, 64, 0, "probe"), plan, client_algorithm("fedavg"))
norm = float(np.linalg.norm(result.delta))
assert np.isfinite(result.delta).all() and norm > 0, "the training step did not move the weights"
print(f"ok training: loss {result.train_loss:.4f}, update norm {norm:.4g} over {result.delta.size} parameters,"
      f" torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
try:  # the extra "secure" (make-wheel-bundle.sh --secure): X25519, HKDF, AES-GCM and ChaCha20 on this CPU
    import cryptography
except ImportError:
    print("no cryptography wheel in the bundle: no masked round (make-wheel-bundle.sh --secure adds it)", flush=True)
    sys.exit(0)
print("importing secure aggregation: one masked round of two devices in memory (edge_client.secagg)", flush=True)
from edge_client.secagg import crypto
from edge_client.secagg.device import DeviceRound
from edge_client.secagg.ring import Ring
ring, (a, b) = Ring(32, 10.0, 2), (DeviceRound(cid, "probe", 1) for cid in ("pi-a", "pi-b"))
(_, to_b), (_, to_a) = a.share({"pi-b": b.keys()}, 2), b.share({"pi-a": a.keys()}, 2)
a.receive({"pi-b": to_a["pi-a"]})
b.receive({"pi-a": to_b["pi-b"]})
qa, qb = ring.quantise(result.delta, 0.5), ring.quantise(-2 * result.delta, 0.5)
total = ring.add(a.masked(qa, ring), b.masked(qb, ring))
for d in (a, b):  # the self masks; the pairwise ones cancelled in the sum
    total = ring.sub(total, crypto.mask(d.seed, total.size))
assert (total == ring.add(qa, qb)).all() and not (a.masked(qa, ring) == qa).all(), "the masks did not cancel"
print(f"ok secure aggregation: cryptography {cryptography.__version__}, two masked inputs of {total.size} parameters"
      " unmask to their sum", flush=True)
PY
set +e
PYTHONPATH=$PROBE/site:$WHEELS "$EMULATED" "$PROBE/probe.py" "$PROBE/modules.tsv" >"$PROBE/probe.log" 2>&1
rc=$?
set -e
sed -n 's/^ok /  ok      /p' "$PROBE/probe.log"
if [ "$rc" -ne 0 ]; then
    culprit=$(sed -n 's/^importing //p' "$PROBE/probe.log" | tail -n1)
    if [ "$rc" -eq 132 ]; then
        echo "  SIGILL  $culprit"
        echo "$PROG: SIGILL in ${culprit%%:*}: it uses instructions an emulated $CPU does not have and would die the" \
            "same way on the device; rebuild the bundle with make-wheel-bundle.sh's pins" >&2
        exit 3
    fi
    tail -n 20 "$PROBE/probe.log" >&2
    echo "$PROG: error: ${culprit%%:*} failed (exit status $rc)" >&2
    exit 1
fi
echo "  every binary wheel imports and the TACO CNN trains on an emulated $CPU"
if [ "$SECURE" -eq 1 ] && ! grep -q '^ok secure aggregation' "$PROBE/probe.log"; then
    echo "$PROG: error: --secure: the probe ran no masked round (is cryptography in the bundle?)" >&2
    exit 1
fi
[ "$MODE" != probe ] || exit 0

# --- 2. the installer, with edge-client check under emulation ----------------------------------------------------
RUN=$WORKDIR/run
DEVICE=qemu-pi PEER=pi-02 JOB=qemu-smoke
VENV=$ROOTFS/opt/edgefl/venv
rm -rf "$RUN"
mkdir -p "$RUN"
pids=()
cleanup() { # only the processes this script started, by their ids
    local pid
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
fail() { echo "$PROG: FAILED: $*" >&2; exit 1; }
emulated() { # emulated LABEL CMD...: run a device command (emulated), its output shown and kept in run/LABEL.log
    local label=$1 t rc
    shift
    echo "+ $*"
    t=$(date +%s)
    set +e
    "$@" 2>&1 | tee "$RUN/$label.log"
    rc=${PIPESTATUS[0]}
    set -e
    echo "  ($label: exit status $rc after $(($(date +%s) - t)) s, emulated)"
    [ "$rc" -ne 132 ] || fail "$label died with SIGILL"
    [ "$rc" -eq 0 ] || fail "$label exited with status $rc"
}

step "2. broker (edge-server broker: per-device login, the edgefl ACL), the device's MNIST shard, the installer"
bash "$HERE/uninstall-edge-client.sh" --root "$ROOTFS" --purge >/dev/null 2>&1 # the previous run's install
"$SERVER_PY" -m server.cli broker --dir "$RUN/broker" --devices "$DEVICE,$PEER" >"$RUN/broker.log" 2>&1 &
pids+=($!)
deadline=$(($(date +%s) + 60))
until [ -s "$RUN/broker/credentials.json" ]; do # written once mosquitto accepts connections
    [ "$(date +%s)" -lt "$deadline" ] || { cat "$RUN/broker.log" >&2; fail "the broker did not start"; }
    kill -0 "${pids[0]}" 2>/dev/null || { cat "$RUN/broker.log" >&2; fail "edge-server broker exited"; }
    sleep 0.2 # poll interval
done
"$SERVER_PY" - "$RUN" "$DEVICE" "$PEER" <<'PY'
import json, os, sys
from pathlib import Path
run, device, peer = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
creds = json.loads((run / "broker" / "credentials.json").read_text())
for name, text in (("url", creds["url"]), ("server.pw", creds["server"]["password"]),
                   ("device.pw", creds["devices"][device]["password"]),
                   ("peer.pw", creds["devices"][peer]["password"])):
    fd = os.open(run / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, (text + "\n").encode())
    os.close(fd)
PY
URL=$(cat "$RUN/url")
echo "  mosquitto at $URL, logins edgefl-server and $DEVICE"
"$SERVER_PY" -m server.cli partition --dataset mnist --ids "$DEVICE,$PEER,pi-03,pi-04,pi-05,pi-06,pi-07,pi-08,pi-09,pi-10" \
    --out "$RUN/shards" 2>/dev/null | tail -n1
install -D -m 0644 "$RUN/shards/$DEVICE.npz" "$ROOTFS/var/lib/edgefl/$DEVICE.npz"
"$SERVER_PY" - "$RUN/samples.npz" <<'PY'
import sys
import numpy as np
from server.datasets import load_dataset
test = load_dataset("mnist").test
np.savez(sys.argv[1], x=test.x[:200], y=test.y[:200])
PY
emulated install bash "$HERE/install-edge-client.sh" --root "$ROOTFS" --python "$EMULATED" --wheels "$BUNDLE" \
    --broker "$URL" --client-id "$DEVICE" --password-file "$RUN/device.pw" --data "/var/lib/edgefl/$DEVICE.npz" \
    --job "$JOB" --threads 2 --no-start
if [ "$SECURE" -eq 1 ]; then # the extra from the bundle, into the installed venv
    emulated secure-extra "$VENV/bin/python" -m pip install --quiet --no-index --find-links "$BUNDLE" \
        --constraint "$BUNDLE/constraints.txt" "edgefl-mqtt[secure]"
fi
CLIENT_FLAGS=(--broker "$URL" --client-id "$DEVICE" --password-file "$ROOTFS/etc/edgefl/password" --job "$JOB")

# --- 3. a real server, the emulated client -------------------------------------------------------------------------
step "3. edge-server run (this machine) + edge-client run (emulated $CPU): $ROUNDS rounds of the TACO CNN"
cat >"$RUN/server.toml" <<EOF
[run]
rounds = $ROUNDS
target_accuracy = 0.9
out = "$RUN/server"
job = "$JOB"

[clients]
count = 1
register_timeout_s = 1800
round_deadline_s = 3600

[data]
dataset = "mnist"

[train]
algorithm = "fedavg"
local_steps = $STEPS
batch_size = 32
lr = 0.1

[model]
name = "cnn"
EOF
EDGEFL_PASSWORD=$(cat "$RUN/server.pw") "$SERVER_PY" -m server.cli run --config "$RUN/server.toml" --broker "$URL" \
    >"$RUN/server.out" 2>&1 &
server_pid=$!
pids+=("$server_pid")
emulated run "$VENV/bin/edge-client" run "${CLIENT_FLAGS[@]}" --data "$ROOTFS/var/lib/edgefl/$DEVICE.npz" \
    --threads 2 --state-dir "$RUN/state" --max-rounds "$ROUNDS"
set +e
wait "$server_pid"
rc=$?
set -e
[ "$rc" -eq 0 ] || { tail -n 30 "$RUN/server.out" >&2; fail "edge-server run exited with status $rc"; }
"$SERVER_PY" - "$RUN/server" "$DEVICE" "$ROUNDS" <<'PY' || fail "the server did not aggregate the device's updates"
import json, sys
from pathlib import Path
out, device, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
print(f"  {'round':>5}  {'accuracy':>8}  {'reported':>8}  {'compute s':>9}  {'peak RSS MiB':>12}  bytes up")
for row in rows:
    c = row["clients"].get(device, {})
    rss = ((c.get("device") or {}).get("round") or {}).get("peak_rss_mb")
    print(f"  {row['round']:>5}  {row['accuracy']:>8.4f}  {row['clients_reported']:>8}  {c.get('compute_s', 0):>9.1f}"
          f"  {rss if rss is not None else '-':>12}  {c.get('bytes_up')}")
ok = len(rows) >= rounds and all(r["clients_reported"] == 1 and device in r["clients"] for r in rows)
print(f"  the server aggregated {device}'s update in {sum(device in r['clients'] for r in rows)} of {len(rows)} rounds;"
      f" test accuracy {rows[-1]['accuracy']:.4f} after the last (chance: 0.1). Compute seconds: the emulator's.")
sys.exit(0 if ok and rows[-1]["accuracy"] > 0.5 else 1)
PY

# --- 4. the resulting model on the device ---------------------------------------------------------------------------
step "4. edge-client fetch-model + edge-client predict (onnxruntime, no torch) on 200 MNIST test samples"
emulated fetch "$VENV/bin/edge-client" fetch-model "${CLIENT_FLAGS[@]}" --out "$RUN/model.onnx" --timeout 120
emulated predict "$VENV/bin/edge-client" predict --model "$RUN/model.onnx" --input "$RUN/samples.npz" \
    --out "$RUN/predictions.npz" --latency 20
"$SERVER_PY" - "$RUN" <<'PY' || fail "the device's predictions do not match the model's"
import sys
from pathlib import Path
import numpy as np
from edge_client.learning.predictor import Predictor
run = Path(sys.argv[1])
with np.load(run / "samples.npz") as s, np.load(run / "predictions.npz") as p:
    x, y, device = s["x"], s["y"], p["predictions"]
here = Predictor(run / "model.onnx").predict(x)  # the same model, onnxruntime on this machine
agree = float(np.mean(device == here))
print(f"  device accuracy {np.mean(device == y):.3f} on {len(y)} test samples; agrees with this machine's onnxruntime"
      f" on {agree:.1%} of them")
sys.exit(0 if agree >= 0.99 else 1)
PY

# --- 5. and 6. ---------------------------------------------------------------------------------------------------------
step "5. edge-client benchmark (emulated: its seconds mean nothing)"
emulated benchmark "$VENV/bin/edge-client" benchmark --models cnn-mnist --algorithms fedavg,taco --steps 5 \
    --repeats 1 --threads 2
if [ "$FOOTPRINT" -eq 1 ]; then
    step "6. footprint under emulation: peak RSS (VmHWM) of the emulator process running each command"
    (cd "$REPO" && emulated footprint "$SERVER_PY" -m benchmarks.footprint --quick --client-python "$VENV/bin/python" \
        --out "$RUN/footprint")
fi
if [ "$SECURE" -eq 1 ]; then
    step "7. one masked round (secure aggregation): the emulated device and $PEER (this machine), threshold 2"
    sed -e 's/^rounds = .*/rounds = 1/' -e 's/^count = 1$/count = 2/' -e 's/^local_steps = .*/local_steps = 5/' \
        -e "s|^out = .*|out = \"$RUN/secure\"|" "$RUN/server.toml" >"$RUN/secure.toml"
    printf '\n[privacy]\nsecure_aggregation = true\nclip_norm = 10.0\nthreshold = 2\nstage_deadline_s = 600.0\n' \
        >>"$RUN/secure.toml"
    EDGEFL_PASSWORD=$(cat "$RUN/server.pw") "$SERVER_PY" -m server.cli run --config "$RUN/secure.toml" \
        --broker "$URL" >"$RUN/secure.out" 2>&1 &
    server_pid=$!
    pids+=("$server_pid")
    "$SERVER_PY" -m edge_client.cli run --broker "$URL" --client-id "$PEER" --password-file "$RUN/peer.pw" \
        --job "$JOB" --data "$RUN/shards/$PEER.npz" --threads 1 --state-dir "$RUN/peer-state" --max-rounds 1 \
        >"$RUN/peer.log" 2>&1 &
    peer_pid=$!
    pids+=("$peer_pid")
    emulated secure "$VENV/bin/edge-client" run "${CLIENT_FLAGS[@]}" --data "$ROOTFS/var/lib/edgefl/$DEVICE.npz" \
        --threads 2 --state-dir "$RUN/secure-state" --max-rounds 1
    set +e
    wait "$server_pid"
    rc=$?
    set -e
    [ "$rc" -eq 0 ] || { tail -n 30 "$RUN/secure.out" >&2; fail "edge-server run (secure) exited with status $rc"; }
    "$SERVER_PY" - "$RUN/secure" "$DEVICE" <<'PY' || fail "the round was not aggregated securely with the device"
import json, sys
from pathlib import Path
out, device = Path(sys.argv[1]), sys.argv[2]
[row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
summary = json.loads((out / "summary.json").read_text())
secure, costs = row.get("secure", {}), row["clients"].get(device, {}).get("device", {}).get("secagg", {})
print(f"  secure_rounds {summary.get('secure_rounds')}, masked inputs {secure.get('masked')}, threshold"
      f" {secure.get('threshold')}, the device's own seconds (emulated): "
      + ", ".join(f"{k} {v:.3f}" for k, v in sorted(costs.items())))
sys.exit(0 if summary.get("secure_rounds") == 1 and secure.get("masked") == 2 and "dropped" not in row else 1)
PY
fi
step "OK: the bundle installs, trains against a real server and serves predictions on an emulated $CPU" \
    "($(date -u '+%Y-%m-%d %H:%M UTC'), $(($(date +%s) - T0)) s in all)"
