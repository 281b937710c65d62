"""benchmarks/host_after_torch.py: our step alone and right after torch's CPU work, with the spin it measures.

What the benchmark's evidence rests on is checked against libgomp's own setting: torch's OpenMP workers
are found (the threads Python did not start) and their CPU time read from the scheduler, so after torch's
fused step they spend tens of milliseconds spinning under ``GOMP_SPINCOUNT=3000000``, some of it during
our step, and nothing under ``GOMP_SPINCOUNT=0``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
                    reason="reads threads through /proc; libgomp spins only with a core per team thread")
def test_the_benchmark_sees_the_spin_and_its_setting(tmp_path):
    out = tmp_path / "after.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/host_after_torch.py"), "--sizes", "1M",
                           "--settings", "GOMP_SPINCOUNT=3000000,GOMP_SPINCOUNT=0", "--omp-threads", "2",
                           "--rounds", "1", "--steps", "3", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1 and data["omp_num_threads"] == 2
    rows = {row["setting"]: row for row in data["rows"]}
    long, none = rows["GOMP_SPINCOUNT=3000000"], rows["GOMP_SPINCOUNT=0"]
    for row in (long, none):
        assert row["elements"] == 1 << 20 and row["torch_threads"] == 2
        assert all(row[a]["median_ms"] > 0 for a in ("ours alone", "ours after fused", "torch fused alone"))
    # 3e6 pauses are milliseconds on any x86 or Arm core; none is none
    assert long["spin_cpu_ms"]["after fused"] > 5, long["spin_cpu_ms"]
    assert none["spin_cpu_ms"]["after fused"] < 1, none["spin_cpu_ms"]
    # the spinning worker runs during our step after torch's, not after our idleness
    assert long["ours after fused"]["team_cpu_median_ms"] > 0.5, long["ours after fused"]
    assert long["ours alone"]["team_cpu_median_ms"] < 0.5, long["ours alone"]
    assert none["ours after fused"]["team_cpu_median_ms"] < 0.5, none["ours after fused"]
    assert "after fused - alone" in done.stdout
