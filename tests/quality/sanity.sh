#!/usr/bin/env bash
# Run ansible-test (sanity, units) on this collection without reaching anything but PyPI.
#
#   tests/quality/sanity.sh [sanity|units|all] [extra ansible-test arguments]
#
# ansible-test insists on a real .../ansible_collections/zeromib/gpu directory (a symlink is
# rejected), so the working tree's files (tracked + untracked-not-ignored, as git sees them) are
# copied to .build/<sanity|units>/ansible_collections/zeromib/gpu first (one copy per command, so
# both can run at once; a lock serialises two runs of the same command). Its --venv mode bootstraps pip
# with a get-pip script from ci-files.testing.ansible.com, which these machines cannot reach; it
# uses ~/.ansible/test/cache/get_pip_<ver>.py if present, so we place a stand-in there that runs
# the pip wheel bundled with ensurepip. Everything else comes from PyPI and is cached in
# ~/.ansible/test/venv (first run ~1-3 min). Warm, pylint dominates: ~45-100 s on 2 shared cores.
#
# Exit status: ansible-test's (for "all": the first failing command's).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${VENV:-$repo/.venv}"
[[ "$venv" = /* ]] || venv="$repo/$venv"
python="$venv/bin/python"
ansible_test="$venv/bin/ansible-test"
py_version="${SANITY_PYTHON:-3.11}"

what="${1:-all}"
[[ $# -gt 0 ]] && shift
case "$what" in
  sanity|units|all) ;;
  *) echo "usage: $0 [sanity|units|all] [ansible-test args]" >&2; exit 2 ;;
esac

for tool in "$python" "$ansible_test"; do
  [[ -x "$tool" ]] || { echo "missing $tool: run 'make deps' first" >&2; exit 2; }
done

prepare_get_pip() {
  local ver cache tmp
  ver="$("$python" -c 'import types
from ansible_test._internal.python_requirements import get_venv_packages
print(get_venv_packages(types.SimpleNamespace(version="'"$py_version"'"))["pip"])')" || return 1
  cache="$HOME/.ansible/test/cache/get_pip_${ver//./_}.py"
  [[ -s "$cache" ]] && return 0
  mkdir -p "$(dirname "$cache")"
  tmp="$(mktemp "$cache.XXXXXX")"
  cat >"$tmp" <<'PY'
"""Offline stand-in for get-pip.py, written by zeromib.gpu tests/quality/sanity.sh.

ansible-test runs this with the arguments it would give get-pip.py (e.g. pip==24.2 --no-setuptools
--no-wheel) inside a fresh venv. We run the pip wheel that ships with ensurepip (Debian keeps its
copy in /usr/share/python-wheels) and let it install the pinned pip from the package index.
"""
import glob
import os
import sys

import ensurepip

wheels = sorted(glob.glob(os.path.join(os.path.dirname(ensurepip.__file__), "_bundled", "pip-*.whl")))
wheels += sorted(glob.glob("/usr/share/python-wheels/pip-*.whl"))
if not wheels:
    sys.exit("get-pip stand-in: no bundled pip wheel found for %s" % sys.executable)
sys.path.insert(0, wheels[-1])

from pip._internal.cli.main import main  # noqa: E402

args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.exit(main(["install", "--upgrade", "--force-reinstall"] + args))
PY
  mv -f "$tmp" "$cache"
  echo "sanity.sh: wrote get-pip stand-in $cache"
}

copy_tree() {
  # A fresh copy each time, so files deleted or renamed in the working tree do not linger; only
  # tests/output survives: it holds ansible-test's delegation venv (~8 s to rebuild) and results.
  mkdir -p "$dest/tests"
  find "$dest" -mindepth 1 -maxdepth 1 ! -name tests -exec rm -rf {} +
  find "$dest/tests" -mindepth 1 -maxdepth 1 ! -name output -exec rm -rf {} +
  (cd "$repo" && git ls-files -z -co --exclude-standard \
     | while IFS= read -r -d '' f; do [[ -e "$f" || -L "$f" ]] && printf '%s\0' "$f"; done \
     | tar --null -T - -cf -) | tar -xf - -C "$dest" || return 1
  # ansible-test lists content with git from the nearest .git upwards; without a repository of
  # its own the copy would be seen through /work/main's, where .build/ is ignored: zero targets.
  git -C "$dest" init -q
}

run() (
  local command="$1"
  shift
  dest="$repo/.build/$command/ansible_collections/zeromib/gpu"
  mkdir -p "$dest"
  exec 9>"$repo/.build/$command.lock"
  flock 9
  copy_tree || { echo "sanity.sh: could not copy the working tree to $dest" >&2; exit 2; }
  cd "$dest" || exit 2
  echo "+ (cd ${dest#"$repo"/} && ansible-test $command --python $py_version --venv $*)" >&2
  "$ansible_test" "$command" --python "$py_version" --venv "$@"
)

# `make clean` removes ~/.ansible/test only when this script created it (the marker says so).
[[ -d "$HOME/.ansible/test" ]] || { mkdir -p "$HOME/.ansible/test" && touch "$HOME/.ansible/test/.created-by-zeromib-gpu"; }
prepare_get_pip || { echo "sanity.sh: could not prepare the get-pip stand-in" >&2; exit 2; }

rc=0
if [[ "$what" = sanity || "$what" = all ]]; then
  run sanity "$@" || rc=$?
fi
if [[ "$what" = units || "$what" = all ]]; then
  run units "$@" || { r=$?; [[ $rc -ne 0 ]] || rc=$r; }
fi
exit "$rc"
