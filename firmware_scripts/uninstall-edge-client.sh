#!/usr/bin/env bash
# Remove what install-edge-client.sh installed. Keeps /etc/edgefl (configuration, password, device identity),
# /var/lib/edgefl and the system user unless --purge is given. Safe to run twice.
set -euo pipefail

PROG=$(basename "$0")
die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }
usage() {
    cat <<EOF2
Usage: $PROG [--root DIR] [--prefix /opt/edgefl] [--user edgefl] [--purge]
  --root DIR    staged tree made with install-edge-client.sh --root (systemctl is never called then)
  --prefix DIR  installation directory (default: /opt/edgefl)
  --user NAME   service user (default: edgefl)
  --purge       also remove /etc/edgefl (including the device identity!), /var/lib/edgefl, /var/cache/edgefl and
                the user
EOF2
}

ROOT="" PREFIX=/opt/edgefl SVC_USER=edgefl PURGE=0
while [ "$#" -gt 0 ]; do
    case "$1" in
        --root) [ "$#" -ge 2 ] || die "--root needs a value"; ROOT=$2; shift 2 ;;
        --prefix) [ "$#" -ge 2 ] || die "--prefix needs a value"; PREFIX=$2; shift 2 ;;
        --user) [ "$#" -ge 2 ] || die "--user needs a value"; SVC_USER=$2; shift 2 ;;
        --purge) PURGE=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done
[[ $PREFIX == /?* ]] || die "--prefix must be an absolute path other than /"
if [ -n "$ROOT" ]; then
    [ -d "$ROOT" ] || die "--root $ROOT is not a directory"
    ROOT=$(cd "$ROOT" && pwd)
    [ "$ROOT" != / ] || ROOT=""
fi
[ -n "$ROOT" ] || [ "$(id -u)" -eq 0 ] || die "run as root (or give --root DIR)"

UNIT=edgefl-client.service
if [ -z "$ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl disable --now "$UNIT" >/dev/null 2>&1 || true
fi
rm -f "$ROOT/etc/systemd/system/$UNIT"
rm -rf "${ROOT:?}$PREFIX"
if [ -z "$ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    systemctl reset-failed "$UNIT" >/dev/null 2>&1 || true
fi
if [ "$PURGE" -eq 1 ]; then
    rm -rf "$ROOT/etc/edgefl" "$ROOT/var/lib/edgefl" "$ROOT/var/cache/edgefl"
    prefix_args=()
    [ -z "$ROOT" ] || prefix_args=(--prefix "$ROOT")
    if [ -n "$ROOT" ]; then
        exists=$(grep -c "^$SVC_USER:" "$ROOT/etc/passwd" 2>/dev/null || true)
    else
        exists=$(getent passwd "$SVC_USER" | wc -l)
    fi
    if [ "${exists:-0}" -gt 0 ]; then
        userdel "${prefix_args[@]}" "$SVC_USER"
        log "removed user $SVC_USER"
    fi
    # userdel removes the user's group only where login.defs says USERGROUPS_ENAB (a staged root may have none)
    if [ -n "$ROOT" ] && grep -q "^$SVC_USER:" "$ROOT/etc/group" 2>/dev/null; then
        groupdel "${prefix_args[@]}" "$SVC_USER"
    elif [ -z "$ROOT" ] && getent group "$SVC_USER" >/dev/null; then
        groupdel "$SVC_USER"
    fi
    log "purged configuration, device identity and state"
else
    log "kept /etc/edgefl (device identity), /var/lib/edgefl and user $SVC_USER (--purge removes them)"
fi
log "removed $UNIT and $PREFIX"
