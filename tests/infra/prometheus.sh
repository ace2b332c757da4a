#!/usr/bin/env bash
# Make Debian's `prometheus` (server + promtool) and `prometheus-alertmanager` (alertmanager +
# amtool) packages available for the tests.
#
# Idempotent and fast when already installed (one `command -v`). The packaged systemd/init service
# is never started (a temporary policy-rc.d forbids it during the install, and it is stopped and
# disabled should it be running anyway): tests start their own prometheus process with a private
# config and storage directory on a free port (tests/infra/prom.py).
#
# Usage (as root, or with sudo available):  tests/infra/prometheus.sh
set -euo pipefail

PACKAGES="prometheus prometheus-alertmanager"
installed() {
    command -v prometheus && command -v promtool && command -v prometheus-alertmanager && command -v amtool
}
if installed >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" != "0" ]; then
    command -v sudo >/dev/null 2>&1 || { echo "prometheus.sh: need root or sudo to apt-get install prometheus" >&2; exit 1; }
    SUDO="sudo"
fi

POLICY=/usr/sbin/policy-rc.d
CREATED_POLICY=0
if [ ! -e "$POLICY" ]; then
    # Debian's convention for "do not start services from maintainer scripts" (exit 101 = forbidden).
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 0755 "$POLICY"
    CREATED_POLICY=1
fi
cleanup() { if [ "$CREATED_POLICY" = 1 ]; then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get -y -q install --no-install-recommends $PACKAGES >/dev/null 2>&1; then
    # A fresh machine may have no package lists yet.
    $SUDO apt-get -q update >/dev/null
    $SUDO apt-get -y -q install --no-install-recommends $PACKAGES >/dev/null
fi

# Should a service manager have started the packaged daemons anyway, stop them: they would hold
# :9090 and :9093 and watch nothing useful.
for service in prometheus prometheus-alertmanager; do
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$service" 2>/dev/null; then
        $SUDO systemctl stop "$service" || true
        $SUDO systemctl disable "$service" >/dev/null 2>&1 || true
    fi
done

installed >/dev/null
echo "prometheus.sh: $(prometheus --version 2>&1 | head -n1); $(prometheus-alertmanager --version 2>&1 | head -n1)"
