"""The one table renderer and the JSON convention (offload_adamw._output)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_adamw._output import (
    SCHEMA_VERSION,
    finite_json,
    json_document,
    render_table,
    terminal_width,
)
from offload_adamw.conformance.report import ClauseResult, Report

words = st.text(alphabet="abcdefghij", min_size=1, max_size=8)
cells = st.lists(words, min_size=1, max_size=6).map(" ".join)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5).flatmap(lambda n: st.lists(st.lists(cells, min_size=3, max_size=3), min_size=n, max_size=n)),
    width=st.integers(30, 160),
)
def test_a_table_fits_the_width_and_keeps_every_word(rows, width):
    headers = ["name", "value", "message"]
    text = render_table(headers, rows, align="lrl", wrap=2, width=width)
    lines = text.splitlines()
    fixed = max(len(r[0]) for r in rows + [headers]) + max(len(r[1]) for r in rows + [headers]) + 4
    if fixed + 12 <= width:  # room for the wrapped column: every line fits
        assert all(len(line) <= width for line in lines), text
    for row in rows:  # wrapping never drops or cuts a word
        for word in row[2].split():
            assert any(word in line.split() for line in lines)
    assert lines[1].startswith("----")


def test_columns_sets_the_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "50")
    assert terminal_width() == 50
    text = render_table(["a", "message"], [["x", "word " * 30]])
    assert max(len(line) for line in text.splitlines()) <= 50
    monkeypatch.setenv("COLUMNS", "300")
    assert len(render_table(["a", "message"], [["x", "word " * 30]]).splitlines()) == 3


def test_non_finite_numbers_become_null_and_are_named():
    doc = finite_json({"a": math.inf, "b": [1.0, -math.inf, {"c": math.nan}], "d": "inf"})
    assert doc["a"] is None and doc["b"][1] is None and doc["b"][2]["c"] is None
    assert doc["nonfinite"] == {"a": "inf", "b[1]": "-inf", "b[2].c": "nan"}
    assert doc["d"] == "inf"  # a string stays what it was
    json.dumps(doc, allow_nan=False)  # strict JSON
    document = json_document("plan", {"x": 1})
    assert list(document)[:2] == ["schema_version", "command"] and document["schema_version"] == SCHEMA_VERSION


def test_the_conformance_report_writes_no_inf_string():
    report = Report(candidate="c", dtype="fp32", device="cpu", results=[
        ClauseResult(number=8, name="n", verdict="fail", deviation=math.inf, consequence="x", detail="d")])
    data = report.to_json()
    assert data["results"][0]["deviation"] is None
    assert data["nonfinite"] == {"results[0].deviation": "inf"}
    assert "inf" not in json.dumps({k: v for k, v in data.items() if k != "nonfinite"}, allow_nan=False)


@pytest.mark.parametrize("width", [40, 80, 200])
def test_the_conformance_table_follows_the_width(width):
    report = Report(candidate="c", dtype="fp32", device="cpu", results=[
        ClauseResult(number=1, name="update rule", verdict="pass", deviation=0.0, consequence="word " * 40, detail="d")])
    lines = report.to_table(width=width).splitlines()
    table = lines[2:5]
    assert all(len(line) <= max(width, 60) for line in table)
