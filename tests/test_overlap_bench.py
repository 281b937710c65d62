"""benchmarks/overlap_bench.py runs its three cases side by side and writes its JSON and Gantt chart.

A smoke run (``--quick``): what is checked is the document and the chart, not the timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "overlap_bench.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1] / "src")}
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow  # a benchmark's smoke run (13 s)
def test_quick_run_writes_every_case_and_the_timeline(tmp_path: Path) -> None:
    proc = _run("--quick", "--json", str(tmp_path / "o.json"), "--timeline", str(tmp_path / "o.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    document = json.loads((tmp_path / "o.json").read_text())
    assert document["schema_version"] == 1 and document["command"] == "overlap_bench"
    cases = {c["case"]: c for c in document["cases"]}
    assert set(cases) == {"torch_fused", "offload_step", "offload_overlap"}
    assert cases["torch_fused"]["step_vs_torch_fused"] == 1.0
    assert cases["torch_fused"]["overlap"] is None and cases["offload_step"]["overlap"] == 0.0
    assert all(c["step_s"] > 0 and c["peak_rss_bytes"] > 0 for c in cases.values())
    assert (tmp_path / "o.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "offload_overlap" in proc.stdout


def test_bad_sizes_are_usage_errors() -> None:
    proc = _run("--blocks", "0")
    assert proc.returncode == 2 and "--blocks" in proc.stderr
