"""The README and the documentation site: short enough to read, links that stay in the repository, a site that builds.

The README is held to what a newcomer reads in five minutes: under 1,200 words of prose outside code blocks and no
paragraph over 120 words, counted as the project's check counts them (``` blocks stripped, whitespace-separated
words). Every Markdown link of the README and of docs/ is relative and resolves (a file, and a heading's GitHub
anchor where one is named). The site (mkdocs.yml, `make docs`) builds with every warning an error, renders the API
reference from the docstrings, and fails on a broken link, a broken anchor, an unresolved cross-reference and a
docstring that does not parse; those four builds are slow and run with ``pytest -m slow``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MARKDOWN = [README, *sorted(DOCS.rglob("*.md"))]

LINK = re.compile(r"!?\[(?:[^\]]|\][^(])*?\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.DOTALL)


def paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", prose(text)) if p.strip()]


def github_slug(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = prose(path.read_text(encoding="utf-8"))
    return {github_slug(re.sub(r"`", "", m.group(1))) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, flags=re.MULTILINE)}


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text(encoding="utf-8")))


def test_the_word_count_is_the_checks():
    text = "a b\n\n```\nnot counted here\n```\n\nc `d`\n"
    assert len(prose(text).split()) == 4 and [len(p.split()) for p in paragraphs(text)] == [2, 2]


def test_the_readme_reads_in_five_minutes():
    text = README.read_text(encoding="utf-8")
    words = len(prose(text).split())
    assert words < 1200, f"README.md: {words} words of prose outside code blocks (the limit is 1,200)"
    long = [(len(p.split()), p[:60]) for p in paragraphs(text) if len(p.split()) > 120]
    assert not long, f"README.md: paragraphs over 120 words: {long}"


def test_the_readme_shows_the_command_ci_runs():
    assert "make test" in README.read_text(encoding="utf-8")
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(encoding="utf-8"), flags=re.MULTILINE)


def test_the_link_pattern_finds_links_and_images():
    assert LINK.findall("see [a](x.md#b) and ![pic](p.png) and [`c`](d/e.md)") == ["x.md#b", "p.png", "d/e.md"]


@pytest.mark.parametrize("page", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_every_link_stays_in_the_repository_and_resolves(page):
    found = links(page)
    broken = []
    for target in found:
        if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.IGNORECASE) or target.startswith("/"):
            broken.append(f"{target}: leaves the repository (only relative links)")
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif not linked.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_readme_links_into_the_docs():
    targets = {t.partition("#")[0] for t in links(README)}
    for page in ("docs/getting-started.md", "docs/accelerator.md", "docs/distributed.md", "docs/benchmarks.md",
                 "docs/contract.md", "docs/architecture.md"):
        assert page in targets, f"README.md does not link {page}"


# --- the site ---------------------------------------------------------------------------------------------------

def _mkdocs_or_skip() -> None:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra is not installed (pip install -e '.[docs]')")


def _build(config_dir: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=config_dir, capture_output=True, text=True, env=env, timeout=600)


def test_the_site_builds_with_every_page_and_the_api_from_the_docstrings(tmp_path):
    _mkdocs_or_skip()
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path / "site"
    for page in sorted(DOCS.rglob("*.md")):
        if "_tools" in page.parts:
            continue
        built = site / page.relative_to(DOCS).with_suffix(".html")
        assert built.is_file(), f"{page.relative_to(ROOT)} was not built"
    api = (site / "api" / "optimizer.html").read_text(encoding="utf-8")
    assert "AdamW whose master weights and moments live in (pinned) host memory" in api  # OffloadAdamW's docstring
    # a Sphinx role of a docstring (:meth:`master_value`) became a link to the rendered method
    assert 'href="#offload_adamw.optim.optimizer.OffloadAdamW.master_value"' in api
    assert ":meth:" not in api and ":class:" not in api
    outside = [f"{page.relative_to(site)}: {m}" for page in sorted(site.rglob("*.html"))
               for m in re.findall(r'(?:href|src)="((?:https?:)?//[^"]+)"', page.read_text(encoding="utf-8"))]
    assert not outside, "the site links or loads from outside itself:\n" + "\n".join(outside[:20])


# Each defect is put into a copy of the site's sources; the build must fail and name it.
DEFECTS = {
    "a link to a page that does not exist": ("[gone](no-such-page.md)", None, "no-such-page.md"),
    "a link to a heading that does not exist": ("[gone](contract.md#no-such-section)", None, "no-such-section"),
    "an unresolved cross-reference": ("[gone][offload_adamw.no_such_name]", None, "offload_adamw.no_such_name"),
    "a docstring that does not parse": (
        "::: offload_adamw.docs_probe.probe",
        'def probe(x):\n    """Probe.\n\n    Raises:\n        ValueError: one line\n'
        '        continued without its indent.\n    """\n',
        "docs_probe.py",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_the_build_fails_on(defect, tmp_path):
    _mkdocs_or_skip()
    markdown, module, named = DEFECTS[defect]
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    if module is not None:
        (tmp_path / "src" / "offload_adamw" / "docs_probe.py").write_text(module, encoding="utf-8")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text(encoding="utf-8") + f"\n{markdown}\n", encoding="utf-8")
    done = _build(tmp_path, tmp_path / "site")
    assert done.returncode != 0, f"the build passed with {defect}"
    assert named in done.stdout + done.stderr, done.stdout + done.stderr
