#!/usr/bin/env bash
# Install Debian packages a test tier needs, once. Usage:
#   bash scripts/apt_install.sh LABEL "CHECK COMMAND" PACKAGE...
# Does nothing when CHECK COMMAND succeeds. Runs `apt-get update` only when a first install
# attempt fails (stale package lists). Never fails the caller: without apt-get, root or a
# mirror it explains and exits 0; the tier's tests then skip with a message saying so.
set -u
label=$1 check=$2
shift 2
have() { command -v "$1" >/dev/null 2>&1; }
log=/tmp/install_$label.log

if bash -c "$check" >/dev/null 2>&1; then
    echo "$label: already installed"
    exit 0
fi
if ! have apt-get; then
    echo "$label: no apt-get here; install $* yourself (the $label tests will skip)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if have sudo && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "$label: not root and no password-less sudo; run as root:" \
             "apt-get install $* (the $label tests will skip)"
        exit 0
    fi
fi
install() {
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "$@" \
        >"$log" 2>&1
}
echo "$label: installing $*..."
if ! install "$@"; then
    echo "$label: first attempt failed; running apt-get update and retrying"
    $SUDO apt-get update -q >>"$log" 2>&1
    if ! install "$@"; then
        echo "$label: could not install $* (see $log); the $label tests will skip"
        exit 0
    fi
fi
if bash -c "$check" >/dev/null 2>&1; then
    echo "$label: installed $*"
else
    echo "$label: apt-get succeeded but the check ($check) still fails; the $label tests" \
         "will skip"
fi
exit 0
