"""benchmarks/fixed_cost.py: the fixed cost per step, OffloadAdamW from each source tree beside torch's AdamW.

The comparison of two commits rests on each offload row importing the package from its own tree: a copy of
``src`` given as a second source must be what its row's processes imported. The rows, the ratio to torch's
fused step and the JSON's schema are those docs/host-step.md reads; a malformed mix is a usage error (exit 2).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "benchmarks/fixed_cost.py")


@pytest.mark.slow
def test_each_source_tree_is_the_one_its_rows_import(tmp_path):
    copy = tmp_path / "other" / "src"
    shutil.copytree(ROOT / "src" / "offload_adamw", copy / "offload_adamw",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "fixed.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, SCRIPT, "--mixes", "3x64", "--dtypes", "float32,bfloat16",
                           "--sources", f"here={ROOT / 'src'},copy={copy}", "--rounds", "1", "--steps", "3",
                           "--warmup", "1", "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1 and data["omp_num_threads"] == 1
    rows = {row["optimizer"]: row for row in data["rows"]}
    assert set(rows) == {"offload (here)", "offload (copy)", "offload (here) bfloat16", "offload (copy) bfloat16",
                         "fused", "foreach", "for-loop"}
    for name, tree in (("offload (here)", ROOT / "src"), ("offload (copy)", copy), ("offload (copy) bfloat16", copy)):
        imported = Path(rows[name]["rounds"][0]["module"]).resolve()
        assert imported.is_relative_to(tree.resolve()), (name, imported)
        assert rows[name]["rounds"][0]["torch_threads"] == 1  # OMP_NUM_THREADS=1, as torchrun sets it
    assert rows["fused"]["ratio_to_fused"] == 1.0 and rows["fused"]["rounds"][0]["module"] is None
    assert all(row["median_ms"] > 0 and row["tensors"] == 3 for row in rows.values())
    assert "x fused" in done.stdout


def test_a_malformed_mix_is_a_usage_error():
    done = subprocess.run([sys.executable, SCRIPT, "--mixes", "30by64"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "COUNTxELEMENTS" in done.stderr
