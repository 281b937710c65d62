"""checkpoint.save and load of an FSDP2 model (DTensor parameters, 2 gloo ranks) refuse, naming DCP and the entry.

offload_adamw.checkpoint writes whole tensors of one process; a sharded model is saved with
torch.distributed.checkpoint (DCP), which OffloadAdamW supports (tests/test_distributed.py). Both refusals
come before anything is written or changed: no directory appears, the model keeps its values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "support" / "_checkpoint_fsdp_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("checkpoint_fsdp")
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("call", ["save", "save_model_only", "load"])
def test_a_dtensor_model_is_refused_naming_dcp_and_its_first_dtensor_entry(ranks, call):
    for rank, result in enumerate(ranks):
        error = result[call]
        assert error is not None, f"rank {rank}: {call} was accepted"
        assert error["type"] == "CheckpointError", (rank, error)
        assert "torch.distributed.checkpoint" in error["message"], (rank, error)
        assert "'1.weight'" in error["message"], (rank, error)  # 0.* are plain tensors; 1.weight is the first shard


def test_nothing_was_written_or_changed(ranks):
    for rank, result in enumerate(ranks):
        assert result["entries"] == ["unsharded"], (rank, result["entries"])
        assert result["load_changed_nothing"], rank
