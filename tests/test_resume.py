"""Resume in a fresh process continues the same computation bit for bit (docs/contract.md#round-trip)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _resume_worker
from _parity import same_bits

WORKER = Path(__file__).resolve().parent / "support" / "_resume_worker.py"
N, M = 12, 9


def workers(*runs):
    """Run worker processes concurrently; each run is a tuple of command-line arguments."""
    procs = [subprocess.Popen([sys.executable, str(WORKER), *map(str, args)]) for args in runs]
    for proc in procs:
        assert proc.wait(timeout=180) == 0


@pytest.mark.parametrize("dtype", [pytest.param("fp32", marks=pytest.mark.slow), "bf16"])  # CI: the bf16 run, its master included
def test_save_load_in_new_process_equals_uninterrupted(tmp_path, dtype):
    workers((dtype, 0, N, tmp_path / "half.pt"), (dtype, 0, N + M, tmp_path / "straight.pt"))
    workers((dtype, N, N + M, tmp_path / "resumed.pt", tmp_path / "half.pt"))
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    for name, value in straight["model"].items():
        assert same_bits(resumed["model"][name], value), name
    assert resumed["scheduler"] == straight["scheduler"]
    assert resumed["optimizer"]["param_groups"] == straight["optimizer"]["param_groups"]
    for pid, state in straight["optimizer"]["state"].items():
        for key, value in state.items():
            assert value.dtype == torch.float32, (pid, key)
            assert same_bits(resumed["optimizer"]["state"][pid][key], value), (pid, key)
    if dtype == "bf16":
        assert all("master_param" in s for s in straight["optimizer"]["state"].values())


def test_restoring_weights_alone_is_a_different_trajectory(tmp_path, monkeypatch):
    """Zeroed m, v, t with the right weights: the run goes elsewhere (in-process is enough here)."""
    straight = tmp_path / "straight.pt"
    half = tmp_path / "half.pt"
    cold = tmp_path / "cold.pt"
    for argv in (["fp32", 0, N + M, straight], ["fp32", 0, N, half]):
        monkeypatch.setattr(sys, "argv", ["worker", *map(str, argv)])
        _resume_worker.main()
    ckpt = torch.load(half, weights_only=True)
    for state in ckpt["optimizer"]["state"].values():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            state[key].zero_()
    torch.save(ckpt, half)
    monkeypatch.setattr(sys, "argv", ["worker", "fp32", str(N), str(N + M), str(cold), str(half)])
    _resume_worker.main()
    a = torch.load(cold, weights_only=True)["model"]
    b = torch.load(straight, weights_only=True)["model"]
    assert any(not same_bits(a[k], b[k]) for k in b)
