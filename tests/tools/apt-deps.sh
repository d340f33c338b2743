#!/usr/bin/env bash
# Debian packages the test rigs need; installs only what is missing, so a warm machine pays ~0.1 s.
set -euo pipefail
want=(mmdebstrap systemd-container openssh-client iproute2 psmisc util-linux prometheus chromium procps shellcheck)
want+=(docker.io podman)  # real container engines for tests/integration/test_container_engines.py (started there, inside namespaces)
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
