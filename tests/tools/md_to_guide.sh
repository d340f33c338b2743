#!/usr/bin/env bash
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# Convert a Markdown guide (the docs/*.md of before issue 60) into a docsite guide:
#
#   tests/tools/md_to_guide.sh docs/health.md docs/docsite/rst/guide_health.rst
#
# The guides moved to docs/docsite/rst/ while others still edited their Markdown; this script is
# how such an edit is carried over: merge the edit into the old Markdown page, run this on it,
# delete the page again. Every tidy step is in the script (the path renames below) and in its
# pandoc filter (tests/tools/md_to_guide.lua: labels, :ref: links, code blocks, list tables, option
# tables that the reference already holds). What it cannot do, do by hand after it and check with
# `make docs`: wording that names a Markdown file ("this page", "see the README").
# Needs pandoc (Debian: apt-get install -y pandoc; made with 2.17).
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 SRC.md DEST.rst" >&2
    exit 2
fi
src=$1
dest=$2
command -v pandoc >/dev/null || { echo "pandoc is missing: apt-get install -y pandoc" >&2; exit 2; }
[ -f "$src" ] || { echo "no such file: $src" >&2; exit 2; }

repo=$(cd "$(dirname "$0")/../.." && pwd)
source_path=$(realpath --relative-to="$repo" "$src")
guide=$(basename "$dest" .rst)

# Evidence moved next to what made it (issue 60): the real-GPU runs under tests/gpu/results/, the
# measurement history in benchmarks/HISTORY.md. Links to them become links on GitHub (the filter);
# plain mentions of a guide's Markdown file become links, which the filter turns into :ref:.
sed -E \
    -e 's#\]\((docs/)?real-gpu\.md#](../tests/gpu/results/README.md#g' \
    -e 's#\]\((docs/)?real-gpu/#](../tests/gpu/results/#g' \
    -e 's#\]\((docs/)?benchmarks\.md#](../benchmarks/HISTORY.md#g' \
    -e 's#(docs/)?real-gpu\.md#tests/gpu/results/README.md#g' \
    -e 's#docs/real-gpu/#tests/gpu/results/#g' \
    -e 's#(^|[ `([])real-gpu/#\1tests/gpu/results/#g' \
    -e 's#(docs/)?benchmarks\.md#benchmarks/HISTORY.md#g' \
    -e 's#benchmarks/run-20#benchmarks/results/run-20#g' \
    -e 's#benchmarks/changes\.md#benchmarks/results/changes.md#g' \
    -e 's#(^|[ (])docs/(attribution|audit|containers|design|health|restarters|restore_gpus|security|slurm|smoke_test|troubleshooting)\.md#\1[docs/\2.md](\2.md)#g' \
    "$src" |
    # A `|` inside a code span of a table row splits the cell (GFM wants it escaped): escape it.
    awk '/^\|/ { out = ""; code = 0
                  for (i = 1; i <= length($0); i++) {
                      c = substr($0, i, 1)
                      if (c == "`") code = !code
                      if (c == "|" && code && substr($0, i - 1, 1) != "\\") c = "\\|"
                      out = out c }
                  $0 = out } { print }' |
    pandoc -f gfm -t rst --wrap=preserve \
        --lua-filter="$repo/tests/tools/md_to_guide.lua" \
        -M guide="$guide" -M source="$source_path" -M repo="$repo" \
        |
    awk '$0 == "@@md_to_guide:raw-end@@" { blank = 1; next } blank { blank = 0; if ($0 != "") print "" } { print }' >"$dest"
echo "$src -> $dest"
