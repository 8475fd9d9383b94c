#!/bin/sh
# Installs the browser the dashboard test drives: Debian's chromium package (headless, no Playwright download).
# Run as root (CI image) before the slow tests; does nothing when chromium is already on PATH.
set -eu
if command -v chromium >/dev/null 2>&1; then
    chromium --version
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
chromium --version
