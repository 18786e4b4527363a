#!/usr/bin/env bash
# Install the edgefl device runtime as a systemd service on Raspberry Pi OS / Debian bookworm (aarch64; x86_64 for
# testing). Safe to run again: the configuration, password and device identity are written once and kept; the
# virtual environment is updated; the unit file is regenerated. See firmware_scripts/README.md.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROG=$(basename "$0")

usage() {
    cat <<EOF
Usage: $PROG [options]

Installs edgefl into a virtual environment, creates the system user, /etc/edgefl/ (never overwritten), a device
identity (written once), and the systemd unit edgefl-client.service.

Package source (one of):
  --wheels DIR         offline install from a wheel bundle (make-wheel-bundle.sh): pip --no-index --find-links DIR
  --package SPEC       pip requirement or path to install (default: with --wheels edgefl-mqtt, looked up in DIR;
                       else the source tree this script is in)
  --skip-pip           create the venv but install nothing into it (staging tests)
  --no-deps            install the package without its dependencies (tests; dependencies come from elsewhere)
  --python PY          interpreter for the venv (default: python3)

Device configuration (used only when /etc/edgefl/edge-client.env does not exist yet):
  --broker URL         e.g. mqtts://broker.lan:8883 (default: mqtts://edgefl-broker.local:8883)
  --client-id ID       device identity (default: derived once from /etc/machine-id, else random)
  --data PATH          training data on the device (default: /var/lib/edgefl/data.npz)
  --ca-file FILE       CA certificate of the broker, copied to /etc/edgefl/ca.crt if that does not exist
  --password-file FILE broker password, copied to /etc/edgefl/password if that is missing or empty ("-": stdin)
  --job NAME           job name (default: default)
  --threads N          torch threads (default: 3, leaving one core of a Pi 4 for the system)
  --cpu-quota PCT      systemd CPUQuota= (default: 300%, i.e. three cores)

Layout:
  --root DIR           staged install into DIR (image building, tests): no systemctl, users written into
                       DIR/etc/passwd and DIR/etc/group with useradd --prefix
  --prefix DIR         installation directory, as seen on the device (default: /opt/edgefl)
  --user NAME          service user (default: edgefl)
  --arch ARCH          override uname -m (tests)
  --no-start           do not enable or start the service
  --no-check           do not run edge-client check at the end (it needs the broker, the password and the data)
  -h, --help           this text

At the end it runs edge-client check with the device's settings (on the device, as the service user) and starts
the service only when the check passes. Exit status: 0 installed and ready (or --no-check / --skip-pip),
1 installed but the check failed (its FAIL lines say what to fix), 2 bad arguments or a failed step.
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }

ROOT="" PREFIX=/opt/edgefl SVC_USER=edgefl PYTHON=python3 WHEELS="" PACKAGE="" SKIP_PIP=0 NO_DEPS=0
BROKER="mqtts://edgefl-broker.local:8883" CLIENT_ID="" DATA=/var/lib/edgefl/data.npz CA_SRC="" PW_SRC=""
JOB=default THREADS=3 CPU_QUOTA=300% ARCH="" START=1 CHECK=1

need_arg() { if [ "$#" -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi; }
while [ "$#" -gt 0 ]; do
    case "$1" in
        --root) need_arg "$@"; ROOT=$2; shift 2 ;;
        --prefix) need_arg "$@"; PREFIX=$2; shift 2 ;;
        --user) need_arg "$@"; SVC_USER=$2; shift 2 ;;
        --python) need_arg "$@"; PYTHON=$2; shift 2 ;;
        --wheels) need_arg "$@"; WHEELS=$2; shift 2 ;;
        --package) need_arg "$@"; PACKAGE=$2; shift 2 ;;
        --skip-pip) SKIP_PIP=1; shift ;;
        --no-deps) NO_DEPS=1; shift ;;
        --broker) need_arg "$@"; BROKER=$2; shift 2 ;;
        --client-id) need_arg "$@"; CLIENT_ID=$2; shift 2 ;;
        --data) need_arg "$@"; DATA=$2; shift 2 ;;
        --ca-file) need_arg "$@"; CA_SRC=$2; shift 2 ;;
        --password-file) need_arg "$@"; PW_SRC=$2; shift 2 ;;
        --job) need_arg "$@"; JOB=$2; shift 2 ;;
        --threads) need_arg "$@"; THREADS=$2; shift 2 ;;
        --cpu-quota) need_arg "$@"; CPU_QUOTA=$2; shift 2 ;;
        --arch) need_arg "$@"; ARCH=$2; shift 2 ;;
        --no-start) START=0; shift ;;
        --no-check) CHECK=0; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done

# --- checks ---------------------------------------------------------------------------------------------------
ARCH=${ARCH:-$(uname -m)}
case "$ARCH" in
    aarch64 | arm64 | x86_64 | amd64) ;;
    armv7* | armv6* | armhf | armel | arm)
        die "32-bit ARM ($ARCH) is not supported: there are no torch or onnxruntime wheels for it (PyPI, piwheels and \
Debian armhf have none). Install the 64-bit Raspberry Pi OS (aarch64) on a Pi 3, 4, 5 or Zero 2 W." ;;
    *) die "unsupported architecture $ARCH (supported: aarch64; x86_64 for testing)" ;;
esac
id_re='^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$'   # edge_client.wire.topics.CLIENT_ID_RE
[[ $JOB =~ $id_re ]] || die "invalid --job '$JOB' (letters, digits, _ . -; at most 64)"
[[ $SVC_USER =~ ^[a-z_][a-z0-9_-]{0,30}$ ]] || die "invalid --user '$SVC_USER'"
[[ $THREADS =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer, got '$THREADS'"
[[ $CPU_QUOTA =~ ^[1-9][0-9]*%$ ]] || die "--cpu-quota must look like 300%, got '$CPU_QUOTA'"
# Every value that ends up in a rendered file is checked against a strict pattern first (nothing is written before):
# a host name, an IPv4 address or a bracketed IPv6 address, and a port 1-65535.
host_re='([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])'
broker_re="^mqtts?://${host_re}(:([0-9]{1,5}))?\$"
port=0
[[ $BROKER =~ $broker_re ]] && port=${BASH_REMATCH[6]:-1883}
if ((10#$port < 1 || 10#$port > 65535)); then
    die "--broker must be mqtt://HOST:PORT or mqtts://HOST:PORT (a host name or address, a port 1-65535), got '$BROKER'"
fi
path_re='^/[A-Za-z0-9._/-]*$'
[[ $PREFIX =~ $path_re ]] || die "--prefix must be an absolute path of letters, digits, _ . - and /, got '$PREFIX'"
[[ $DATA =~ $path_re ]] || die "--data must be an absolute path of letters, digits, _ . - and /, got '$DATA'"
if [ -n "$CLIENT_ID" ] && ! [[ $CLIENT_ID =~ $id_re ]]; then
    die "invalid --client-id '$CLIENT_ID' (1-64 of letters, digits, _ . -; starting with a letter or digit)"
fi
if [ -n "$ROOT" ]; then
    [ -d "$ROOT" ] || die "--root $ROOT is not a directory"
    ROOT=$(cd "$ROOT" && pwd)
    [ "$ROOT" != / ] || ROOT=""
fi
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || die "--wheels $WHEELS is not a directory"
[ -z "$CA_SRC" ] || [ -f "$CA_SRC" ] || die "--ca-file $CA_SRC does not exist"
[ -z "$PW_SRC" ] || [ "$PW_SRC" = - ] || [ -f "$PW_SRC" ] || die "--password-file $PW_SRC does not exist"
IS_ROOT=0
[ "$(id -u)" -eq 0 ] && IS_ROOT=1
if [ -z "$ROOT" ] && [ "$IS_ROOT" -eq 0 ]; then
    die "run as root (or stage with --root DIR)"
fi
if [ -r "$ROOT/etc/os-release" ]; then
    # shellcheck disable=SC1091
    codename=$(. "$ROOT/etc/os-release" && echo "${VERSION_CODENAME:-}")
    [ "$codename" = bookworm ] || log "warning: tested on Debian/Raspberry Pi OS bookworm, this is '${codename:-unknown}'"
fi

CONFDIR=/etc/edgefl
UNIT=edgefl-client.service
R_CONF=$ROOT$CONFDIR
R_PREFIX=$ROOT$PREFIX
R_STATE=$ROOT/var/lib/edgefl

# --- system user ------------------------------------------------------------------------------------------------
user_exists() {
    if [ -n "$ROOT" ]; then grep -q "^$1:" "$ROOT/etc/passwd" 2>/dev/null; else getent passwd "$1" >/dev/null; fi
}
group_exists() {
    if [ -n "$ROOT" ]; then grep -q "^$1:" "$ROOT/etc/group" 2>/dev/null; else getent group "$1" >/dev/null; fi
}
nologin=/usr/sbin/nologin
[ -x "$ROOT$nologin" ] || [ -n "$ROOT" ] || nologin=/bin/false
prefix_args=()
if [ -n "$ROOT" ]; then
    mkdir -p "$ROOT/etc"
    # a bare staging root gets the minimal files useradd needs; an image's own files are kept
    [ -e "$ROOT/etc/passwd" ] || printf 'root:x:0:0:root:/root:/bin/sh\n' >"$ROOT/etc/passwd"
    [ -e "$ROOT/etc/group" ] || printf 'root:x:0:\n' >"$ROOT/etc/group"
    prefix_args=(--prefix "$ROOT")
fi
if ! user_exists "$SVC_USER"; then
    log "creating system user $SVC_USER"
    useradd "${prefix_args[@]}" --system --user-group --home-dir /var/lib/edgefl --no-create-home \
        --shell "$nologin" --comment "edgefl device runtime" "$SVC_USER"
fi
# /dev/vcio (vcgencmd: throttling flags) is root:video 0660 on Raspberry Pi OS
if group_exists video; then
    usermod "${prefix_args[@]}" -a -G video "$SVC_USER" # idempotent: an existing member is not added twice
fi
lookup_id() { # lookup_id passwd|group NAME -> numeric id inside the (staged) system
    if [ -n "$ROOT" ]; then awk -F: -v n="$2" '$1 == n { print $3 }' "$ROOT/etc/$1"; else getent "$1" "$2" | cut -d: -f3; fi
}
SVC_UID=$(lookup_id passwd "$SVC_USER")
SVC_GID=$(lookup_id group "$SVC_USER")
if [ -z "$SVC_UID" ] || [ -z "$SVC_GID" ]; then die "could not resolve user/group $SVC_USER"; fi
own() { # own OWNER:GROUP(numeric) MODE PATH...
    local owner=$1 mode=$2
    shift 2
    chmod "$mode" "$@"
    if [ "$IS_ROOT" -eq 1 ]; then chown "$owner" "$@"; fi
}

# --- directories, identity, configuration -----------------------------------------------------------------------
install -d -m 0755 "$R_PREFIX" "$ROOT/etc/systemd/system"
mkdir -p "$R_CONF" "$R_STATE"
own "0:$SVC_GID" 0750 "$R_CONF"
own "$SVC_UID:$SVC_GID" 0750 "$R_STATE"

render() { # render TEMPLATE: substitute @KEY@ placeholders, each value escaped for sed's replacement text
    local expr=() pair value
    for pair in "PREFIX=$PREFIX" "USER=$SVC_USER" "CONFDIR=$CONFDIR" "CPU_QUOTA=$CPU_QUOTA" "BROKER=$BROKER" \
        "CLIENT_ID=$DEVICE_ID" "DATA=$DATA" "CA_FILE=$CA_FILE" "JOB=$JOB" "THREADS=$THREADS"; do
        value=$(printf '%s' "${pair#*=}" | sed -e 's/[\\&|]/\\&/g')
        expr+=(-e "s|@${pair%%=*}@|$value|g")
    done
    sed "${expr[@]}" "$1"
}
write_new() { # write_new PATH MODE OWNER < content: atomically, only if PATH does not exist
    local path=$1 tmp
    tmp=$(mktemp "$path.XXXXXX")
    cat >"$tmp"
    own "$3" "$2" "$tmp"
    mv -f "$tmp" "$path"
}

# Device identity: written once, kept forever (it is the broker username and the id the server knows).
if [ -s "$R_CONF/device-id" ]; then
    DEVICE_ID=$(head -n1 "$R_CONF/device-id")
    if [ -n "$CLIENT_ID" ] && [ "$CLIENT_ID" != "$DEVICE_ID" ]; then
        log "warning: keeping the existing device id $DEVICE_ID (--client-id $CLIENT_ID ignored; delete $CONFDIR/device-id to change it)"
    fi
else
    if [ -n "$CLIENT_ID" ]; then
        DEVICE_ID=$CLIENT_ID
    elif [ -s "$ROOT/etc/machine-id" ]; then
        # a hash, not the machine id itself (machine-id(5): do not expose it on the network)
        DEVICE_ID=pi-$(printf 'edgefl:%s' "$(head -n1 "$ROOT/etc/machine-id")" | sha256sum | cut -c1-12)
    else
        DEVICE_ID=pi-$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')
    fi
    printf '%s\n' "$DEVICE_ID" | write_new "$R_CONF/device-id" 0644 0:0
    log "device identity: $DEVICE_ID"
fi
[[ $DEVICE_ID =~ $id_re ]] || die "$CONFDIR/device-id holds an invalid id '$DEVICE_ID'"

CA_FILE=/etc/ssl/certs/ca-certificates.crt
if [ -n "$CA_SRC" ]; then
    CA_FILE=$CONFDIR/ca.crt
    [ -e "$R_CONF/ca.crt" ] || write_new "$R_CONF/ca.crt" 0644 0:0 <"$CA_SRC"
fi
if [ -s "$R_CONF/edge-client.env" ]; then
    log "keeping existing $CONFDIR/edge-client.env"
else # rendered whole before anything is written: a failed render leaves no file (an empty one is written again)
    env_text=$(render "$HERE/edge-client.env.in")
    printf '%s\n' "$env_text" | write_new "$R_CONF/edge-client.env" 0640 "0:$SVC_GID"
fi
if [ -n "$PW_SRC" ] && [ ! -s "$R_CONF/password" ]; then
    if [ "$PW_SRC" = - ]; then head -n1 | write_new "$R_CONF/password" 0640 "0:$SVC_GID"; else
        head -n1 "$PW_SRC" | write_new "$R_CONF/password" 0640 "0:$SVC_GID"
    fi
elif [ ! -e "$R_CONF/password" ]; then
    write_new "$R_CONF/password" 0640 "0:$SVC_GID" </dev/null
fi
own "0:$SVC_GID" 0640 "$R_CONF/password" "$R_CONF/edge-client.env"

# --- virtual environment ------------------------------------------------------------------------------------------
VENV=$R_PREFIX/venv
if [ ! -x "$VENV/bin/python" ]; then
    command -v "$PYTHON" >/dev/null || die "python interpreter '$PYTHON' not found (use --python)"
    venv_args=()
    [ "$SKIP_PIP" -eq 1 ] && venv_args=(--without-pip)
    if [ "$SKIP_PIP" -eq 0 ] && ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
        if [ -z "$ROOT" ] && command -v apt-get >/dev/null; then
            log "installing python3-venv"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        else
            die "$PYTHON cannot create virtual environments: apt-get install python3-venv"
        fi
    fi
    log "creating $PREFIX/venv"
    "$PYTHON" -m venv "${venv_args[@]}" "$VENV"
fi
if [ "$SKIP_PIP" -eq 0 ]; then
    pip_args=(install --quiet --disable-pip-version-check --upgrade --upgrade-strategy only-if-needed)
    [ "$NO_DEPS" -eq 1 ] && pip_args+=(--no-deps)
    if [ -n "$WHEELS" ]; then
        pip_args+=(--no-index --find-links "$WHEELS")
        [ -f "$WHEELS/constraints.txt" ] && pip_args+=(--constraint "$WHEELS/constraints.txt")
    fi
    # "edgefl" on the public package index is another project: never install a bare name from there
    if [ -z "$PACKAGE" ] && [ -n "$WHEELS" ]; then
        PACKAGE=edgefl-mqtt
    elif [ -z "$PACKAGE" ]; then
        PACKAGE=$(dirname "$HERE")
        [ -f "$PACKAGE/pyproject.toml" ] || die "no edgefl source tree at $PACKAGE: give --wheels DIR or --package SPEC"
    fi
    log "installing $PACKAGE into $PREFIX/venv"
    PIP_NO_CACHE_DIR=1 "$VENV/bin/python" -m pip "${pip_args[@]}" "$PACKAGE"
fi
[ ! -f "$HERE/README.md" ] || install -m 0644 "$HERE/README.md" "$R_PREFIX/README.md"

# --- systemd unit -----------------------------------------------------------------------------------------------
render "$HERE/edgefl-client.service.in" >"$ROOT/etc/systemd/system/$UNIT.tmp"
chmod 0644 "$ROOT/etc/systemd/system/$UNIT.tmp"
mv -f "$ROOT/etc/systemd/system/$UNIT.tmp" "$ROOT/etc/systemd/system/$UNIT"

# --- readiness: edge-client check with the settings the service will use (the kept config file wins) -----------
READY=1
if [ "$SKIP_PIP" -eq 0 ] && [ "$CHECK" -eq 1 ]; then
    env_value() { sed -n "s/^$1=//p" "$R_CONF/edge-client.env" | tail -n1; }
    check_broker=$(env_value EDGEFL_BROKER)
    check_args=(check --broker "$check_broker" --client-id "$DEVICE_ID" --job "$(env_value EDGEFL_JOB)"
        --password-file "$R_CONF/password" --data "$ROOT$(env_value EDGEFL_DATA)")
    [[ $check_broker != mqtts://* ]] || check_args+=(--ca-file "$ROOT$(env_value EDGEFL_CA_FILE)")
    as_service=() # on the device itself the check runs as the service user: its file permissions count too
    if [ -z "$ROOT" ] && [ "$IS_ROOT" -eq 1 ] && command -v runuser >/dev/null; then
        as_service=(runuser -u "$SVC_USER" --)
    fi
    log "edge-client check: broker login, ACL, data, torch and onnxruntime on this CPU (--no-check skips it)"
    "${as_service[@]}" "$VENV/bin/edge-client" "${check_args[@]}" >&2 || READY=0
fi

if [ -n "$ROOT" ]; then
    log "staged into $ROOT (systemd untouched)"
elif [ ! -d /run/systemd/system ]; then
    log "systemd is not running here: not enabling $UNIT"
elif [ "$START" -eq 1 ]; then
    systemctl daemon-reload
    systemctl enable "$UNIT" >/dev/null
    if [ "$READY" -eq 1 ] && [ -s "$R_CONF/password" ] && [ -e "$DATA" ]; then
        systemctl restart "$UNIT"
        log "$UNIT (re)started; logs: journalctl -u $UNIT -f"
    else
        if [ "$READY" -eq 0 ]; then
            log "$UNIT enabled, not started: fix what edge-client check reports, check again, then systemctl start $UNIT"
        else
            log "$UNIT enabled; put the password in $CONFDIR/password and data at $DATA, then systemctl start $UNIT"
        fi
    fi
else
    systemctl daemon-reload
fi
if [ "$READY" -eq 0 ]; then
    echo "$PROG: device $DEVICE_ID is installed but NOT READY: fix what edge-client check reports above" >&2
    exit 1
fi
log "done: device $DEVICE_ID, config $CONFDIR/edge-client.env"
