#!/usr/bin/env bash
# Makes sure Debian's chromium is installed at /usr/bin/chromium: the browser that the widget's
# browser test (tests/browser/test_browser.py) drives through Playwright. We never let Playwright download
# a browser of its own; the distribution's package is the one browser we rely on.
# Idempotent and silent when chromium is already there; installing needs root (apt-get).
set -euo pipefail

CHROMIUM=/usr/bin/chromium

# --missing: the Debian package to install, if any (scripts/ensure-system.sh installs them all
# with one apt-get).
if [[ "${1:-}" == "--missing" ]]; then
    [[ -x "$CHROMIUM" ]] || echo chromium
    exit 0
fi

if [[ -x "$CHROMIUM" ]]; then
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    echo "ensure-chromium: $CHROMIUM is missing and installing it needs root. Run:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends chromium" >&2
    echo "(or run this script as root: sudo scripts/ensure-chromium.sh)" >&2
    exit 1
fi

echo "ensure-chromium: installing Debian's chromium package (for tests/browser/test_browser.py)..." >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes \
    apt-get install -y -qq --no-install-recommends chromium >/dev/null

if [[ ! -x "$CHROMIUM" ]]; then
    echo "ensure-chromium: apt-get installed chromium but $CHROMIUM is still missing" >&2
    exit 1
fi
echo "ensure-chromium: $("$CHROMIUM" --version 2>/dev/null || echo chromium) installed" >&2
