"""Quality gates of zeromib.gpu: each test runs one tool over the collection and wants rc 0.

Run with `.venv/bin/pytest tests/quality` after `make deps` (requirements-dev.txt and
requirements-lint.txt in .venv). Everything runs offline except ansible-test, which fills its
venvs in ~/.ansible/test/venv from PyPI on first use. On failure the tool's own output is shown.
See CONTRIBUTING.md, "The gates", for what each gate checks and how to run it by hand.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUALITY = REPO / "tests" / "quality"
VENV = Path(sys.prefix)
BIN = VENV / "bin"
COLLECTION = "zeromib.gpu"
COLLECTIONS_PATH = REPO / ".build" / "collections"
COLLECTION_LINK = COLLECTIONS_PATH / "ansible_collections" / "zeromib" / "gpu"

# Generous: a cold ansible-test run builds a dozen venvs from PyPI on two shared cores.
ANSIBLE_TEST_TIMEOUT = 1800
TOOL_TIMEOUT = 600

# pip chatter from ansible-test's venv bootstrap, dropped from failure reports.
PIP_NOISE = re.compile(
    r"^(Looking in (indexes|links)|WARNING: Location '.*' is ignored|Collecting |\s+Downloading |"
    r"Processing /|\s*\u2501|Installing collected packages|Successfully installed|"
    r"Using cached pip|Requirement already satisfied)"
)

# plugins/<dir> -> ansible-doc type, for the plugin types ansible-doc documents.
DOC_TYPES = {
    "modules": "module",
    "filter": "filter",
    "test": "test",
    "lookup": "lookup",
    "callback": "callback",
    "inventory": "inventory",
    "connection": "connection",
    "become": "become",
    "cache": "cache",
    "vars": "vars",
    "strategy": "strategy",
}
# Filter and test files may hold several plugins, documented in sidecar YAML files.
MULTI_PLUGIN_TYPES = {"filter", "test"}

# Never in the built collection, whatever galaxy.yml's build_ignore says.
FORBIDDEN_IN_TARBALL = (".venv/", ".build/", "tests/output/", ".git/", ".ansible/", "collections/", ".pytest_cache/", ".hypothesis/")


def tool_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VENV=str(VENV),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        ANSIBLE_COLLECTIONS_PATH=str(COLLECTIONS_PATH),
        ANSIBLE_NOCOLOR="1",
        NO_COLOR="1",
        PY_COLORS="0",
    )
    return env


def run_tool(cmd: list[str], timeout: int = TOOL_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        cwd=REPO,
        env=tool_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )


def readable(output: str) -> str:
    return "\n".join(line for line in output.splitlines() if not PIP_NOISE.match(line))


def require_rc0(result: subprocess.CompletedProcess[str], what: str) -> None:
    if result.returncode != 0:
        command = " ".join(str(part) for part in result.args)
        pytest.fail(f"{what} failed (rc {result.returncode})\n$ {command}\n{readable(result.stdout)}", pytrace=False)


def ensure_collection_link() -> None:
    # The same link `make collection` creates; ansible-doc and ansible-lint find zeromib.gpu here.
    if not COLLECTION_LINK.exists():
        COLLECTION_LINK.parent.mkdir(parents=True, exist_ok=True)
        COLLECTION_LINK.symlink_to(Path("..", "..", "..", ".."))


def working_tree_files() -> set[str]:
    listing = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return {name for name in listing.stdout.split("\0") if name}


def documented_on_disk(doc_type: str, directory: Path) -> set[str]:
    """Names ansible-doc must list for one plugin directory, judged from its files alone."""
    names = set()
    for path in directory.iterdir():
        if path.name.startswith("_") or not path.is_file():
            continue
        if doc_type in MULTI_PLUGIN_TYPES:
            documented = path.suffix in (".yml", ".yaml") or (
                path.suffix == ".py" and "DOCUMENTATION" in path.read_text(encoding="utf-8")
            )
        else:
            documented = path.suffix == ".py"
        if documented:
            names.add(f"{COLLECTION}.{path.stem}")
    return names


def doc_targets() -> list[tuple[str, set[str]]]:
    targets = []
    for directory, doc_type in DOC_TYPES.items():
        path = REPO / "plugins" / directory
        if path.is_dir():
            targets.append((doc_type, documented_on_disk(doc_type, path)))
    roles = REPO / "roles"
    if roles.is_dir():
        targets.append(("role", {f"{COLLECTION}.{path.name}" for path in roles.iterdir() if path.is_dir()}))
    return targets


# The two ansible-test runs in one xdist worker, one after the other (tests/conftest.py): each keeps
# a core busy (pylint; units), so side by side they would only slow each other and every test beside
# them. units runs on one xdist worker of its own (--num-workers 1, not ansible-test's `-n auto`): the
# same tests in the same environment, each still in a fork of its own, but each of its three
# contexts collected once instead of once per core - 43.2 s of CPU against 56.6 s (47.2 s of wall
# against 37.8 s, beside the suite's other workers; 2026-12-04, tests/quality/sanity.sh units).
ANSIBLE_TEST = pytest.mark.xdist_group("ansible-test")


@ANSIBLE_TEST
def test_sanity() -> None:
    """ansible-test sanity, every test that applies (tests/quality/sanity.sh)."""
    require_rc0(run_tool([str(QUALITY / "sanity.sh"), "sanity", "--color", "no"], ANSIBLE_TEST_TIMEOUT), "ansible-test sanity")


@ANSIBLE_TEST
def test_units() -> None:
    """ansible-test units over tests/unit in ansible-test's own venv (tests/quality/sanity.sh)."""
    require_rc0(run_tool([str(QUALITY / "sanity.sh"), "units", "--color", "no", "--num-workers", "1"], ANSIBLE_TEST_TIMEOUT), "ansible-test units")


def test_ansible_lint_production_profile() -> None:
    """ansible-lint with .ansible-lint (profile: production, offline)."""
    require_rc0(run_tool([str(QUALITY / "lint.sh"), "--nocolor"]), "ansible-lint")


def test_changelog_fragments_lint() -> None:
    """antsibull-changelog lint over changelogs/fragments and changelogs/changelog.yaml."""
    require_rc0(run_tool([str(BIN / "antsibull-changelog"), "lint"]), "antsibull-changelog lint")
    require_rc0(
        run_tool([str(BIN / "antsibull-changelog"), "lint-changelog-yaml", "changelogs/changelog.yaml"]),
        "antsibull-changelog lint-changelog-yaml",
    )


def test_antsibull_docs_lint_collection_docs() -> None:
    """antsibull-docs lint-collection-docs, as docs.ansible.com's build would judge the collection:
    every plugin's and role's documentation renders (--plugin-docs), and the docsite guides
    (docs/docsite/extra-docs.yml, links.yml, rst/) are valid RST whose labels and references to
    this collection's plugins resolve (--check-extra-docs-refs)."""
    ensure_collection_link()
    require_rc0(run_tool([str(BIN / "antsibull-docs"), "lint-collection-docs", "--plugin-docs", "--check-extra-docs-refs", "."]),
                "antsibull-docs lint-collection-docs")


def test_generated_doc_pages_match_the_module_and_role_docs() -> None:
    """docs/gpu_*.md, docs/slurm_node.md and docs/free_gpus.md are tests/tools/gen_docs.py's output:
    a page edited by hand (or a module's doc edited without the page) fails here."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tools" / "gen_docs.py"), "--check"], capture_output=True, text=True,
                          check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


DOC_TARGETS = doc_targets()


@pytest.mark.parametrize(("doc_type", "on_disk"), DOC_TARGETS, ids=[doc_type for doc_type, _names in DOC_TARGETS])
def test_ansible_doc_renders_every_plugin_and_role(doc_type: str, on_disk: set[str]) -> None:
    """ansible-doc lists every documented plugin/role found on disk, and renders each of them."""
    ensure_collection_link()
    listing = run_tool([str(BIN / "ansible-doc"), "-t", doc_type, "--list", COLLECTION, "--json"])
    require_rc0(listing, f"ansible-doc -t {doc_type} --list")
    listed = set(json_object(listing.stdout))
    missing = sorted(on_disk - listed)
    assert not missing, f"on disk but not listed by ansible-doc -t {doc_type} (does it load?): {missing}\n{listing.stdout}"
    if not listed:
        pytest.skip(f"no {doc_type} in {COLLECTION} yet")
    require_rc0(run_tool([str(BIN / "ansible-doc"), "-t", doc_type, *sorted(listed)]), f"ansible-doc -t {doc_type}")


def json_object(output: str) -> dict[str, object]:
    # ansible-doc may print warnings before the JSON document.
    return json.loads(output[output.index("{"):])


def test_galaxy_build_ships_only_working_tree_files(tmp_path: Path) -> None:
    """ansible-galaxy collection build succeeds; the tarball holds no build, venv or test output."""
    build = run_tool([str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(tmp_path)])
    require_rc0(build, "ansible-galaxy collection build")
    (tarball,) = tmp_path.glob("zeromib-gpu-*.tar.gz")
    with tarfile.open(tarball) as archive:
        members = [member.name for member in archive.getmembers() if not member.isdir()]

    problems = []
    forbidden = sorted(name for name in members if name.startswith(FORBIDDEN_IN_TARBALL) or "__pycache__/" in name)
    if forbidden:
        problems.append(f"{len(forbidden)} files that must not ship (add them to build_ignore in galaxy.yml)")
        problems.extend(f"  {name}" for name in forbidden[:40])
    # Anything else that git ignores is local state too (generated reports, caches).
    strays = sorted(set(members) - set(forbidden) - working_tree_files() - {"MANIFEST.json", "FILES.json"})
    if strays:
        problems.append(f"{len(strays)} files in the tarball that git ignores or does not see")
        problems.extend(f"  {name}" for name in strays[:40])
    if problems:
        pytest.fail(f"{tarball.name}:\n" + "\n".join(problems), pytrace=False)


# What the built tarball may hold (fnmatch globs; `*` also crosses `/`), and what it must hold.
TARBALL_ALLOWED = (
    "MANIFEST.json", "FILES.json", "README.md", "COPYING",
    "meta/runtime.yml", "meta/execution-environment.yml", "meta/ee-requirements.txt",
    "plugins/*.py", "plugins/filter/*.yml", "plugins/test/*.yml",
    "roles/free_gpus/defaults/*.yml", "roles/free_gpus/meta/*.yml", "roles/free_gpus/tasks/*.yml",
    "roles/free_gpus/templates/*", "roles/free_gpus/handlers/*.yml", "roles/free_gpus/vars/*.yml",
    "roles/restore_gpus/defaults/*.yml", "roles/restore_gpus/meta/*.yml", "roles/restore_gpus/tasks/*.yml",
    "roles/slurm_gpu_checks/defaults/*.yml", "roles/slurm_gpu_checks/meta/*.yml", "roles/slurm_gpu_checks/tasks/*.yml",
    "roles/slurm_gpu_checks/handlers/*.yml", "roles/slurm_gpu_checks/templates/*.j2", "roles/slurm_gpu_checks/files/pack_runner.py",
    "playbooks/*.yml", "playbooks/tasks/templates/*.j2",
    "docs/*.md", "docs/images/*.png", "docs/docsite/*.yml", "docs/docsite/rst/*.rst",
    "changelogs/changelog.yaml", "changelogs/config.yaml", "CHANGELOG.rst",
)
TARBALL_REQUIRED = (
    "MANIFEST.json", "FILES.json", "README.md", "COPYING", "meta/runtime.yml", "meta/execution-environment.yml",
    "plugins/modules/gpu_facts.py", "plugins/modules/gpu_release.py", "plugins/filter/free_gpus.py",
    "plugins/filter/fleet_query.py", "roles/free_gpus/tasks/main.yml", "roles/free_gpus/meta/argument_specs.yml",
    "playbooks/free_gpus.yml", "playbooks/audit_gpus.yml", "playbooks/example_training.yml",
    "plugins/modules/gpu_restore.py", "roles/restore_gpus/tasks/main.yml", "roles/restore_gpus/meta/argument_specs.yml",
    "playbooks/restore_gpus.yml",
    "roles/slurm_gpu_checks/tasks/main.yml", "roles/slurm_gpu_checks/files/pack_runner.py", "plugins/module_utils/_slurm/_jobcheck.py",
    "docs/gpu_release.md", "changelogs/changelog.yaml",
    "docs/docsite/extra-docs.yml", "docs/docsite/links.yml", "docs/docsite/rst/guide_free.rst",
)


def built_tarball_members(out: Path) -> list[str]:
    build = run_tool([str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(out)])
    require_rc0(build, "ansible-galaxy collection build")
    (tarball,) = out.glob("zeromib-gpu-*.tar.gz")
    with tarfile.open(tarball) as archive:
        return sorted(member.name for member in archive.getmembers() if not member.isdir())


def test_galaxy_tarball_holds_the_collection_and_its_docs_only(tmp_path: Path) -> None:
    """galaxy.yml's build_ignore, judged by an allow-list: no raw run logs, benchmark outputs,
    test rigs, Molecule scenarios, changelog fragments or build set-up in the tarball, and
    every file a user needs is there."""
    members = built_tarball_members(tmp_path)
    stray = [name for name in members if not any(fnmatchcase(name, pattern) for pattern in TARBALL_ALLOWED)]
    missing = [name for name in TARBALL_REQUIRED if name not in members]
    assert not stray, "files that must not ship (add them to build_ignore in galaxy.yml):\n  " + "\n  ".join(stray)
    assert not missing, f"files the tarball must hold: {missing}"
    # Every plugin and role file git knows ships (build_ignore must not drop one by accident).
    shipped = {name for name in working_tree_files() if name.startswith(("plugins/", "roles/free_gpus/", "roles/slurm_gpu_checks/", "playbooks/"))
               and "/molecule/" not in name and not name.endswith(".pyc")}
    assert shipped <= set(members), sorted(shipped - set(members))


def test_execution_environment_definition_builds_a_context(tmp_path: Path) -> None:
    """ansible-builder create (schema version 3, context only, no image): execution-environment.yml
    is valid and its context installs requirements.txt's ansible-core, jmespath and this collection;
    the collection's meta/execution-environment.yml gives any EE that installs it jmespath."""
    ensure_collection_link()
    context = tmp_path / "context"
    require_rc0(run_tool([str(BIN / "ansible-builder"), "create", "-f", "execution-environment.yml", "-c", str(context),
                          "--output-filename", "Containerfile"]), "ansible-builder create")
    containerfile = (context / "Containerfile").read_text()
    core_pin = next(line for line in (REPO / "requirements.txt").read_text().splitlines() if line.startswith("ansible-core=="))
    assert core_pin in containerfile, f"the EE must install {core_pin}"
    assert "jmespath" in (context / "_build" / "requirements.txt").read_text()
    assert "zeromib/gpu" in (context / "_build" / "requirements.yml").read_text()
    introspect = run_tool([str(BIN / "ansible-builder"), "introspect", "--sanitize", str(COLLECTIONS_PATH)])
    require_rc0(introspect, "ansible-builder introspect")
    assert "jmespath>=1.0  # from collection zeromib.gpu" in introspect.stdout, introspect.stdout
