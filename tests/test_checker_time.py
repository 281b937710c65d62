"""benchmarks/checker_time.py times one check beside the imports it needs and a candidate in a batched command.

A smoke run (``--quick``): what is checked is the document's shape and the order of the figures that must hold
on any machine (importing torch is part of the floor, the floor part of one check), not the timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "checker_time.py"


@pytest.mark.slow  # a benchmark smoke run (15 s: five fresh processes, each importing torch)
def test_quick_run_writes_the_floor_one_check_and_the_batch(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1] / "src")}
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(tmp_path / "t.json")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    document = json.loads((tmp_path / "t.json").read_text())
    assert document["schema_version"] == 1 and document["command"] == "checker_time"
    medians = document["medians"]
    assert set(medians) == {"import_torch", "floor", "one_check", "batch_per_candidate"}
    assert 0 < medians["import_torch"] < medians["floor"] < medians["one_check"]
    assert len(document["samples"]["batch_per_candidate"]) == 1  # a batch of 2: the second candidate's report
    assert 0 < medians["batch_per_candidate"] < medians["one_check"]
    assert "one more candidate" in proc.stdout
