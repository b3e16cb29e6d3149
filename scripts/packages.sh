#!/usr/bin/env bash
# Installs the Debian packages the C++ build and its tests need (root or sudo); idempotent:
# packages already present are not reinstalled. Used by setup.sh and sanitize.sh.
set -euo pipefail

packages=(build-essential cmake ninja-build pkg-config libfmt-dev libcli11-dev nlohmann-json3-dev
          libopenblas-dev libgtest-dev libgmock-dev libbenchmark-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
