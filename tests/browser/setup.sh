#!/bin/sh
# Installs the browser the dashboard test drives: Debian's chromium package (headless, no Playwright download).
# Run as root (CI image) before the slow tests; does nothing when chromium and the emoji font (the dashboard
# marks alert levels with emoji) are already installed. Without chromium the dashboard test skips (fails if CI=true).
set -eu
if command -v chromium >/dev/null 2>&1 && fc-list 2>/dev/null | grep -qi "noto color emoji"; then
    chromium --version
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core fonts-noto-color-emoji
chromium --version
