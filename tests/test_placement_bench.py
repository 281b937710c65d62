"""benchmarks/placement_bench.py runs every placement over the same tensors in one run and writes its JSON.

A smoke run (``--quick``, the CPU as device): what is checked is the document and the counted bytes (which follow
from the state the optimizer holds: docs/placement.md's table), not the timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "placement_bench.py"
MIB = 1 << 20


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1] / "src")}
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow  # a benchmark smoke run (5 s)
def test_quick_run_writes_every_placement_against_the_host_one(tmp_path: Path) -> None:
    proc = _run("--quick", "--json", str(tmp_path / "p.json"), "--buffers", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    document = json.loads((tmp_path / "p.json").read_text())
    assert document["schema_version"] == 1 and document["command"] == "placement_bench"
    n = document["elements"]
    assert n == MIB and document["tensors"] > 10, "a transformer's mix of tensors, not one large one"
    cases = {c["case"]: c for c in document["cases"]}
    assert set(cases) == {"host", "stream", "device", "mixed"}
    assert cases["host"]["step_vs_host"] == 1.0 and all(c["step_s"] > 0 for c in cases.values())
    # bf16 model, float32 state: the host update's 28 B/element in host memory, no transfer with the CPU as device
    assert cases["host"]["host_bytes_per_step"] == 28 * n and cases["host"]["transfer_bytes_per_step"] == 0
    assert cases["host"]["device_buffer_bytes"] == 0
    # streamed: 12 B/element out to the device and 12 back, through host memory; the ring of 3 buffers of 1 MiB
    assert cases["stream"]["transfer_bytes_per_step"] == cases["stream"]["host_bytes_per_step"] == 24 * n
    assert cases["stream"]["device_buffer_bytes"] == 3 * MIB
    # resident: nothing moves; 12 B/element of state and the 1 MiB widening buffer on the device
    assert cases["device"]["transfer_bytes_per_step"] == cases["device"]["host_bytes_per_step"] == 0
    assert cases["device"]["device_buffer_bytes"] == 12 * n + MIB
    mixed = cases["mixed"]
    assert 0 < mixed["transfer_bytes_per_step"] < 24 * n and 0 < mixed["host_bytes_per_step"] < 28 * n
    assert "stream" in proc.stdout and "vs host" in proc.stdout


@pytest.mark.slow  # two benchmark processes importing torch (5 s)
def test_bad_sizes_are_usage_errors() -> None:
    proc = _run("--chunk-bytes", "4096")
    assert proc.returncode == 2 and "--chunk-bytes" in proc.stderr
    proc = _run("--elements", "10")
    assert proc.returncode == 2 and "elements must be at least 64" in proc.stderr
