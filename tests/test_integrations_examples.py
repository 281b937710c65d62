"""The examples run, in-process with tiny settings, and their resume paths continue the same run.

* examples/finetune.py (plain loop, bf16 model): a run preempted at a checkpoint and continued with
  ``--resume`` ends with bitwise the model and optimizer state of the uninterrupted run;
* examples/trainer.py (Trainer with ``optimizer_cls_and_kwargs``): trains, writes checkpoints with
  optimizer.pt, and ``--resume`` continues to the new step count.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_example_resume_is_bitwise(tmp_path):
    finetune = load_example("finetune")
    common = ["--steps", "6", "--batch-size", "2", "--seq-len", "32", "--save-every", "100", "--dtype", "bf16"]
    assert finetune.main(common + ["--out", str(tmp_path / "straight")]) == 0
    assert finetune.main(common + ["--out", str(tmp_path / "preempted"), "--stop-at", "3"]) == 0
    assert torch.load(tmp_path / "preempted" / "checkpoint.pt", weights_only=False)["step"] == 3
    assert finetune.main(common + ["--out", str(tmp_path / "preempted"), "--resume"]) == 0

    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "preempted" / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert all(t.dtype == torch.bfloat16 for t in a["model"].values() if t.is_floating_point() and t.dim() > 1)
    for pid, state in a["optimizer"]["state"].items():
        for key in ("master_param", "exp_avg", "exp_avg_sq", "step"):
            assert state[key].dtype == torch.float32, key
            assert torch.equal(state[key], b["optimizer"]["state"][pid][key]), (pid, key)


def test_trainer_example_trains_checkpoints_and_resumes(tmp_path, capsys):
    trainer = load_example("trainer")
    common = ["--batch-size", "2", "--seq-len", "32", "--save-steps", "2", "--out", str(tmp_path)]
    assert trainer.main(common + ["--steps", "2"]) == 0
    assert (tmp_path / "checkpoint-2" / "optimizer.pt").is_file()
    assert trainer.main(common + ["--steps", "4", "--resume"]) == 0
    assert "trained to step 4" in capsys.readouterr().out
    saved = torch.load(tmp_path / "checkpoint-4" / "optimizer.pt", weights_only=True)
    assert all(float(s["step"]) == 4 for s in saved["state"].values())
