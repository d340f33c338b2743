#!/usr/bin/env bash
# Debian packages the rigs need, installed only when missing (a warm machine pays ~0.1 s).
#
#   tests/tools/apt-deps.sh demo    what `make demo` uses: the systemd-nspawn fleet (mmdebstrap,
#                                   systemd-nspawn, ssh, ip, unshare)
#   tests/tools/apt-deps.sh --list demo|test   print the packages of a set, install nothing
#   tests/tools/apt-deps.sh test    the demo's, plus what `make test` adds: shellcheck (ansible-test
#                                   sanity), chromium (the audit report's heat map, headless), and
#                                   promtool (the .prom file), taken out of Debian's prometheus
#                                   package into .build/tools/bin: no prometheus service is installed
#
# Installing a package must never leave a service enabled or running on this machine: starts are
# refused while apt runs (policy-rc.d), and any unit a package enabled is disabled again. Every
# package this script installed is listed in /var/lib/zeromib-gpu/apt-installed.txt.
set -euo pipefail

list_only=""
if [[ "${1:-}" = --list ]]; then list_only=1; shift; fi
set_name="${1:-test}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
demo=(mmdebstrap systemd-container openssh-client iproute2 util-linux procps tar)
case "$set_name" in
  demo) want=("${demo[@]}") ;;
  # docker.io and podman: real container engines for tests/integration/test_container_engines.py
  # (started there, inside namespaces; their units are disabled again below).
  # gcc and libc6-dev: the fake libcuda.so.1 of the smoke-test tests (tests/sim/fake_libcuda.c).
  test) want=("${demo[@]}" psmisc shellcheck chromium docker.io podman gcc libc6-dev) ;;
  *) echo "usage: $0 demo|test" >&2; exit 2 ;;
esac

if [[ -n "$list_only" ]]; then
  printf '%s\n' "${want[@]}"
  [[ "$set_name" != test ]] || echo "promtool (from prometheus, unpacked; the package is not installed)"
  exit 0
fi

record=/var/lib/zeromib-gpu/apt-installed.txt
wants_links() { find /etc/systemd/system \( -path '*.wants/*' -o -path '*.requires/*' \) 2>/dev/null | sort; }

apt_install() {
  local before after policy=/usr/sbin/policy-rc.d had_policy=""
  export DEBIAN_FRONTEND=noninteractive
  before="$(wants_links)"
  if [[ -e "$policy" ]]; then
    had_policy=1
    mv "$policy" "$policy.zeromib-saved"
  fi
  printf '#!/bin/sh\n# zeromib.gpu tests/tools/apt-deps.sh: no service starts while it installs packages\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  local rc=0
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } || rc=$?
  rm -f "$policy"
  [[ -z "$had_policy" ]] || mv "$policy.zeromib-saved" "$policy"
  [[ $rc -eq 0 ]] || return "$rc"
  mkdir -p "$(dirname "$record")"
  printf '%s\n' "$@" >>"$record"
  # A unit that a package enabled (prometheus.service would be) is disabled again.
  after="$(wants_links)"
  local link unit
  while IFS= read -r link; do
    [[ -n "$link" ]] || continue
    unit="$(basename "$link")"
    echo "apt-deps: disabling $unit, which a package enabled"
    systemctl disable --quiet "$unit" 2>/dev/null || rm -f "$link"
  done < <(comm -13 <(printf '%s\n' "$before") <(printf '%s\n' "$after"))
}

missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "installing Debian packages: ${missing[*]}"
  apt_install "${missing[@]}"
fi

if [[ "$set_name" = test ]]; then
  # promtool alone, from Debian's prometheus package, unpacked into .build/tools/bin (on PATH
  # for the tests through tests/conftest.py); the package itself, and its service, stay out.
  tools="$repo/.build/tools/bin"
  if [[ ! -x "$tools/promtool" ]] && ! command -v promtool >/dev/null; then
    echo "unpacking promtool from Debian's prometheus package into ${tools#"$repo"/}"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    (cd "$tmp" && { apt-get download -qq prometheus 2>/dev/null \
                    || { apt-get update -qq && apt-get download -qq prometheus 2>/dev/null; }; })
    mkdir -p "$tmp/x" "$tools"
    dpkg-deb --fsys-tarfile "$tmp"/prometheus_*.deb | tar -x -C "$tmp/x" ./usr/bin/promtool
    mv "$tmp/x/usr/bin/promtool" "$tools/promtool"
  fi
fi
