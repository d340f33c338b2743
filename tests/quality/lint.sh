#!/usr/bin/env bash
# ansible-lint (production profile, offline) with this collection on Ansible's path.
#
#   tests/quality/lint.sh [extra ansible-lint arguments]
#
# .ansible-lint sets offline: true, so ansible-lint neither installs this collection into its
# cache nor contacts Galaxy; it finds zeromib.gpu through the link `make collection` creates
# (.build/collections/ansible_collections/zeromib/gpu -> the repository root).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${VENV:-$repo/.venv}"
[[ "$venv" = /* ]] || venv="$repo/$venv"
link="$repo/.build/collections/ansible_collections/zeromib/gpu"

[[ -x "$venv/bin/ansible-lint" ]] || { echo "missing $venv/bin/ansible-lint: install requirements-lint.txt" >&2; exit 2; }
if [[ ! -e "$link" ]]; then
  mkdir -p "$(dirname "$link")" && ln -sfn ../../../.. "$link"
fi

cd "$repo" || exit 2
# ansible-lint warns unless the ansible executables it runs are first on PATH.
export PATH="$venv/bin:$PATH"
export ANSIBLE_COLLECTIONS_PATH="$repo/.build/collections"
exec "$venv/bin/ansible-lint" "$@"
