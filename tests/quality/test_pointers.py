# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Every pointer a reader follows leads somewhere (issue 67): each repository path, docs page,
section and reference that README.md, CONTRIBUTING.md, the guides (docs/docsite/rst), the
generated pages (docs/*.md) and ansible-doc (the modules' DOCUMENTATION, the doc fragments, the
roles' argument specs) name exists; ansible-doc's SEE ALSO points where the collection is
published, and no R() reads as a bare word without its target. User pages carry no project
history: what a reader needs is what is true now, not which issue changed it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
GUIDES = sorted((REPO / "docs" / "docsite" / "rst").glob("*.rst"))
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *GUIDES, *sorted((REPO / "docs").glob("*.md"))]
# What ansible-doc shows: the modules', the doc fragments' and the filters' documentation, the roles' argument specs.
DOC_SOURCES = [*sorted((REPO / "plugins" / "modules").glob("*.py")), *sorted((REPO / "plugins" / "doc_fragments").glob("*.py")),
               *sorted((REPO / "plugins" / "filter").glob("*.yml")), *sorted((REPO / "roles").glob("*/meta/argument_specs.yml"))]
# Pages a user reads (CONTRIBUTING.md is the developers', and may say where the code came from).
USER_PAGES = [REPO / "README.md", *GUIDES, *sorted((REPO / "docs").glob("*.md")), *DOC_SOURCES]
REPOSITORY = yaml.safe_load((REPO / "galaxy.yml").read_text())["repository"].rstrip("/")

TOP = r"(?:plugins|roles|tests|docs|playbooks|benchmarks|changelogs|meta|tasks|defaults|templates|files|\.github)"
PATH = re.compile(r"(?<![\w/.~$:-])(" + TOP + r"/[\w.*@-]+(?:/[\w.*@-]+)*)")
# Made by a run, or a placeholder of the page's own (docs/X.md).
NOT_IN_GIT = re.compile(r"(^tests/output|__pycache__|(^|/)X\b|_X\b|^tests/sanity\b)")
# R(text, ref): Ansible splits at the first comma, so a text with a comma leaves a ref that is no label.
REF = re.compile(r":ref:`(?:[^`<]*<)?([\w.-]+)>?`|\bR\(([^,()]+),\s*([^()]+?)\)")
SECTION = re.compile(r"\b(README(?:\.md)?|CONTRIBUTING(?:\.md)?|HISTORY\.md|guide_\w+\.rst|the (\w+) guide)(?:'s)?,? (?:section )?"
                     r"[\"\u201c]([^\"\u201d]+)[\"\u201d]")
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A link's text that says nothing where ansible-doc prints it without its target.
BARE = {"details", "why", "here", "more", "see", "this", "link"}
HISTORY = re.compile(r"\b(?:issues? \d+|before issue|since issue|since \d{4}-\d\d-\d\d)\b", re.I)


def text_of(path: Path) -> str:
    """What a reader sees of PATH: a module or fragment's DOCUMENTATION (and EXAMPLES, RETURN), or the file."""
    if path.suffix != ".py":
        return path.read_text()
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            found += [n.value.value for n in node.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                      and isinstance(n.value.value, str)]
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in ("DOCUMENTATION", "EXAMPLES", "RETURN"):
            found.append(node.value.value)
    return "\n".join(found)


def documentation(path: Path) -> str:
    return next(node.value.value for node in ast.parse(path.read_text()).body
                if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "DOCUMENTATION")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def exists(named: str) -> bool:
    """A repository path (globs allowed), or one of a role's own (meta/argument_specs.yml, tasks/drain.yml)."""
    own = named.split("/")[0] in ("meta", "tasks", "defaults", "templates", "files")
    roots = [REPO] + ([p for p in (REPO / "roles").iterdir() if p.is_dir()] if own else [])
    return any(list(root.glob(named)) if "*" in named else (root / named).exists() for root in roots)


def rst_headings(text: str) -> list[str]:
    lines = text.splitlines()
    return [lines[i].strip() for i in range(len(lines) - 1)
            if lines[i].strip() and re.fullmatch(r"([=\-~^\"'`#*+])\1{2,}", lines[i + 1].strip() or "x") and len(lines[i + 1].strip()) >= len(lines[i].strip())]


def md_headings(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)]


def headings(path: Path) -> list[str]:
    text = path.read_text()
    return rst_headings(text) if path.suffix == ".rst" else md_headings(text)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")


def labels() -> set[str]:
    """Every target a :ref: or R() may name: the guides' labels, and antsibull-docs' pages of the plugins and roles."""
    found = {m.group(1) for guide in GUIDES for m in re.finditer(r"^\.\. _([\w.-]+):\s*$", guide.read_text(), re.M)}
    found |= {f"ansible_collections.zeromib.gpu.{p.stem}_module" for p in (REPO / "plugins" / "modules").glob("*.py")}
    found |= {f"ansible_collections.zeromib.gpu.{p.name}_role" for p in (REPO / "roles").iterdir() if p.is_dir()}
    found |= {f"ansible_collections.zeromib.gpu.{p.stem}_filter" for p in (REPO / "plugins" / "filter").glob("*.yml")}
    return found


def section_file(match: re.Match) -> Path:
    named, guide = match.group(1), match.group(2)
    if guide:
        return REPO / "docs" / "docsite" / "rst" / f"guide_{guide}.rst"
    if named.startswith("README"):
        return REPO / "README.md"
    if named.startswith("CONTRIBUTING"):
        return REPO / "CONTRIBUTING.md"
    if named == "HISTORY.md":
        return REPO / "benchmarks" / "HISTORY.md"
    return REPO / "docs" / "docsite" / "rst" / named


@pytest.mark.parametrize("page", PAGES + DOC_SOURCES, ids=rel)
def test_every_repository_path_a_page_names_exists(page):
    text = text_of(page)
    missing = sorted({m.group(1).rstrip(".,:;") for m in PATH.finditer(text)
                      if not NOT_IN_GIT.search(m.group(1)) and not exists(m.group(1).rstrip(".,:;"))})
    assert not missing, f"{rel(page)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES + DOC_SOURCES, ids=rel)
def test_every_reference_and_section_a_page_names_exists(page):
    text = text_of(page)
    known = labels()
    dangling = [m.group(1) or m.group(3) for m in REF.finditer(text) if (m.group(1) or m.group(3)) not in known]
    assert not dangling, f"{rel(page)}: references to no label: {dangling}"
    bare = [m.group(0) for m in REF.finditer(text) if m.group(2) and m.group(2).strip().lower() in BARE]
    assert not bare, f"{rel(page)}: ansible-doc prints these as a bare word, without their target: {bare}"
    for m in SECTION.finditer(text):
        target = section_file(m)
        assert target.exists(), f"{rel(page)}: {m.group(0)} names {rel(target)}, which does not exist"
        assert m.group(3) in headings(target), f"{rel(page)}: {m.group(0)}: {rel(target)} has no such section; its sections: {headings(target)}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.suffix == ".md"], ids=rel)
def test_every_markdown_link_leads_to_a_file_and_section_that_exist(page):
    for m in MD_LINK.finditer(page.read_text()):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        path, _hash, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{rel(page)} links to {target}: no such file"
        if anchor and file.suffix == ".md":
            assert anchor in {slug(h) for h in headings(file)}, f"{rel(page)} links to {target}: {rel(file)} has no such section"
        elif anchor and file.suffix == ".rst":
            assert re.search(rf"^\.\. _[\w.-]*\.{re.escape(anchor)}:\s*$", file.read_text(), re.M), f"{rel(page)} links to {target}: no such label"


@pytest.mark.parametrize("source", [p for p in DOC_SOURCES if p.parent.name == "modules"], ids=rel)
def test_see_also_points_where_the_collection_is_published(source):
    """ansible-doc turns a `ref:` into a search of docs.ansible.com, where this collection is not published;
    a `link:` into the repository (galaxy.yml's) names a file that exists; a `module:` is one of the collection's."""
    doc = yaml.safe_load(documentation(source))
    for entry in doc.get("seealso") or []:
        assert "ref" not in entry, f"{rel(source)}: seealso {entry}: ansible-doc shows a docs.ansible.com search for it"
        if "module" in entry:
            name = entry["module"].rsplit(".", 1)[-1]
            assert not entry["module"].startswith("zeromib.gpu.") or (REPO / "plugins" / "modules" / f"{name}.py").exists(), entry
        if "link" in entry:
            assert "docs.ansible.com" not in entry["link"] or "zeromib" not in entry["link"], entry
            if entry["link"].startswith(REPOSITORY + "/blob/main/"):
                assert exists(entry["link"][len(REPOSITORY + "/blob/main/"):].split("#")[0]), entry


@pytest.mark.parametrize("page", USER_PAGES, ids=rel)
def test_user_pages_carry_no_project_history(page):
    said = [line.strip() for line in text_of(page).splitlines() if HISTORY.search(line)]
    assert not said, f"{rel(page)} tells the project's history (say what is true now): {said}"


@pytest.mark.parametrize("page", sorted((REPO / "docs").glob("*.md")), ids=rel)
def test_generated_pages_link_what_ansible_doc_references(page):
    """tests/tools/gen_docs.py renders R(text, ref) as a link to the guide's section or the page (was `text, ref` in a code span)."""
    dead = re.findall(r"`[^`]*ansible_collections\.zeromib[^`]*`", page.read_text())
    assert not dead, f"{rel(page)}: references rendered as text: {dead[:3]}"


# The plugins a role or playbook of the collection runs for itself: ansible-doc lists them beside the public modules.
INTERNAL = ("free_gpus_gate", "free_gpus_verdict", "free_gpus_summary", "gpu_audit_report", "role_variables_check")


@pytest.mark.parametrize("source", [p for p in DOC_SOURCES if p.parent.name == "modules"], ids=rel)
def test_internal_modules_say_so_where_ansible_doc_lists_them(source):
    doc = yaml.safe_load(documentation(source))
    internal = source.stem in INTERNAL
    assert doc["short_description"].startswith("Internal (") is internal, doc["short_description"]
    assert doc["description"][0].startswith("B(Internal to the collection)") is internal, doc["description"][0]
