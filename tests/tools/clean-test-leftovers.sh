#!/usr/bin/env bash
# What the tests leave outside .build and .venv, removed by `make clean`, and only that:
#   - __pycache__ folders of this checkout (never below a symlink: .venv may be one);
#   - finished pytest temp folders ${TMPDIR:-/tmp}/pytest-of-$USER/pytest-N: pytest itself keeps
#     the last three; one whose .lock names a live process belongs to a running pytest and stays;
#   - ~/.ansible/test (ansible-test's venvs and the get-pip stand-in) when tests/quality/sanity.sh
#     created it (it leaves a marker then), and no ansible-test runs now;
#   - ~/.cache/zeromib-gpu/compat, the compatibility matrix's controller venvs (tests/compat/matrix.py),
#     unless a test run holds its lock now.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

find "$repo" \( -name .git -o -path "$repo/.venv" -o -path "$repo/.build" \) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null

tmp_root="${TMPDIR:-/tmp}/pytest-of-$(id -un)"
if [[ -d "$tmp_root" && ! -L "$tmp_root" ]]; then
  for dir in "$tmp_root"/pytest-*; do
    [[ -d "$dir" && ! -L "$dir" ]] || continue
    pid="$(cat "$dir/.lock" 2>/dev/null || true)"
    if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then continue; fi
    rm -rf "$dir"
  done
  [[ -e "$tmp_root/pytest-current" ]] || rm -f "$tmp_root/pytest-current"
  rmdir "$tmp_root" 2>/dev/null || true
fi

marker="$HOME/.ansible/test/.created-by-zeromib-gpu"
if [[ -f "$marker" ]]; then
  if pgrep -f '[a]nsible-test (sanity|units)' >/dev/null 2>&1; then
    echo "clean: ansible-test is running: ~/.ansible/test kept"
  else
    rm -rf "$HOME/.ansible/test"
    rmdir "$HOME/.ansible" 2>/dev/null || true
  fi
fi
compat="$HOME/.cache/zeromib-gpu/compat"
if [[ -d "$compat" && ! -L "$compat" ]]; then
  if (exec 9>>"$compat/.lock" && flock -n 9); then
    rm -rf "$compat"
    rmdir "$HOME/.cache/zeromib-gpu" 2>/dev/null || true
  else
    echo "clean: a test run builds or uses ~/.cache/zeromib-gpu/compat: kept"
  fi
fi
exit 0
