# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The collection's docsite as `make docs` builds it (tests/tools/build_docsite.py: antsibull-docs,
then Sphinx, any warning but the offline ones fails the build), looked at in headless Chromium:
the index and a guide render, and no link between the site's pages leads nowhere."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

REPO = Path(__file__).resolve().parents[2]
GUIDES = REPO / "docs" / "docsite" / "rst"
SITE_GUIDES = Path("collections", "zeromib", "gpu", "docsite")
# After each heading: Sphinx's permalink, drawn by the theme's icon font.
HEADER_LINK = "\uf0c1\u00b6"
# The theme's logo links to the web site's root ("/"), which a site opened from files does not have.
SITE_ROOT = "/"


class Page(HTMLParser):
    """The links, anchors and headings of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()
        self.headings: list[str] = []
        self.code_blocks = 0
        self._heading: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {name: value or "" for name, value in attrs}
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for attr in ("href", "src"):
            if a.get(attr) and tag in ("a", "link", "script", "img"):
                self.links.append(a[attr])
        if tag == "div" and "highlight" in a.get("class", "").split():
            self.code_blocks += 1
        if tag in ("h1", "h2"):
            self._heading = []

    def handle_data(self, data: str) -> None:
        if self._heading is not None:
            self._heading.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("h1", "h2") and self._heading is not None:
            self.headings.append(" ".join("".join(self._heading).split()))
            self._heading = None


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    return page


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("docsite")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tools" / "build_docsite.py"), "--dest", str(dest)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, "make docs fails:\n" + proc.stdout[-6000:] + proc.stderr[-6000:]
    return dest / "build" / "html"


def chromium_dom(page: Path) -> str:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.fail("chromium missing: `make deps` (tests/tools/apt-deps.sh test) installs it")
    profile = tempfile.mkdtemp(prefix="zeromib-chromium-")
    try:
        proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                               "--disable-background-networking", "--disable-component-update", "--disable-sync",
                               f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                              capture_output=True, text=True, timeout=120, check=False)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0 and "<body" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout


def guide_title(name: str) -> str:
    """The title of a guide's RST source: the line above the first `====` underline."""
    lines = (GUIDES / f"{name}.rst").read_text().splitlines()
    underline = next(i for i, line in enumerate(lines) if line and set(line) == {"="})
    return lines[underline - 1].replace("``", "")


def test_the_index_lists_every_guide_and_renders_in_chromium(site: Path) -> None:
    dom = parse(chromium_dom(site / "collections" / "zeromib" / "gpu" / "index.html"))
    linked = {Path(urlsplit(link).path).stem for link in dom.links if "docsite/guide_" in link}
    assert linked == {path.stem for path in GUIDES.glob("guide_*.rst")}, linked
    assert any(urlsplit(link).path.endswith("gpu_release_module.html") for link in dom.links), "the reference is listed"
    assert any("Zeromib.Gpu" in heading for heading in dom.headings), dom.headings


def test_a_guide_renders_in_chromium_with_its_sections_and_code(site: Path) -> None:
    dom = parse(chromium_dom(site / SITE_GUIDES / "guide_free.html"))
    assert dom.headings and dom.headings[0].rstrip(HEADER_LINK).strip() == guide_title("guide_free"), dom.headings
    assert len(dom.headings) > 5, dom.headings
    assert dom.code_blocks >= 2, "the guide's code blocks are highlighted"
    assert any(urlsplit(link).path.endswith("free_gpus_role.html") for link in dom.links), "the guide links to the role's reference"


def test_no_link_between_the_sites_pages_leads_nowhere(site: Path) -> None:
    pages = {path: parse(path.read_text(encoding="utf-8")) for path in site.rglob("*.html")}
    assert len(pages) > 20, sorted(pages)
    broken = []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link == SITE_ROOT:
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site)}: {link} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else parse(target.read_text(encoding="utf-8")).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{path.relative_to(site)}: {link} (no such anchor)")
    assert not broken, "\n".join(sorted(set(broken))[:60])


# A single run's clock time ("8 min 44 s", "20:02 UTC") belongs to benchmarks/HISTORY.md.
CLOCK_TIME = re.compile(r"[0-9]+ min [0-9]+ s|[0-9]{2}:[0-9]{2} UTC")
# Where the logs were before they moved next to what made them.
OLD_LOGS = re.compile(r"docs/benchmarks\.md|docs/real-gpu")


def tracked(*paths: str) -> list[Path]:
    listing = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard", "--", *paths], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    return [REPO / name for name in listing.split("\0") if name and (REPO / name).is_file()]


def test_the_readme_and_the_docs_give_no_clock_time_of_a_single_run() -> None:
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}" for path in tracked("README.md", "docs")
             if path.suffix in (".md", ".rst", ".yml")
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if CLOCK_TIME.search(line)]
    assert not found, "figures of single runs go in benchmarks/HISTORY.md:\n" + "\n".join(found)


def test_no_code_or_makefile_points_into_the_old_logs() -> None:
    found = [f"{path.relative_to(REPO)}:{number}" for path in tracked("plugins", "roles", "playbooks", "Makefile")
             for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if OLD_LOGS.search(line)]
    assert not found, "cite benchmarks/HISTORY.md or tests/gpu/results/ by section instead:\n" + "\n".join(found)


# A path into docs/ as code, a role, a playbook or the Makefile writes it (a module's DOCUMENTATION
# shows it to the user as "the collection's C(docs/...)").
DOCS_PATH = re.compile(r"\bdocs/[A-Za-z0-9_./-]*[A-Za-z0-9_/]")


def test_every_docs_path_that_code_names_exists() -> None:
    """A page that moved leaves no pointer behind: each `docs/...` that plugins/, roles/,
    playbooks/ or the Makefile names is a file or folder of the tree."""
    found = [f"{path.relative_to(REPO)}:{number}: {name}" for path in tracked("plugins", "roles", "playbooks", "Makefile")
             for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             for name in DOCS_PATH.findall(line) if not (REPO / name).exists()]
    assert not found, "these name a docs/ path that is not there (the guides: docs/docsite/rst/guide_*.rst):\n" + "\n".join(found)


# What docs/ may hold: what a user reads, and nothing a run left.
DOCSITE_FILES = re.compile(r"docs/docsite/(extra-docs|links)\.yml|docs/docsite/rst/guide_[a-z0-9_]+\.rst|docs/images/[^/]+\.(png|svg|jpg)")
GENERATED = "<!-- Generated by tests/tools/gen_docs.py"


def test_docs_holds_only_the_guides_the_generated_reference_and_images() -> None:
    """A run log, a benchmark table or a hand-kept page under docs/ fails; its place is
    tests/gpu/results/, benchmarks/ or CONTRIBUTING.md. The generated pages carry gen_docs.py's
    mark, and its --check gate keeps them what the code says."""
    other = [str(path.relative_to(REPO)) for path in tracked("docs")
             if not DOCSITE_FILES.fullmatch(str(path.relative_to(REPO)))
             and not (path.parent == REPO / "docs" and path.suffix == ".md" and GENERATED in path.read_text(encoding="utf-8"))]
    assert not other, "docs/ holds the docsite guides, the generated reference and images only:\n" + "\n".join(other)
