#!/usr/bin/env bash
# Build an offline wheel bundle of edgefl and its dependencies for aarch64 (Raspberry Pi OS bookworm, CPython 3.11)
# on any machine, e.g. an x86 laptop. install-edge-client.sh --wheels DIR installs from it without network.
#
# Why two steps: pip evaluates environment markers (platform_machine) for the machine it runs on even with
# --platform, so on x86 it picks edgefl's x86 torch requirement and resolves to a torch whose aarch64 wheel is a
# CUDA build that drags in GBs of NVIDIA packages (RESEARCH.md section 3). So the dependency set is first resolved
# FOR THE TARGET (uv pip compile --python-platform aarch64-manylinux_2_28, explicit Raspberry Pi pins), then pip
# downloads exactly that pinned list for the aarch64 platform tags, and the bundle is checked.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROG=$(basename "$0")
die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }

usage() {
    cat <<EOF
Usage: $PROG [options]
  --out DIR             bundle directory (default: ./wheels-aarch64)
  --project DIR         edgefl source tree whose wheel goes into the bundle (default: $(dirname "$HERE"))
  --python PY           interpreter whose pip builds and downloads (default: python3)
  --python-version V    target CPython version (default: 3.11, Raspberry Pi OS bookworm)
  --torch SPEC          default torch==2.9.1 (2.10 dies with SIGILL on a Pi 4; >= 2.11 on aarch64 is a CUDA build)
  --onnxruntime SPEC    default onnxruntime>=1.21.1 (1.21.0 dies with SIGILL on a Pi 4)
  --numpy SPEC          default numpy<2.5 (2.5 needs Python 3.12)
  --resolver uv|pip     uv (default): resolve for aarch64 markers, then pip download --no-deps the lock;
                        pip: pip download with the explicit pins only (markers evaluated for THIS machine)
  --uv PATH             uv binary (default: uv on PATH, else pip-installed into a temporary venv)
  --secure              include the device package's extra "secure" (secure aggregation: the cryptography wheel for
                        aarch64 and what it needs); install it with install-edge-client.sh --package
                        'edgefl-mqtt[secure]'
  --known-bad           accept torch 2.10 and onnxruntime 1.21.0, which die with SIGILL on a Pi 4, overriding
                        edgefl's own pins (uv --override): only to build the negative control of qemu-smoke.sh,
                        which must fail on such a bundle, naming the wheel. install-edge-client.sh refuses it.
  --dry-run             print the commands, run nothing
  -h, --help            this text
The bundle holds the wheels, requirements.lock (what was resolved) and constraints.txt (used by the installer).
EOF
}

OUT=wheels-aarch64 PROJECT=$(dirname "$HERE") PY=python3 PYVER=3.11 RESOLVER=uv UV="" DRY=0 KNOWN_BAD=0 EXTRAS=""
TORCH="torch==2.9.1" ORT="onnxruntime>=1.21.1" NUMPY="numpy<2.5"
need_arg() { if [ "$#" -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi; }
while [ "$#" -gt 0 ]; do
    case "$1" in
        --out) need_arg "$@"; OUT=$2; shift 2 ;;
        --project) need_arg "$@"; PROJECT=$2; shift 2 ;;
        --python) need_arg "$@"; PY=$2; shift 2 ;;
        --python-version) need_arg "$@"; PYVER=$2; shift 2 ;;
        --torch) need_arg "$@"; TORCH=$2; shift 2 ;;
        --onnxruntime) need_arg "$@"; ORT=$2; shift 2 ;;
        --numpy) need_arg "$@"; NUMPY=$2; shift 2 ;;
        --resolver) need_arg "$@"; RESOLVER=$2; shift 2 ;;
        --uv) need_arg "$@"; UV=$2; shift 2 ;;
        --known-bad) KNOWN_BAD=1; shift ;;
        --secure) EXTRAS="[secure]"; shift ;;
        --dry-run) DRY=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done
[[ $PYVER =~ ^3\.[0-9]+$ ]] || die "--python-version must look like 3.11"
[[ $TORCH == torch* ]] || die "--torch must be a torch requirement, got '$TORCH'"
[[ $ORT == onnxruntime* ]] || die "--onnxruntime must be an onnxruntime requirement, got '$ORT'"
[[ $NUMPY == numpy* ]] || die "--numpy must be a numpy requirement, got '$NUMPY'"
if [[ $TORCH =~ ^torch[[:space:]]*==[[:space:]]*2\.([0-9]+) ]]; then
    minor=${BASH_REMATCH[1]}
    if [ "$minor" -ge 11 ] || { [ "$minor" -eq 10 ] && [ "$KNOWN_BAD" -eq 0 ]; }; then
        die "$TORCH: torch 2.10 dies with SIGILL on a Raspberry Pi 4 and >= 2.11 on aarch64 is a CUDA build"
    fi
fi
[ "$ORT" != "onnxruntime==1.21.0" ] || [ "$KNOWN_BAD" -eq 1 ] ||
    die "onnxruntime 1.21.0 dies with SIGILL on a Raspberry Pi 4"
case "$RESOLVER" in uv | pip) ;; *) die "--resolver must be uv or pip" ;; esac
[ "$KNOWN_BAD" -eq 0 ] || [ "$RESOLVER" = uv ] || die "--known-bad needs --resolver uv (it overrides edgefl's pins)"
[ -f "$PROJECT/pyproject.toml" ] || die "--project $PROJECT has no pyproject.toml"
CPTAG=cp${PYVER/./}
PLATFORM_ARGS=(--platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux_2_28_aarch64)
PIN_ARGS=(--only-binary=:all: "${PLATFORM_ARGS[@]}" --python-version "$PYVER" --implementation cp
    --abi "$CPTAG" --abi abi3 --abi none)

run() { # print, then run unless --dry-run
    printf '+' >&2
    printf ' %q' "$@" >&2
    printf '\n' >&2
    [ "$DRY" -eq 1 ] || "$@"
}

if [ "$DRY" -eq 0 ]; then
    mkdir -p "$OUT"
    OUT=$(cd "$OUT" && pwd)
fi

# 1. the project's own wheel (pure Python); a reused bundle drops the ones of earlier builds (and of the name before
#    edgefl-mqtt), which an install of every wheel in the bundle would otherwise mix with this one
if [ "$DRY" -eq 0 ]; then
    find "$OUT" -maxdepth 1 \( -name 'edgefl_mqtt-*.whl' -o -name 'edgefl-*.whl' \) -delete
fi
run "$PY" -m pip wheel --quiet --no-deps "$PROJECT" -w "$OUT"
if [ "$DRY" -eq 1 ]; then
    WHEEL="$OUT/edgefl_mqtt-VERSION-py3-none-any.whl"
else
    WHEEL=$(find "$OUT" -maxdepth 1 -name 'edgefl_mqtt-*.whl' -printf '%T@ %p\n' | sort -rn | head -n1 | cut -d' ' -f2-)
    [ -n "$WHEEL" ] || die "no edgefl wheel was built in $OUT"
fi

# 2. resolve for the target
if [ "$RESOLVER" = uv ]; then
    if [ -z "$UV" ]; then
        if command -v uv >/dev/null; then
            UV=$(command -v uv)
        else
            tmp_venv=/tmp/edgefl-uv.DRYRUN
            if [ "$DRY" -eq 0 ]; then
                tmp_venv=$(mktemp -d)
                trap 'rm -rf "$tmp_venv"' EXIT
            fi
            run "$PY" -m venv "$tmp_venv"
            run "$tmp_venv/bin/python" -m pip install --quiet uv
            UV=$tmp_venv/bin/uv
        fi
    fi
    if [ "$DRY" -eq 0 ]; then
        printf '%s\n' "$TORCH" "$ORT" "$NUMPY" "edgefl-mqtt$EXTRAS @ file://$WHEEL" >"$OUT/requirements.in"
    else
        log "would write $OUT/requirements.in: $TORCH, $ORT, $NUMPY, edgefl-mqtt$EXTRAS @ file://$WHEEL"
    fi
    overrides=()
    if [ "$KNOWN_BAD" -eq 1 ]; then # edgefl's metadata excludes these pins: override it for the negative control
        [ "$DRY" -eq 1 ] || printf '%s\n' "$TORCH" "$ORT" >"$OUT/overrides.txt"
        overrides=(--override "$OUT/overrides.txt")
    fi
    run "$UV" pip compile --quiet --no-header --no-annotate --python-platform aarch64-manylinux_2_28 \
        --python-version "$PYVER" --only-binary :all: "${overrides[@]}" -o "$OUT/requirements.lock" \
        "$OUT/requirements.in"
    if [ "$DRY" -eq 0 ]; then
        grep -v '^edgefl' "$OUT/requirements.lock" | grep -v '^[[:space:]]*#' | sed '/^$/d' >"$OUT/constraints.txt"
    fi
    # 3. download exactly the resolved list for aarch64
    run "$PY" -m pip download --quiet --no-deps "${PIN_ARGS[@]}" -d "$OUT" -r "$OUT/constraints.txt"
else
    if [ "$DRY" -eq 0 ]; then printf '%s\n' "$TORCH" "$ORT" "$NUMPY" >"$OUT/constraints.txt"; fi
    run "$PY" -m pip download --quiet "${PIN_ARGS[@]}" -d "$OUT" -c "$OUT/constraints.txt" \
        "$TORCH" "$ORT" "$NUMPY" "$WHEEL$EXTRAS"
fi

# 4. check the bundle
if [ "$DRY" -eq 0 ]; then
    sigill=(-name 'torch-2.10.*' -o -name 'onnxruntime-1.21.0-*')
    [ "$KNOWN_BAD" -eq 0 ] || sigill=(-name '')
    bad=$(find "$OUT" -maxdepth 1 \( -name 'nvidia_*' -o -name 'triton-*' -o -name 'torch-2.1[1-9]*' \
        -o "${sigill[@]}" \) -printf '%f\n')
    [ -z "$bad" ] || die "the bundle holds wheels that would not run on a Raspberry Pi 4: $bad"
    find "$OUT" -maxdepth 1 -name 'torch-*aarch64*.whl' | grep -q . || die "no aarch64 torch wheel in $OUT"
    [ -z "$EXTRAS" ] || find "$OUT" -maxdepth 1 -name 'cryptography-*aarch64*.whl' | grep -q . ||
        die "--secure: no aarch64 cryptography wheel in $OUT"
    log "bundle ready: $OUT ($(find "$OUT" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$OUT" | cut -f1))"
    log "install on a device: install-edge-client.sh --wheels $OUT"
fi
