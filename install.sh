#!/usr/bin/env bash
# Install crihook on a GPU node, or remove it again.
#
#   sudo ./install.sh                 install (or upgrade) and put crihook between kubelet and containerd
#   sudo ./install.sh --mode nri      install (or upgrade) crihook as containerd's NRI plugin instead
#   sudo ./install.sh --dra           also install (or upgrade) crihook's DRA driver, `crihook dra`
#   sudo ./install.sh --uninstall     restore the node as it was before the first install
#   ./install.sh --root DIR           stage into DIR without touching this machine's services
#
# What it does, in order: checks the node; creates a private virtual environment under the prefix
# (default /opt/crihook) and installs crihook into it; installs the systemd unit and, when absent, a
# commented config at /etc/crihook/config.toml; starts crihook. In proxy mode (the default) it then
# adds a kubelet drop-in that points kubelet's runtime endpoint at crihook's socket (images keep
# going straight to containerd) and restarts kubelet; in NRI mode kubelet is left alone and
# containerd's NRI socket must be there. With --dra (or once installed with it) the DRA driver's unit
# is installed and started beside the node daemon's. Every file it creates or replaces is written down in
# <prefix>/install.record (replaced files are copied to <prefix>/backup first), which is what
# --uninstall undoes.
set -euo pipefail

PROG=install.sh
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

ROOT=""
PREFIX=/opt/crihook
SOURCE=""
PIP_ARGS=""
PYTHON=python3
DEFAULT_CONTAINERD_SOCKET=/run/containerd/containerd.sock
CONTAINERD_SOCKET=$DEFAULT_CONTAINERD_SOCKET
SKIP_KUBELET=0
UNINSTALL=0
DRA=0
MODE=proxy
NRI_SOCKET=/var/run/nri/nri.sock

UNIT=/etc/systemd/system/crihook.service
NRI_UNIT=/etc/systemd/system/crihook-nri.service
DRA_UNIT=/etc/systemd/system/crihook-dra.service
CONFIG=/etc/crihook/config.toml
STATE_DIR=/var/lib/crihook
DROPIN_DIR=/etc/systemd/system/kubelet.service.d
DROPIN=$DROPIN_DIR/99-crihook.conf
WANTS_DIR=/etc/systemd/system/multi-user.target.wants
# Where kubelet.service and its drop-ins can live, lowest precedence first.
UNIT_DIRS=(/lib/systemd/system /usr/lib/systemd/system /run/systemd/system /etc/systemd/system)

usage() {
    cat <<EOF
usage: $PROG [--mode proxy|nri] [--dra] [--uninstall] [--root DIR] [--prefix DIR] [--source PATH|SPEC]
             [--pip-args ARGS] [--python PYTHON] [--containerd-socket PATH] [--nri-socket PATH]
             [--skip-kubelet]

  --mode proxy|nri       proxy (default): crihook between kubelet and containerd, kubelet re-pointed;
                         nri: crihook as containerd's NRI plugin, kubelet untouched (containerd 1.7+)
  --dra                  also run crihook's DRA driver (crihook-dra.service, Kubernetes 1.34+); it
                         needs [reporter] kubeconfig in $CONFIG. Kept on upgrades once installed

  --uninstall            undo what earlier runs did: remove crihook, restore replaced files
  --root DIR             install into the staging root DIR; start and restart nothing
  --prefix DIR           where the virtual environment lives (default $PREFIX)
  --source PATH|SPEC     what pip installs (default: the checkout this script is in; a wheel works)
  --pip-args ARGS        extra pip arguments, e.g. "--no-index --find-links /srv/wheels" offline
  --python PYTHON        interpreter for the virtual environment, 3.11 or newer (default python3)
  --containerd-socket P  containerd's socket, checked before installing and, when not the default,
                         given to crihook (--runtime-endpoint) (default $CONTAINERD_SOCKET)
  --nri-socket PATH      containerd's NRI socket, checked in NRI mode (default $NRI_SOCKET)
  --skip-kubelet         leave kubelet alone (point its runtime endpoint at crihook yourself)
EOF
}

say() { printf '%s: %s\n' "$PROG" "$*"; }
die() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 1
}

while (($#)); do
    case $1 in
        --uninstall) UNINSTALL=1 ;;
        --dra) DRA=1 ;;
        --skip-kubelet) SKIP_KUBELET=1 ;;
        --root | --prefix | --source | --pip-args | --python | --containerd-socket | --mode | --nri-socket)
            (($# >= 2)) || die "$1 needs a value"
            case $1 in
                --root) ROOT=$2 ;;
                --prefix) PREFIX=$2 ;;
                --source) SOURCE=$2 ;;
                --pip-args) PIP_ARGS=$2 ;;
                --python) PYTHON=$2 ;;
                --containerd-socket) CONTAINERD_SOCKET=$2 ;;
                --mode) MODE=$2 ;;
                --nri-socket) NRI_SOCKET=$2 ;;
            esac
            shift
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        *)
            usage >&2
            die "unknown argument $1"
            ;;
    esac
    shift
done

[[ $MODE == proxy || $MODE == nri ]] || die "--mode must be proxy or nri, not '$MODE'"
# The prefix is substituted into the unit file: keep it to characters that need no quoting there.
[[ $PREFIX =~ ^/[A-Za-z0-9._/+-]*[A-Za-z0-9._+-]$ ]] || die "--prefix must be an absolute path of letters, digits and ._+-/ (not ending in /), not '$PREFIX'"
if [[ -n $ROOT ]]; then
    [[ -d $ROOT ]] || die "--root $ROOT is not a directory"
    ROOT=$(cd "$ROOT" && pwd)
    [[ $ROOT != / ]] || ROOT=""
fi
VENV=$PREFIX/venv
RECORD=$PREFIX/install.record
BACKUP=$PREFIX/backup
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# host PATH -> the same path inside the root being installed
r() { printf '%s%s' "$ROOT" "$1"; }

systemctl_() {
    if [[ -n $ROOT ]]; then
        systemctl --root="$ROOT" --quiet "$@"
    else
        systemctl --quiet "$@"
    fi
}

# -- checks ----------------------------------------------------------------------------------------

check_host() {
    if [[ -z $ROOT ]]; then
        [[ $(id -u) -eq 0 ]] || die "must run as root: it writes /etc and $PREFIX and restarts kubelet (use --root DIR to stage into a directory instead)"
        [[ -d /run/systemd/system ]] || die "systemd is not running on this machine (no /run/systemd/system); crihook and kubelet run as systemd services"
    fi
    command -v systemctl >/dev/null || die "systemctl not found; crihook is installed as a systemd service (Debian/Ubuntu: apt-get install systemd)"
}

check_install() {
    [[ -S $(r "$CONTAINERD_SOCKET") ]] || die "no containerd socket at $CONTAINERD_SOCKET: install and start containerd first (systemctl status containerd), or name its socket with --containerd-socket"
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found: crihook needs Python 3.11 or newer with venv (Debian/Ubuntu: apt-get install python3 python3-venv)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        die "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'); crihook needs 3.11 or newer (--python PATH picks another)"
    "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || die "$PYTHON has no venv module (Debian/Ubuntu: apt-get install python3-venv)"
    if [[ -z $SOURCE ]]; then
        [[ -f $HERE/pyproject.toml ]] || die "no crihook source next to $PROG; name a wheel or directory with --source"
        SOURCE=$HERE
    fi
    recorded "$DRA_UNIT" && DRA=1
    ((DRA)) && check_dra
    if [[ $MODE == nri ]]; then
        check_nri
    elif ((!SKIP_KUBELET)) && [[ -z $(kubelet_units) ]]; then
        die "no kubelet.service under $(printf '%s ' "${UNIT_DIRS[@]}")- install kubelet first, or pass --skip-kubelet and point kubelet's --container-runtime-endpoint at crihook's socket yourself"
    fi
}

# containerd's version when it can be asked (not when staging into a root), for the messages below.
containerd_version() {
    [[ -z $ROOT ]] && command -v containerd >/dev/null && containerd --version 2>/dev/null | awk '{print $3}'
    return 0
}

# NRI mode needs containerd's NRI socket: containerd 1.7 has NRI off unless its config turns it on,
# 2.x has it on unless its config turns it off, 1.6 has none. One mode per node: switching goes
# through --uninstall, which also takes kubelet's drop-in away.
check_nri() {
    local version
    recorded "$DROPIN" && die "crihook is installed here in proxy mode; run $PROG --uninstall first, then $PROG --mode nri"
    [[ -S $(r "$NRI_SOCKET") ]] && return 0
    version=$(containerd_version)
    die "no NRI socket at $NRI_SOCKET${version:+ (containerd $version)}: containerd's NRI is off. On containerd 1.7 add
    [plugins.\"io.containerd.nri.v1.nri\"]
      disable = false
  to /etc/containerd/config.toml and restart containerd; on 2.x remove the line that disables it
  (plugins.'io.containerd.nri.v1.nri'); containerd 1.6 has no NRI: use --mode proxy. A socket
  elsewhere (the config's socket_path) is named with --nri-socket"
}

# The DRA driver reads claims and writes ResourceSlices with [reporter] kubeconfig (the node daemon's
# device reporter uses it too); without it the driver would only exit and be restarted, so ask first.
check_dra() {
    local kubeconfig
    kubeconfig=$("$PYTHON" - "$(r "$CONFIG")" <<'PY'
import sys
import tomllib
try:
    with open(sys.argv[1], "rb") as f:
        print(tomllib.load(f).get("reporter", {}).get("kubeconfig", ""))
except (OSError, tomllib.TOMLDecodeError):
    pass
PY
    )
    [[ -n $kubeconfig ]] || die "--dra: crihook dra reads ResourceClaims and writes this node's ResourceSlices with [reporter] kubeconfig, which $CONFIG does not set. Write that file with
    [reporter]
    kubeconfig = \"/etc/crihook/kubeconfig\"
  (credentials allowed what docs/dra.md lists, in a file outside /home and /root, which the unit hides)
  and run $PROG again: it keeps an existing $CONFIG"
}

# -- the install record ----------------------------------------------------------------------------
# One line per path, first touch only: "dir P" (created; removed when empty), "tree P" (created,
# removed whole), "file P" (created, removed), "saved P" (existed; copied to the backup, restored).

recorded() { [[ -f $(r "$RECORD") ]] && grep -q -x -F -e "dir $1" -e "tree $1" -e "file $1" -e "saved $1" "$(r "$RECORD")"; }
record() { printf '%s %s\n' "$1" "$2" >>"$(r "$RECORD")"; }

# Create directory $1 and its missing parents, recording each one created.
make_dir() {
    local path=$1 mode=${2:-0755} parent
    [[ -d $(r "$path") ]] && return 0
    parent=$(dirname "$path")
    make_dir "$parent"
    mkdir -m "$mode" "$(r "$path")"
    recorded "$path" || record dir "$path"
}

# Note that file $1 is about to be written: back it up when it is someone else's.
claim_file() {
    local path=$1
    recorded "$path" && return 0
    if [[ -e $(r "$path") || -L $(r "$path") ]]; then
        make_dir "$(dirname "$BACKUP$path")" 0700
        cp -a "$(r "$path")" "$(r "$BACKUP$path")"
        record saved "$path"
    else
        record file "$path"
    fi
}

# install_file SOURCE DEST MODE: write DEST (atomically) when its content differs; 0 when it changed.
install_file() {
    local src=$1 dest=$2 mode=$3 tmp
    if [[ -f $(r "$dest") ]] && cmp -s "$src" "$(r "$dest")"; then
        chmod "$mode" "$(r "$dest")"
        return 1
    fi
    make_dir "$(dirname "$dest")"
    claim_file "$dest"
    tmp=$(r "$dest").crihook-new
    cp "$src" "$tmp"
    chmod "$mode" "$tmp"
    mv -f "$tmp" "$(r "$dest")"
    return 0
}

# -- kubelet ---------------------------------------------------------------------------------------

# kubelet.service and its drop-ins in the order systemd reads them (ours left out).
kubelet_units() {
    local dir main="" name
    local -A dropins=()
    for dir in "${UNIT_DIRS[@]}"; do
        [[ -f $(r "$dir/kubelet.service") ]] && main=$dir/kubelet.service
        for f in "$(r "$dir")"/kubelet.service.d/*.conf; do
            [[ -f $f ]] || continue
            name=${f##*/}
            # A drop-in in a later directory masks one of the same name in an earlier one.
            dropins[$name]=${f#"$ROOT"}
        done
    done
    [[ -n $main ]] || return 0
    printf '%s\n' "$main"
    unset "dropins[${DROPIN##*/}]"
    if ((${#dropins[@]})); then
        printf '%s\n' "${!dropins[@]}" | LC_ALL=C sort | while read -r name; do printf '%s\n' "${dropins[$name]}"; done
    fi
}

# The ExecStart kubelet runs today: the last one set, an empty ExecStart= clearing earlier ones.
kubelet_exec_start() {
    local file line current="" joined
    while read -r file; do
        joined=""
        while IFS= read -r line || [[ -n $line ]]; do
            if [[ $line == *\\ ]]; then
                joined+="${line%\\} "
                continue
            fi
            line="$joined$line"
            joined=""
            if [[ $line =~ ^[[:space:]]*ExecStart[[:space:]]*=[[:space:]]*(.*)$ ]]; then
                current=${BASH_REMATCH[1]}
            fi
        done <"$(r "$file")"
    done < <(kubelet_units)
    printf '%s' "$current"
}

# What the drop-in must say; needs the installed crihook to read the config.
kubelet_dropin() {
    local exec_start endpoints listen images
    exec_start=$(kubelet_exec_start)
    [[ -n $exec_start ]] || die "kubelet.service has no ExecStart to extend; pass --skip-kubelet and point kubelet at crihook yourself"
    endpoints=$("$(r "$VENV")/bin/python" - "$(r "$CONFIG")" <<'PY'
import sys
from crihook.base.config import ConfigError, load
try:
    c = load(sys.argv[1])
except ConfigError as e:
    sys.exit(f"install.sh: error: {e}")
print(c.proxy.listen, c.proxy.image_endpoint or c.node.runtime_endpoint)
PY
    ) || exit 1
    read -r listen images <<<"$endpoints"
    cat <<EOF
# Written by crihook's install.sh; install.sh --uninstall removes it.
# kubelet talks to crihook for containers and pods, to containerd directly for images.
[Unit]
Wants=crihook.service
After=crihook.service

[Service]
Environment="CRIHOOK_KUBELET_ARGS=--container-runtime-endpoint=$listen --image-service-endpoint=$images"
ExecStart=
ExecStart=$exec_start \$CRIHOOK_KUBELET_ARGS
EOF
}

# -- install ---------------------------------------------------------------------------------------

# The prefix and its missing parents; recorded once the prefix (which holds the record) exists.
make_prefix() {
    local path=$PREFIX missing=()
    while [[ ! -d $(r "$path") ]]; do
        missing=("$path" "${missing[@]}")
        path=$(dirname "$path")
    done
    if ((${#missing[@]})); then
        mkdir -p "$(r "$PREFIX")"
        for path in "${missing[@]}"; do record dir "$path"; done
    else
        touch "$(r "$RECORD")"
    fi
}

install_venv() {
    say "installing crihook from $SOURCE into $VENV"
    if [[ ! -x $(r "$VENV")/bin/python ]]; then
        rm -rf "$(r "$VENV")"
        "$PYTHON" -m venv "$(r "$VENV")"
        recorded "$VENV" || record tree "$VENV"
    fi
    # shellcheck disable=SC2086 # --pip-args is a list of words
    "$(r "$VENV")/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade $PIP_ARGS "$SOURCE" ||
        die "pip could not install $SOURCE (offline node? --pip-args \"--no-index --find-links DIR\" installs from a wheel directory)"
    "$(r "$VENV")/bin/crihook" --version >/dev/null || die "$VENV/bin/crihook does not run after installing"
}

# The unit this mode runs: crihook.service (proxy) or crihook-nri.service.
mode_unit() {
    if [[ $MODE == nri ]]; then printf '%s' "$NRI_UNIT"; else printf '%s' "$UNIT"; fi
}

install_files() {
    local unit
    unit=$(mode_unit)
    # The unit names /opt/crihook (and the NRI socket); another prefix or socket means other paths.
    # containerd's CRI socket, both modes' [node] runtime_endpoint, goes on the command line when it
    # is not the default (the flag wins over the config file).
    local runtime=""
    [[ $CONTAINERD_SOCKET == "$DEFAULT_CONTAINERD_SOCKET" ]] || runtime=" --runtime-endpoint unix://$CONTAINERD_SOCKET"
    sed -e "s|/opt/crihook/|$PREFIX/|g" -e "s|--nri-socket /var/run/nri/nri.sock|--nri-socket $NRI_SOCKET|" \
        -e "s|^\(ExecStart=.*\)$|\1$runtime|" "$HERE/systemd/${unit##*/}" >"$WORK/unit"
    install_file "$WORK/unit" "$unit" 0644 || true
    if ((DRA)); then
        sed -e "s|/opt/crihook/|$PREFIX/|g" "$HERE/systemd/${DRA_UNIT##*/}" >"$WORK/dra-unit"
        install_file "$WORK/dra-unit" "$DRA_UNIT" 0644 || true
    fi
    if [[ -e $(r "$CONFIG") ]]; then
        say "keeping the existing $CONFIG"
    else
        install_file "$HERE/systemd/config.toml" "$CONFIG" 0644 || true
    fi
    if [[ ! -d $(r "$STATE_DIR") ]]; then
        make_dir "$(dirname "$STATE_DIR")"
        mkdir -m 0700 "$(r "$STATE_DIR")"
        record tree "$STATE_DIR"
    fi
    make_dir "$WANTS_DIR"
    systemctl_ enable "${unit##*/}"
    if ((DRA)); then systemctl_ enable "${DRA_UNIT##*/}"; fi
}

install_kubelet_dropin() {
    local changed=0
    kubelet_dropin >"$WORK/dropin"
    install_file "$WORK/dropin" "$DROPIN" 0644 && changed=1
    if [[ -n $ROOT ]]; then
        return 0
    fi
    systemctl_ daemon-reload
    if ((changed)) && systemctl_ is-active kubelet.service; then
        say "restarting kubelet so it connects through crihook"
        systemctl_ restart kubelet.service
    elif ((changed)); then
        say "kubelet is not running; it will connect through crihook when it starts"
    fi
}

do_install() {
    local unit
    unit=$(mode_unit)
    unit=${unit##*/}
    check_host
    check_install
    [[ $MODE == proxy ]] && recorded "$NRI_UNIT" &&
        die "crihook is installed here in NRI mode; run $PROG --uninstall first, then $PROG"
    make_prefix
    install_venv
    install_files
    if [[ -z $ROOT ]]; then
        systemctl_ daemon-reload
        say "starting crihook ($MODE mode)"
        # Type=notify: this returns once crihook serves (proxy) or is registered with containerd (nri).
        systemctl_ restart "$unit" ||
            die "crihook did not start; see journalctl -u ${unit%.service} -n 50 and crihook doctor (kubelet was left as it was)"
        if ((DRA)); then
            say "starting crihook's DRA driver"
            # Type=notify: this returns once kubelet's plugin sockets serve.
            systemctl_ restart "${DRA_UNIT##*/}" ||
                die "crihook dra did not start; see journalctl -u crihook-dra -n 50"
        fi
    fi
    if [[ $MODE == nri ]]; then
        say "NRI mode: kubelet is left as it is; containerd calls crihook at $NRI_SOCKET"
    elif ((SKIP_KUBELET)); then
        say "kubelet left alone (--skip-kubelet): point its --container-runtime-endpoint at crihook's socket"
    else
        install_kubelet_dropin
    fi
    if [[ -n $ROOT ]]; then
        say "staged into $ROOT; nothing was started"
    else
        say "done; check the node with: $VENV/bin/crihook doctor"
    fi
}

# -- uninstall -------------------------------------------------------------------------------------

do_uninstall() {
    check_host
    local record kind path line lines unit
    record=$(r "$RECORD")
    [[ -f $record ]] || die "nothing to undo: $RECORD not found (crihook was not installed here by $PROG, or already removed)"
    if [[ -z $ROOT ]]; then
        if recorded "$DROPIN"; then
            rm -f "$(r "$DROPIN")"
            systemctl_ daemon-reload
            if systemctl_ is-active kubelet.service; then
                say "restarting kubelet so it talks to containerd directly again"
                systemctl_ restart kubelet.service
            fi
        fi
        for unit in crihook-dra.service crihook.service crihook-nri.service; do
            systemctl_ stop "$unit" 2>/dev/null || true
        done
    fi
    for unit in crihook-dra.service crihook.service crihook-nri.service; do
        systemctl_ disable "$unit" 2>/dev/null || true
    done
    # Newest first, so files go before the directories that hold them.
    mapfile -t lines < <(tac "$record")
    for line in "${lines[@]}"; do
        read -r kind path <<<"$line"
        case $kind in
            file) rm -f "$(r "$path")" ;;
            tree) rm -rf "$(r "$path")" ;;
            saved) cp -a "$(r "$BACKUP$path")" "$(r "$path")" ;;
            dir)
                [[ $path == "$BACKUP" || $path == "$BACKUP"/* ]] && continue
                [[ -d $(r "$path") ]] || continue # systemctl disable removes a wants directory it empties
                # The prefix holds the record and the backups: they go last.
                [[ $path == "$PREFIX" ]] && rm -rf "$(r "$BACKUP")" "$record"
                rmdir "$(r "$path")" 2>/dev/null || say "left $path in place: it holds files crihook did not put there"
                ;;
            *) die "$RECORD: unreadable line '$line'" ;;
        esac
    done
    rm -rf "$(r "$BACKUP")" "$record"
    if [[ -z $ROOT ]]; then
        systemctl_ daemon-reload
    fi
    say "crihook removed"
}

if ((UNINSTALL)); then
    do_uninstall
else
    do_install
fi
