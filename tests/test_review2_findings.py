"""Review of update_in_backward with a non-finite policy and clipping (offload_gradients=True): each case is a
combination that once trained wrong, hung or refused confusingly, kept as a test that it is torch's result (or the
reference OffloadAdamW(update_in_backward=False)'s) or a clear refusal before any update."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "_review2_worker.py"
sys.path.insert(0, str(WORKER.parent))
from _review2_worker import CASES as FSDP_CASES  # noqa: E402


# ----------------------------------------------------------------------------- FSDP2, 2 gloo ranks (one run of the worker)


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("review2_fsdp")
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"review2_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", list(FSDP_CASES))
def test_fsdp2_update_in_backward_nonfinite_is_the_reference(fsdp_results, case: str) -> None:
    for rank, result in enumerate(fsdp_results):
        assert result[case]["ok"], f"rank {rank}: {result[case]['error']}"
