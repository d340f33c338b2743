# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Build the collection's docsite with antsibull-docs, the tool that builds docs.ansible.com:
the reference of every module, plugin and role from their DOCUMENTATION and argument specs, and
the guides of docs/docsite/rst/ (docs/docsite/extra-docs.yml).

    .venv/bin/python tests/tools/build_docsite.py                # make docs: into .build/docsite
    .venv/bin/python tests/tools/build_docsite.py --dest DIR     # elsewhere (the tests)

The site is .build/docsite/build/html/index.html. The collection is found where ansible.cfg looks
(.build/collections, `make collection`). Offline: the Sphinx project antsibull-docs writes
(`sphinx-init`) links into docs.ansible.com through intersphinx, which cannot be reached here, so
the build runs without it and reads Sphinx's warnings itself: a reference to one of the Ansible
docsite's own labels (`action_plugins`, `common_return_values`, ...) cannot resolve offline and is
let through; any other warning (a broken :ref: of a guide, an unknown label of this collection, an
RST error) fails the build with Sphinx's own words.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
COLLECTION = "zeromib.gpu"
OWN_LABEL = "ansible_collections.zeromib.gpu."
# A guide shows docs/images/X as `.. image:: ../../../docs/images/X`, the repository's own path from
# docs/docsite/rst/ (GitHub renders it); the built guides sit three levels deeper than rst/collections.
IMAGES_IN_BUILD = Path("rst", "collections", "docs", "images")
# A Sphinx warning: "path:line: WARNING: text [type.subtype]" (path and line may be missing).
WARNING = re.compile(r"^(?P<where>.*?)(?::\d+)?: WARNING: (?P<text>.*?)(?: \[(?P<kind>[\w.]+)\])?$")
UNDEFINED_LABEL = re.compile(r"undefined label: '(?P<label>[^']+)'")


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)


def tool_env() -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), ANSIBLE_COLLECTIONS_PATH=str(REPO / ".build" / "collections"),
               ANSIBLE_NOCOLOR="1", NO_COLOR="1")
    return env


def ensure_collection_link() -> None:
    # The link `make collection` makes; antsibull-docs finds the collection through it.
    link = REPO / ".build" / "collections" / "ansible_collections" / "zeromib" / "gpu"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("..", "..", "..", ".."))


# Each role's variable types as its first task checks them (plugins/plugin_utils/_role_spec.py).
ROLE_TYPES = {"free_gpus": "TYPES", "restore_gpus": "RESTORE_TYPES", "slurm_gpu_checks": "SLURM_TYPES"}
# What the documented collection copy leaves out: nothing antsibull-docs reads.
NOT_DOCUMENTED = (".build", ".git", ".venv", "tests", "benchmarks", "__pycache__", "*.pyc", "molecule")


def role_types() -> dict[str, dict[str, dict[str, object]]]:
    """{role: {variable: {type, elements, choices}}}, from _role_spec.py (free_gpus' built from the one
    option table, plugins/module_utils/_options.py), imported through this checkout's .build/collections."""
    sys.path.insert(0, str(REPO / ".build" / "collections"))
    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _role_spec  # pylint: disable=import-outside-toplevel
    return {role: getattr(_role_spec, name) for role, name in ROLE_TYPES.items()}


def typed_spec(spec: dict, types: dict[str, dict[str, object]]) -> dict:
    """A role's argument specs with each `raw` variable typed as the role's first task checks it. The
    role's file says `raw`, so that Ansible's own validation, which runs first, lets the role's
    one-line errors speak; the reference should still say what each variable takes."""
    for entry in (spec.get("argument_specs") or {}).values():
        for name, option in (entry.get("options") or {}).items():
            if option.get("type") == "raw" and name in types:
                option.update(types[name])
    return spec


def typed_collection(dest: Path) -> Path:
    """A copy of the collection for antsibull-docs, its roles' variables typed (typed_spec) -> its collections path."""
    root = dest / "collection"
    target = root / "ansible_collections" / "zeromib" / "gpu"
    shutil.copytree(REPO, target, ignore=shutil.ignore_patterns(*NOT_DOCUMENTED))
    for role, types in role_types().items():
        path = target / "roles" / role / "meta" / "argument_specs.yml"
        path.write_text(yaml.safe_dump(typed_spec(yaml.safe_load(path.read_text()), types), sort_keys=False, width=1000))
    return root


def offending(warnings: list[str]) -> list[str]:
    """The warnings that fail the build: all but the Ansible docsite's own labels, unresolvable
    offline, and a highlighting retry in a plugin's own EXAMPLES (Pygments' YAML+Jinja lexer on
    escaped quotes; the page renders)."""
    bad = []
    for line in warnings:
        match = WARNING.match(line)
        if not match:
            bad.append(line)
            continue
        label = UNDEFINED_LABEL.search(match["text"])
        if label and not label["label"].startswith(OWN_LABEL):
            continue
        if match["kind"] == "misc.highlighting_failure" and "/zeromib/gpu/docsite/" not in match["where"]:
            continue
        bad.append(line)
    return bad


def build(dest: Path) -> Path:
    env = tool_env()
    ensure_collection_link()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    env["ANSIBLE_COLLECTIONS_PATH"] = str(typed_collection(dest))
    steps = [
        ["antsibull-docs", "sphinx-init", "--use-current", "--dest-dir", str(dest), COLLECTION],
    ]
    for cmd in steps:
        proc = run(cmd, REPO, env)
        if proc.returncode != 0:
            raise SystemExit(f"$ {' '.join(cmd)}\n{proc.stdout}")
    with open(dest / "conf.py", "a") as conf:
        conf.write("\n# tests/tools/build_docsite.py: offline, no inventories of other sites to fetch.\nintersphinx_mapping = {}\n")
    rst = dest / "rst"
    rst.chmod(0o755)
    cmd = ["antsibull-docs", "--config-file", "antsibull-docs.cfg", "collection", "--cleanup", "everything", "--use-current",
           "--dest-dir", "rst", COLLECTION]
    proc = run(cmd, dest, env)
    if proc.returncode != 0:
        raise SystemExit(f"$ {' '.join(cmd)}\n{proc.stdout}")
    shutil.copytree(REPO / "docs" / "images", dest / IMAGES_IN_BUILD)
    warnings_file = dest / "sphinx-warnings.txt"
    cmd = ["sphinx-build", "-M", "html", "rst", "build", "-c", ".", "-q", "-w", str(warnings_file)]
    proc = run(cmd, dest, env)
    warnings = [line for line in warnings_file.read_text().splitlines() if " WARNING: " in line or " ERROR: " in line or " CRITICAL: " in line]
    bad = offending(warnings)
    if proc.returncode != 0 or bad:
        raise SystemExit(f"$ {' '.join(cmd)} (in {dest}): rc {proc.returncode}\n" + "\n".join(bad or [proc.stdout]))
    return dest / "build" / "html" / "index.html"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".build" / "docsite")
    index = build(parser.parse_args().dest.resolve())
    print(f"docsite: {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
