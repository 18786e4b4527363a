#!/usr/bin/env bash
# Provision a production mosquitto for edgefl: a private CA, a TLS listener, per-device credentials and the ACL of
# server/acl.py (a device publishes only its own updates and reads only its own assignments and the broadcast
# topics). See firmware_scripts/README.md.
set -euo pipefail

PROG=$(basename "$0")
die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }

usage() {
    cat <<EOF
Usage:
  $PROG init DIR [--host NAME|IP]... [--port 8883] [--bind ADDR] [--cert-port PORT] [--server-user NAME]
                 [--job NAME] [--days 3650] [--max-packet-size BYTES] [--run-as-root]
      New CA (EC P-256), server certificate with the --host names/IPs as subjectAltName, mosquitto.conf with a TLS
      listener, password file (the server user's password goes to DIR/server.password), ACL, persistence.
      --cert-port adds a second TLS listener that requires a client certificate and uses its CN as the username.
      --run-as-root writes 'user root' (only when run as root): otherwise mosquitto drops to user mosquitto, and
      the files are made readable by group mosquitto.
  $PROG add-device DIR ID [--cert] [--password-file FILE]
      Password device: prints the generated password once on stdout (or writes it to FILE, mode 0600).
      --cert: issue DIR/devices/ID.crt and ID.key (CN=ID, signed by the CA) for the --cert-port listener instead.
  $PROG revoke-device DIR ID
      Removes the password entry; a certificate is revoked and the CRL regenerated. Then reload mosquitto
      (systemctl reload mosquitto, or kill -HUP its pid): new connections of ID are refused.
  $PROG list DIR
      Devices with their kind (password, cert) and state.
  $PROG add-site DIR NAME --device ID [--device ID]... [--password-file FILE]
      Central broker: a login NAME for a site broker's bridge, allowed to carry only these devices' topics (its
      section of the ACL, as server.acl.site_rules). Prints the generated password once (or writes it to FILE);
      run again with the full device list to change it (the password stays). Then reload mosquitto.
  $PROG add-bridge DIR URL --username NAME --password-file FILE [--ca-file CA]
      Site broker: bridge its devices' topics to the central broker at URL (mqtts://HOST:PORT) as NAME (a login
      made there with add-site), trusting CA (default: the system's CAs). add-device and revoke-device keep the
      bridged device list current. Then restart mosquitto: it does not reload bridges.
  $PROG print-acl [--server-user NAME] [--job NAME] [--site NAME --device ID...]
      The ACL text (the same bytes as server.acl.acl_rules(NAME, JOB), then site_rules for --site).
EOF
}

id_re='^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$' # edge_client.wire.topics.CLIENT_ID_RE

# The same text as server/acl.py acl_rules(server_user, job); tests/integration/test_firmware.py asserts byte equality.
acl_rules() {
    local server_user=$1 job=${2:-+}
    local base="edgefl/$job"
    printf '%s\n' \
        "# edgefl ACL from server.acl.acl_rules: a device (username = client id) sees only its own topics." \
        "pattern write $base/c/%u/up" \
        "pattern read $base/c/%u/down" \
        "pattern read $base/broadcast" \
        "pattern read $base/server" \
        "pattern read $base/model" \
        "pattern read $base/model/global/+" \
        "" \
        "user $server_user" \
        "topic readwrite edgefl/#"
}

# The same text as server/acl.py site_rules(site_user, devices, job), appended after acl_rules with a blank line.
site_rules() {
    local site_user=$1 job=$2 device
    shift 2
    local base="edgefl/$job"
    printf '%s\n' "# site $site_user: its bridge carries these devices only" "user $site_user"
    for device in "$@"; do printf '%s\n' "topic write $base/c/$device/up" "topic read $base/c/$device/down"; done
    printf '%s\n' "topic read $base/broadcast" "topic read $base/server" "topic read $base/model" \
        "topic read $base/model/global/+"
}

# The same lines as server/bridge.py bridge_config(); tests/integration/test_firmware.py compares a provisioned site with it.
bridge_section() {
    local url=$1 user=$2 password=$3 ca=$4 max_packet=$5 device
    shift 5
    local hostport=${url#*://}
    printf '%s\n' "connection edgefl-$user" "address $hostport" "remote_clientid $user" "remote_username $user" \
        "remote_password $password" "bridge_protocol_version mqttv311" "cleansession false" "local_cleansession false" \
        "try_private true" "notifications true" "notifications_local_only true" "restart_timeout 1 30" \
        "keepalive_interval 60" "bridge_max_packet_size $max_packet"
    if [[ $url == mqtts://* ]]; then
        if [ -n "$ca" ]; then echo "bridge_cafile $ca"; else echo "bridge_capath /etc/ssl/certs"; fi
        echo "bridge_insecure false"
    fi
    for device in "$@"; do printf '%s\n' "topic edgefl/+/c/$device/up out 1" "topic edgefl/+/c/$device/down in 1"; done
    printf '%s\n' "topic edgefl/+/broadcast in 1" "topic edgefl/+/server in 1" "topic edgefl/+/model in 1" \
        "topic edgefl/+/model/global/+ in 1"
}

check_server_user() { [[ $1 =~ ^[^[:space:]:/#+]+$ ]] || die "invalid server user '$1'"; }
check_job() { [ "$1" = + ] || [[ $1 =~ $id_re ]] || die "invalid job '$1' (+ or letters, digits, _ . -)"; }
need_arg() { if [ "$#" -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi; }
need_tools() {
    local t
    for t in "$@"; do command -v "$t" >/dev/null || die "$t is not installed (apt-get install -y openssl mosquitto)"; done
}
mosquitto_passwd_bin() {
    if command -v mosquitto_passwd >/dev/null; then command -v mosquitto_passwd; else
        [ -x /usr/bin/mosquitto_passwd ] || die "mosquitto_passwd not found (apt-get install -y mosquitto)"
        echo /usr/bin/mosquitto_passwd
    fi
}
new_password() { openssl rand -base64 24 | tr -d '/+=\n' | cut -c1-24; }
abs_dir() { cd "$1" && pwd; }

# Files mosquitto reads: 0600 when it runs as root, else 0640 group mosquitto (it drops to that user).
secure_files() {
    local dir=$1
    shift
    if [ "$(id -u)" -eq 0 ] && ! grep -qx 'user root' "$dir/mosquitto.conf" 2>/dev/null && getent group mosquitto >/dev/null; then
        chgrp mosquitto "$dir" "$@"
        chmod 0750 "$dir"
        chmod 0640 "$@"
    else
        chmod 0700 "$dir"
        chmod 0600 "$@"
    fi
}

ca_conf() { # minimal `openssl ca` configuration: issuing device certificates and the CRL
    cat <<EOF
[ca]
default_ca = edgefl_ca
[edgefl_ca]
dir = $1/ca
database = \$dir/index.txt
new_certs_dir = \$dir/newcerts
serial = \$dir/serial
crlnumber = \$dir/crlnumber
certificate = $1/ca.crt
private_key = $1/ca.key
default_md = sha256
default_days = $2
default_crl_days = $2
policy = policy_any
unique_subject = no
copy_extensions = none
x509_extensions = device_ext
[policy_any]
commonName = supplied
[device_ext]
basicConstraints = critical,CA:false
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EOF
}

cmd_init() {
    [ "$#" -ge 1 ] || die "init needs DIR"
    local dir=$1
    shift
    local hosts=() port=8883 bind="" cert_port="" server_user=edgefl-server job=+ days=3650 max_packet=16777216 as_root=0
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --host) need_arg "$@"; hosts+=("$2"); shift 2 ;;
            --port) need_arg "$@"; port=$2; shift 2 ;;
            --bind) need_arg "$@"; bind=$2; shift 2 ;;
            --cert-port) need_arg "$@"; cert_port=$2; shift 2 ;;
            --server-user) need_arg "$@"; server_user=$2; shift 2 ;;
            --job) need_arg "$@"; job=$2; shift 2 ;;
            --days) need_arg "$@"; days=$2; shift 2 ;;
            --max-packet-size) need_arg "$@"; max_packet=$2; shift 2 ;;
            --run-as-root) as_root=1; shift ;;
            *) die "init: unknown option $1" ;;
        esac
    done
    need_tools openssl
    local mpw
    mpw=$(mosquitto_passwd_bin)
    if ! [[ $port =~ ^[0-9]+$ ]] || [ "$port" -lt 1 ] || [ "$port" -gt 65535 ]; then die "invalid --port $port"; fi
    if [ -n "$cert_port" ]; then
        if ! [[ $cert_port =~ ^[0-9]+$ ]] || [ "$cert_port" -eq "$port" ]; then die "invalid --cert-port $cert_port"; fi
    fi
    [[ $days =~ ^[1-9][0-9]*$ ]] || die "invalid --days $days"
    [[ $max_packet =~ ^[1-9][0-9]*$ ]] || die "invalid --max-packet-size $max_packet"
    check_server_user "$server_user"
    check_job "$job"
    [ "${#hosts[@]}" -gt 0 ] || hosts=(localhost 127.0.0.1)
    [ ! -e "$dir/ca.key" ] || die "$dir already holds a CA (ca.key): refusing to overwrite it"
    mkdir -p "$dir"
    chmod 0700 "$dir"
    dir=$(abs_dir "$dir")
    [[ $dir != *[[:space:]]* ]] || die "DIR must not contain whitespace (mosquitto.conf)"
    umask 077
    mkdir -p "$dir/ca/newcerts" "$dir/devices" "$dir/data"
    : >"$dir/ca/index.txt"
    openssl rand -hex 16 >"$dir/ca/serial"
    echo 01 >"$dir/ca/crlnumber"
    ca_conf "$dir" "$days" >"$dir/ca/openssl.cnf"

    local san="" h
    for h in "${hosts[@]}"; do
        if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+="${san:+,}IP:$h"; else san+="${san:+,}DNS:$h"; fi
    done
    log "creating CA and server certificate (subjectAltName $san)"
    openssl ecparam -name prime256v1 -genkey -noout -out "$dir/ca.key" 2>/dev/null
    openssl req -new -x509 -sha256 -key "$dir/ca.key" -days "$days" -subj "/CN=edgefl CA" \
        -addext "basicConstraints=critical,CA:true" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -out "$dir/ca.crt" 2>/dev/null
    openssl ecparam -name prime256v1 -genkey -noout -out "$dir/server.key" 2>/dev/null
    openssl req -new -sha256 -key "$dir/server.key" -subj "/CN=${hosts[0]}" -out "$dir/server.csr" 2>/dev/null
    printf 'basicConstraints=critical,CA:false\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=%s\n' \
        "$san" >"$dir/server.ext"
    openssl x509 -req -sha256 -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
        -CAserial "$dir/ca/server.srl" -days "$days" -extfile "$dir/server.ext" -out "$dir/server.crt" 2>/dev/null
    rm -f "$dir/server.csr" "$dir/server.ext"
    openssl ca -batch -config "$dir/ca/openssl.cnf" -gencrl -out "$dir/crl.pem" 2>/dev/null

    acl_rules "$server_user" "$job" >"$dir/acl"
    printf '%s\n' "$job" >"$dir/server.job"
    local server_pw
    server_pw=$(new_password)
    printf '%s\n' "$server_pw" >"$dir/server.password"
    : >"$dir/passwd"
    "$mpw" -b "$dir/passwd" "$server_user" "$server_pw"
    printf '%s\n' "$server_user" >"$dir/server.user"

    {
        echo "# generated by provision-broker.sh init; run: mosquitto -c $dir/mosquitto.conf"
        echo "per_listener_settings false"
        echo "allow_anonymous false"
        echo "password_file $dir/passwd"
        echo "acl_file $dir/acl"
        echo "max_packet_size $max_packet"
        echo "set_tcp_nodelay true"
        echo "max_inflight_messages 20"
        echo "max_queued_messages 10000"
        echo "max_queued_bytes 268435456" # as server.broker.BrokerSettings (tests/integration/test_firmware.py keeps them equal)
        echo "persistence true"
        echo "persistence_location $dir/data/"
        echo "autosave_interval 5"
        echo "log_dest file $dir/mosquitto.log"
        echo "log_timestamp_format %Y-%m-%dT%H:%M:%S"
        echo "connection_messages true"
        echo
        echo "# devices with passwords (username = device id)"
        echo "listener $port${bind:+ $bind}"
        echo "cafile $dir/ca.crt"
        echo "certfile $dir/server.crt"
        echo "keyfile $dir/server.key"
        echo "tls_version tlsv1.2"
        if [ -n "$cert_port" ]; then
            echo
            echo "# devices with client certificates (username = certificate CN = device id)"
            echo "listener $cert_port${bind:+ $bind}"
            echo "cafile $dir/ca.crt"
            echo "certfile $dir/server.crt"
            echo "keyfile $dir/server.key"
            echo "tls_version tlsv1.2"
            echo "require_certificate true"
            echo "use_identity_as_username true"
            echo "crlfile $dir/crl.pem"
        fi
        if [ "$as_root" -eq 1 ]; then
            if [ "$(id -u)" -eq 0 ]; then echo "user root"; else log "warning: --run-as-root ignored (not root)"; fi
        fi
    } >"$dir/mosquitto.conf"
    chmod 0644 "$dir/ca.crt" "$dir/server.crt"
    secure_files "$dir" "$dir/passwd" "$dir/acl" "$dir/server.key" "$dir/mosquitto.conf" "$dir/crl.pem"
    if [ "$(id -u)" -eq 0 ] && ! grep -qx 'user root' "$dir/mosquitto.conf" && getent passwd mosquitto >/dev/null; then
        chown mosquitto "$dir/data"
    fi
    log "broker files in $dir; start with: mosquitto -c $dir/mosquitto.conf"
    log "server login: user $server_user, password in $dir/server.password; devices get $dir/ca.crt"
}

cmd_add_device() {
    [ "$#" -ge 2 ] || die "add-device needs DIR and ID"
    local dir=$1 id=$2 cert=0 pw_out=""
    shift 2
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --cert) cert=1; shift ;;
            --password-file) need_arg "$@"; pw_out=$2; shift 2 ;;
            *) die "add-device: unknown option $1" ;;
        esac
    done
    [ -f "$dir/mosquitto.conf" ] || die "$dir is not a provisioned broker directory (run init first)"
    [[ $id =~ $id_re ]] || die "invalid device id '$id' (1-64 of letters, digits, _ . -; starting with a letter or digit)"
    [ "$id" != "$(cat "$dir/server.user")" ] || die "'$id' is the server user"
    umask 077
    if grep -q "^$id:" "$dir/passwd" || [ -f "$dir/devices/$id.crt" ]; then
        die "device $id already exists (revoke-device first)"
    fi
    if [ "$cert" -eq 1 ]; then
        grep -q '^use_identity_as_username true' "$dir/mosquitto.conf" ||
            log "warning: no --cert-port listener in $dir/mosquitto.conf: certificate devices cannot connect"
        openssl ecparam -name prime256v1 -genkey -noout -out "$dir/devices/$id.key" 2>/dev/null
        openssl req -new -sha256 -key "$dir/devices/$id.key" -subj "/CN=$id" -out "$dir/devices/$id.csr" 2>/dev/null
        openssl ca -batch -notext -config "$dir/ca/openssl.cnf" -in "$dir/devices/$id.csr" \
            -out "$dir/devices/$id.crt" 2>/dev/null
        rm -f "$dir/devices/$id.csr"
        chmod 0644 "$dir/devices/$id.crt"
        log "device $id: certificate $dir/devices/$id.crt, key $dir/devices/$id.key (copy both and ca.crt to it)"
    else
        local pw
        pw=$(new_password)
        "$(mosquitto_passwd_bin)" -b "$dir/passwd" "$id" "$pw"
        secure_files "$dir" "$dir/passwd"
        if [ -n "$pw_out" ]; then
            printf '%s\n' "$pw" >"$pw_out"
            chmod 0600 "$pw_out"
            log "device $id: password written to $pw_out"
        else
            log "device $id: password (shown once):"
            printf '%s\n' "$pw"
        fi
    fi
    refresh_bridge "$dir" || log "reload a running broker: systemctl reload mosquitto (or kill -HUP its pid)"
}

cmd_revoke_device() {
    [ "$#" -eq 2 ] || die "revoke-device needs DIR and ID"
    local dir=$1 id=$2 done_any=0
    [ -f "$dir/mosquitto.conf" ] || die "$dir is not a provisioned broker directory"
    [[ $id =~ $id_re ]] || die "invalid device id '$id'"
    umask 077
    if grep -q "^$id:" "$dir/passwd"; then
        "$(mosquitto_passwd_bin)" -D "$dir/passwd" "$id"
        secure_files "$dir" "$dir/passwd"
        log "device $id: password removed"
        done_any=1
    fi
    if [ -f "$dir/devices/$id.crt" ]; then
        openssl ca -batch -config "$dir/ca/openssl.cnf" -revoke "$dir/devices/$id.crt" 2>/dev/null
        openssl ca -batch -config "$dir/ca/openssl.cnf" -gencrl -out "$dir/crl.pem" 2>/dev/null
        secure_files "$dir" "$dir/crl.pem"
        mv -f "$dir/devices/$id.crt" "$dir/devices/$id.crt.revoked"
        rm -f "$dir/devices/$id.key"
        log "device $id: certificate revoked, $dir/crl.pem regenerated"
        done_any=1
    fi
    [ "$done_any" -eq 1 ] || die "no device $id in $dir"
    refresh_bridge "$dir" || log "reload a running broker: systemctl reload mosquitto (or kill -HUP its pid)"
}

# Active devices: password logins other than the server and site logins, then unrevoked certificates.
active_devices() {
    local dir=$1 server id f
    server=$(cat "$dir/server.user")
    cut -d: -f1 "$dir/passwd" | while read -r id; do
        [ "$id" = "$server" ] || [ -f "$dir/sites/$id" ] || echo "$id"
    done
    for f in "$dir"/devices/*.crt; do
        [ -e "$f" ] || continue
        id=$(basename "$f")
        echo "${id%.crt}"
    done
}

# Rewrite the bridge section (always the end of mosquitto.conf) for the current devices; false without a bridge.
refresh_bridge() {
    local dir=$1 devices=()
    [ -f "$dir/bridge.env" ] || return 1
    local BRIDGE_URL BRIDGE_USER BRIDGE_PASSWORD BRIDGE_CA
    # shellcheck disable=SC1091
    . "$dir/bridge.env"
    mapfile -t devices < <(active_devices "$dir")
    local max_packet
    max_packet=$(sed -n 's/^max_packet_size //p' "$dir/mosquitto.conf")
    sed -i '/^# edgefl bridge/,$d' "$dir/mosquitto.conf"
    {
        echo "# edgefl bridge from provision-broker.sh add-bridge (rewritten by add-device and revoke-device)"
        bridge_section "$BRIDGE_URL" "$BRIDGE_USER" "$BRIDGE_PASSWORD" "$BRIDGE_CA" "$max_packet" "${devices[@]}"
    } >>"$dir/mosquitto.conf"
    secure_files "$dir" "$dir/bridge.env" "$dir/mosquitto.conf" # the conf now holds the site's password
    log "bridge to $BRIDGE_URL carries ${#devices[@]} device(s); restart mosquitto (it does not reload bridges)"
    log "the central broker's site entry must list the same devices: provision-broker.sh add-site CENTRAL_DIR" \
        "$BRIDGE_USER $(printf -- '--device %s ' "${devices[@]}")"
}

cmd_add_bridge() {
    [ "$#" -ge 2 ] || die "add-bridge needs DIR and URL"
    local dir=$1 url=$2 user="" pw_file="" ca=""
    shift 2
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --username) need_arg "$@"; user=$2; shift 2 ;;
            --password-file) need_arg "$@"; pw_file=$2; shift 2 ;;
            --ca-file) need_arg "$@"; ca=$2; shift 2 ;;
            *) die "add-bridge: unknown option $1" ;;
        esac
    done
    [ -f "$dir/mosquitto.conf" ] || die "$dir is not a provisioned broker directory (run init first)"
    [[ $url =~ ^mqtts?://[^/[:space:]]+:[0-9]+$ ]] || die "invalid URL '$url' (mqtts://HOST:PORT)"
    if [[ $url == mqtt://* ]] && [[ ! $url =~ ^mqtt://(127\.[0-9.]+|localhost|\[::1\]): ]]; then
        die "refusing to bridge to $url without TLS: the site's password and its devices' updates would cross the network in clear text; use mqtts://"
    fi
    [[ $user =~ $id_re ]] || die "add-bridge needs --username NAME (the site's login on the central broker)"
    [ -f "$pw_file" ] || die "add-bridge needs --password-file FILE (the site's password from add-site)"
    local password
    password=$(head -n1 "$pw_file")
    [[ $password =~ ^[^[:space:]]+$ ]] || die "the password in $pw_file is empty or has whitespace"
    umask 077
    dir=$(abs_dir "$dir")
    if [ -n "$ca" ]; then
        [ -f "$ca" ] || die "CA file $ca does not exist"
        cp "$ca" "$dir/bridge-ca.crt"
        chmod 0644 "$dir/bridge-ca.crt"
        ca="$dir/bridge-ca.crt"
    fi
    printf 'BRIDGE_URL=%q\nBRIDGE_USER=%q\nBRIDGE_PASSWORD=%q\nBRIDGE_CA=%q\n' "$url" "$user" "$password" "$ca" >"$dir/bridge.env"
    refresh_bridge "$dir"
}

cmd_add_site() {
    [ "$#" -ge 2 ] || die "add-site needs DIR and NAME"
    local dir=$1 name=$2 pw_out="" devices=() id
    shift 2
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --device) need_arg "$@"; devices+=("$2"); shift 2 ;;
            --password-file) need_arg "$@"; pw_out=$2; shift 2 ;;
            *) die "add-site: unknown option $1" ;;
        esac
    done
    [ -f "$dir/mosquitto.conf" ] || die "$dir is not a provisioned broker directory (run init first)"
    [[ $name =~ $id_re ]] || die "invalid site name '$name'"
    [ "${#devices[@]}" -gt 0 ] || die "add-site needs at least one --device ID"
    for id in "${devices[@]}"; do [[ $id =~ $id_re ]] || die "invalid device id '$id'"; done
    [ "$name" != "$(cat "$dir/server.user")" ] || die "'$name' is the server user"
    umask 077
    mkdir -p "$dir/sites"
    if [ ! -f "$dir/sites/$name" ]; then
        ! grep -q "^$name:" "$dir/passwd" || die "'$name' is already a device login"
        local pw
        pw=$(new_password)
        "$(mosquitto_passwd_bin)" -b "$dir/passwd" "$name" "$pw"
        if [ -n "$pw_out" ]; then
            printf '%s\n' "$pw" >"$pw_out"
            chmod 0600 "$pw_out"
            log "site $name: password written to $pw_out"
        else
            log "site $name: password (shown once):"
            printf '%s\n' "$pw"
        fi
    fi
    printf '%s\n' "${devices[@]}" >"$dir/sites/$name"
    write_acl "$dir"
    secure_files "$dir" "$dir/passwd" "$dir/acl"
    log "site $name may carry: ${devices[*]}; reload a running broker: systemctl reload mosquitto (or kill -HUP its pid)"
}

# The whole ACL: the device and server rules, then one section per site (the order of server.broker's acl_text).
write_acl() {
    local dir=$1 job=+ f devices=()
    [ -f "$dir/server.job" ] && job=$(cat "$dir/server.job")
    {
        acl_rules "$(cat "$dir/server.user")" "$job"
        for f in "$dir"/sites/*; do
            [ -e "$f" ] || continue
            mapfile -t devices <"$f"
            echo
            site_rules "$(basename "$f")" "$job" "${devices[@]}"
        done
    } >"$dir/acl"
}

cmd_list() {
    [ "$#" -eq 1 ] || die "list needs DIR"
    local dir=$1 server f id
    [ -f "$dir/mosquitto.conf" ] || die "$dir is not a provisioned broker directory"
    server=$(cat "$dir/server.user")
    cut -d: -f1 "$dir/passwd" | while read -r id; do
        if [ -f "$dir/sites/$id" ]; then printf '%s\tsite\t%s\n' "$id" "$(paste -sd, "$dir/sites/$id")"
        elif [ "$id" != "$server" ]; then printf '%s\tpassword\tactive\n' "$id"; fi
    done
    for f in "$dir"/devices/*.crt "$dir"/devices/*.crt.revoked; do
        [ -e "$f" ] || continue
        id=$(basename "$f")
        case "$f" in
            *.revoked) printf '%s\tcert\trevoked\n' "${id%.crt.revoked}" ;;
            *) printf '%s\tcert\tactive\n' "${id%.crt}" ;;
        esac
    done
}

cmd_print_acl() {
    local server_user=edgefl-server job=+ site="" devices=()
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --server-user) need_arg "$@"; server_user=$2; shift 2 ;;
            --job) need_arg "$@"; job=$2; shift 2 ;;
            --site) need_arg "$@"; site=$2; shift 2 ;;
            --device) need_arg "$@"; devices+=("$2"); shift 2 ;;
            *) die "print-acl: unknown option $1" ;;
        esac
    done
    check_server_user "$server_user"
    check_job "$job"
    acl_rules "$server_user" "$job"
    if [ -n "$site" ]; then
        echo
        site_rules "$site" "$job" "${devices[@]}"
    fi
}

[ "$#" -ge 1 ] || { usage >&2; exit 2; }
cmd=$1
shift
case "$cmd" in
    init) cmd_init "$@" ;;
    add-device) cmd_add_device "$@" ;;
    revoke-device) cmd_revoke_device "$@" ;;
    list) cmd_list "$@" ;;
    add-site) cmd_add_site "$@" ;;
    add-bridge) cmd_add_bridge "$@" ;;
    print-acl) cmd_print_acl "$@" ;;
    -h | --help | help) usage ;;
    *) usage >&2; die "unknown command $cmd" ;;
esac
