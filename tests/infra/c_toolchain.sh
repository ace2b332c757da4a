#!/usr/bin/env bash
# Make a C compiler and the test interpreter's Python headers available: the probe compiles its
# small C graph-replay helper on first use (hs_tracer/fingerprint/native.py), and the tests build it.
#
# Idempotent and fast when both are there. Installs Debian's `gcc` and `python3-dev` when missing
# (the headers only help Debian's own python3; another interpreter brings its own).
#
# Usage (as root, or with sudo available):  tests/infra/c_toolchain.sh PYTHON
set -euo pipefail

PYTHON=${1:-python3}
headers() { "$PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; }

if command -v cc >/dev/null 2>&1 && headers; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" != "0" ]; then
    command -v sudo >/dev/null 2>&1 || { echo "c_toolchain.sh: need root or sudo to apt-get install gcc python3-dev" >&2; exit 1; }
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get -y -q install --no-install-recommends gcc python3-dev >/dev/null 2>&1; then
    $SUDO apt-get -q update >/dev/null  # a fresh machine may have no package lists yet
    $SUDO apt-get -y -q install --no-install-recommends gcc python3-dev >/dev/null
fi
command -v cc >/dev/null 2>&1 || { echo "c_toolchain.sh: no cc after installing gcc" >&2; exit 1; }
headers || { echo "c_toolchain.sh: $PYTHON has no Python.h (install its development headers)" >&2; exit 1; }
