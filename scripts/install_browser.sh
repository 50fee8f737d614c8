#!/usr/bin/env bash
# Install Debian's Chromium and its chromedriver for the browser tests (pytest -m browser) and
# for `trainpilot report --pdf`. Idempotent: does nothing when both are present. Runs
# `apt-get update` only when a first install attempt fails (stale package lists). Never fails
# the caller: without apt-get, root or a mirror it explains and exits 0; the browser tests then
# skip with a message saying so.
set -u

have() { command -v "$1" >/dev/null 2>&1; }
browser() { have chromium || have chromium-browser || have google-chrome; }
driver() { have chromedriver || [ -x /usr/lib/chromium/chromedriver ]; }

if browser && driver; then
    echo "install_browser: chromium and chromedriver already installed"
    exit 0
fi
if ! have apt-get; then
    echo "install_browser: no apt-get here; install Chromium and chromedriver yourself" \
         "(the browser tests will skip)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if have sudo && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install_browser: not root and no password-less sudo; run as root:" \
             "apt-get install chromium chromium-driver (the browser tests will skip)"
        exit 0
    fi
fi

install() {
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
        chromium chromium-driver fonts-dejavu-core >/tmp/install_browser.log 2>&1
}

echo "install_browser: installing Debian's chromium and chromium-driver..."
if ! install; then
    echo "install_browser: first attempt failed; running apt-get update and retrying"
    $SUDO apt-get update -q >>/tmp/install_browser.log 2>&1
    if ! install; then
        echo "install_browser: could not install chromium (see /tmp/install_browser.log);" \
             "the browser tests will skip"
        exit 0
    fi
fi
if browser && driver; then
    echo "install_browser: installed $(chromium --version 2>/dev/null | head -n1)"
else
    echo "install_browser: apt-get succeeded but chromium/chromedriver are not on PATH;" \
         "the browser tests will skip"
fi
exit 0
