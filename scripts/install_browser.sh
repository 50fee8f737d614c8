#!/usr/bin/env bash
# Debian's Chromium and its chromedriver for the browser tests (pytest -m browser) and for
# `trainpilot report --pdf` (scripts/apt_install.sh: idempotent, never fails the caller).
check='{ command -v chromium || command -v chromium-browser || command -v google-chrome; } &&
       { command -v chromedriver || [ -x /usr/lib/chromium/chromedriver ]; }'
exec bash "$(dirname "$0")/apt_install.sh" install_browser "$check" \
    chromium chromium-driver fonts-dejavu-core
