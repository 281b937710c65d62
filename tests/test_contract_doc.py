"""docs/contract.md is cited by anchor: every citation in the repository resolves, and the doc keeps its promises.

Citations take two forms: ``docs/contract.md#<anchor>`` (source, Markdown; a list of further anchors may
follow as ``, #<anchor>``) and ``docs/contract.md, section <Heading>`` in text a user reads. An anchor is
GitHub's slug of a heading. The worked-numbers table must still show the numbers tests/test_reference.py
checks, and the checker-clauses table must list every clause of the checker under its own name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "contract.md"
SCANNED = ("README.md", "docs", "examples", "src", "tests", "benchmarks")


def github_slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    slug = heading.strip().lower()
    slug = re.sub(r"[^\w\- ]", "", slug)
    return slug.replace(" ", "-")


def headings(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{2,6} +(.+)$", text, flags=re.MULTILINE)]


def scanned_files() -> list[Path]:
    files = []
    for entry in SCANNED:
        path = ROOT / entry
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [f for f in candidates if f.is_file() and f.suffix in (".py", ".md") and "__pycache__" not in f.parts]
    return files


def anchor_citations(text: str) -> list[str]:
    found = []
    for m in re.finditer(r"docs/contract\.md#([\w-]+)((?:, #[\w-]+)*)", text):
        found.append(m.group(1))
        found += re.findall(r"#([\w-]+)", m.group(2))
    return found


def section_citations(text: str) -> list[str]:
    """What follows each ``docs/contract.md, section`` up to the end of the line (placeholders like <name> left out)."""
    return [m.group(1) for m in re.finditer(r"docs/contract\.md, section ([^<`].*)", text)]


DOC_TEXT = DOC.read_text(encoding="utf-8")
HEADINGS = headings(DOC_TEXT)
ANCHORS = {github_slug(h) for h in HEADINGS}


def test_slug_rule_matches_githubs():
    assert github_slug("Memory and traffic bills") == "memory-and-traffic-bills"
    assert github_slug("maximize and amsgrad") == "maximize-and-amsgrad"
    assert github_slug("lr = 0: moments") == "lr--0-moments"
    assert github_slug("Per-tensor step counts") == "per-tensor-step-counts"


def test_headings_are_unique_and_carry_no_numbers():
    slugs = [github_slug(h) for h in HEADINGS]
    assert len(slugs) == len(set(slugs)), "two headings share an anchor: GitHub would suffix one with -1"
    numbered = [h for h in HEADINGS if re.match(r"\d", h)]
    assert not numbered, f"numbered headings change their anchor when a section is added: {numbered}"


def test_the_documented_anchor_list_is_the_set_of_sections():
    listed = set(re.findall(r"\[`#([\w-]+)`\]\(#\1\)", DOC_TEXT))
    assert listed == ANCHORS - {"the-adamw-contract-of-offload-adamw"}


def test_every_citation_in_the_repository_resolves():
    broken = []
    cited = 0
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for anchor in anchor_citations(text):
            cited += 1
            if anchor not in ANCHORS:
                broken.append(f"{path.relative_to(ROOT)}: #{anchor}")
        for rest in section_citations(text):
            cited += 1
            if not any(rest.startswith(h) for h in HEADINGS):
                broken.append(f"{path.relative_to(ROOT)}: section {rest[:40]!r}")
    assert cited > 20, "the scan found almost no citations: the patterns no longer match the repository's form"
    assert not broken, "citations of docs/contract.md that name no section:\n" + "\n".join(broken)


def test_nothing_cites_the_contract_outside_the_repository():
    stale = []
    for path in scanned_files():
        if path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if "CONTRACT.md" in line or re.search(r"contract\.md, sections? \d", line):
                stale.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not stale, "citations of the old, numbered contract:\n" + "\n".join(stale)


def _section(anchor: str) -> str:
    parts = re.split(r"^(#{2,6} +.+)$", DOC_TEXT, flags=re.MULTILINE)
    for i in range(1, len(parts), 2):
        if github_slug(parts[i].lstrip("#")) == anchor:
            return parts[i + 1]
    raise KeyError(anchor)


@pytest.mark.parametrize(
    "shown",
    ["θ1 = 0.89", "(0.89, 1.88)", "(0.9, 1.9)", "0.891", "m2 = 0.09", "v2 = 0.0099", "≈ 0.473684", "≈ 0.497487",
     "≈ 0.8139419853", "t = 2", "θ1 = 1.5, m1 = 0.2, v1 = 0.04", "θ1 = 1.1", "lr = 0.1, β1 = 0.9, β2 = 0.99, weight_decay = 0.1"],
)
def test_worked_numbers_table_shows_what_the_reference_tests_check(shown):
    assert shown in _section("worked-numbers")


def test_worked_numbers_are_what_the_reference_computes():
    from offload_adamw.reference import Hyper, adamw_step, init_state

    hp = Hyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-12, weight_decay=0.1)
    s1 = adamw_step(init_state([1.0]), [1.0], hp)
    s2 = adamw_step(s1, [0.0], hp)
    assert f"{s2.theta[0]:.10f}" == "0.8139419853"
    assert f"{s2.m[0] / (1 - 0.9**2):.6f}" == "0.473684" and f"{s2.v[0] / (1 - 0.99**2):.6f}" == "0.497487"
    l2 = adamw_step(init_state([1.0, 2.0]), [1.1, 1.2], Hyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-12, weight_decay=0.0))
    assert [round(x, 6) for x in l2.m + l2.v] == [0.11, 0.12, 0.0121, 0.0144]


def test_checker_clauses_table_lists_every_clause_with_a_resolving_section():
    from offload_adamw.conformance.clauses import CLAUSES

    table = _section("checker-clauses")
    row = re.compile(r"^\| (\d+) \| (.+?) \| (.+) \|$", re.MULTILINE)
    rows = {int(m.group(1)): (m.group(2).strip(), m.group(3)) for m in row.finditer(table)}
    assert sorted(rows) == [c.number for c in CLAUSES]
    for clause in CLAUSES:
        name, sections = rows[clause.number]
        assert name == clause.name, f"clause {clause.number} is listed as {name!r}, the checker calls it {clause.name!r}"
        anchors = re.findall(r"\]\(#([\w-]+)\)", sections)
        assert anchors and set(anchors) <= ANCHORS, f"clause {clause.number}: {sections}"
