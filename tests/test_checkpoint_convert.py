"""python -m offload_adamw.checkpoint.convert: a one-process checkpoint (layout 1, written by the current code)
becomes a sharded one (layout 2) that loads to exactly what the original loads to.

Compared after ``load`` of each into twin models: every parameter, every optimizer state (the float32
masters of bf16 parameters included), the parameter groups, the scheduler, the step and ``extra``, bit for
bit. The 2-rank half (the converted checkpoint loaded into an FSDP2 model) is the ``converted`` case of
tests/support/_checkpoint_fsdp_worker.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from _layout1_writer import save_layout1
from offload_adamw import OffloadAdamW, checkpoint
from offload_adamw.checkpoint import CheckpointError
from offload_adamw.checkpoint.convert import convert


def build(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)).to(dtype)
    optimizer = OffloadAdamW([{"params": [model[0].weight, model[1].weight]},
                              {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0}], lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)


def trained(tmp_path, dtype, *, also_new: bool = False):
    """A layout-1 checkpoint as the code before layout 2 wrote it (``also_new``: and ``save``'s of the same state)."""
    model, optimizer, scheduler = build(dtype)
    for i in range(2):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(i)).to(dtype)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    old = save_layout1(tmp_path / "old", model, optimizer, scheduler, extra={"epoch": 2})
    if also_new:
        return old, checkpoint.save(tmp_path / "current", model, optimizer, scheduler, extra={"epoch": 2})
    return old


def loaded_alike(a, b) -> None:
    """Twin (model, optimizer, scheduler) triples after two loads: equal bit for bit, groups and scheduler too."""
    for (name, x), y in zip(a[0].state_dict().items(), b[0].state_dict().values(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert a[1].param_groups[0].keys() == b[1].param_groups[0].keys()
    for pid, state in sa["state"].items():
        assert sorted(state) == sorted(sb["state"][pid])
        assert all(torch.equal(v, sb["state"][pid][k]) for k, v in state.items()), pid
    assert a[2].state_dict() == b[2].state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_old_checkpoint_loads_as_the_current_save_of_the_same_state(tmp_path, dtype):
    """The read-only path: a layout-1 checkpoint loads directly (no conversion), to what layout 2 gives."""
    old, new = trained(tmp_path, dtype, also_new=True)
    assert checkpoint.verify(old)["version"] == 1 and checkpoint.verify(new)["version"] == 2
    a, b = build(dtype), build(dtype)
    ra, rb = checkpoint.load(old, *a), checkpoint.load(new, *b)
    assert (ra.step, ra.extra, ra.loaded) == (rb.step, rb.extra, rb.loaded) == (2, {"epoch": 2}, rb.loaded)
    assert ra.ok and rb.ok and ra.rng_restored and rb.rng_restored
    loaded_alike(a, b)
    if dtype == torch.bfloat16:
        assert all("master_param" in s for s in a[1].state_dict()["state"].values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_converted_checkpoint_loads_to_what_the_original_loads_to(tmp_path, dtype):
    old = trained(tmp_path, dtype)
    new = convert(old, tmp_path / "new")
    assert checkpoint.verify(new)["version"] == 2 and checkpoint.verify(old)["version"] == 1
    a, b = build(dtype), build(dtype)
    ra, rb = checkpoint.load(old, *a), checkpoint.load(new, *b)
    assert (ra.step, ra.extra) == (rb.step, rb.extra) == (2, {"epoch": 2})
    assert rb.optimizer_restored and rb.scheduler_restored and rb.rng_restored
    for (name, x), y in zip(a[0].state_dict().items(), b[0].state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for pid, state in sa["state"].items():
        assert sorted(state) == sorted(sb["state"][pid])
        assert all(torch.equal(v, sb["state"][pid][k]) for k, v in state.items()), pid
    if dtype == torch.bfloat16:
        assert all("master_param" in s for s in sa["state"].values())
    assert a[2].state_dict() == b[2].state_dict()


def test_one_command_and_its_refusals(tmp_path):
    old = trained(tmp_path, torch.float32)
    done = subprocess.run([sys.executable, "-m", "offload_adamw.checkpoint.convert", str(old), str(tmp_path / "new")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert checkpoint.verify(tmp_path / "new")["version"] == 2
    with pytest.raises(CheckpointError, match="exists"):
        convert(old, tmp_path / "new")
    with pytest.raises(CheckpointError, match="not a one-process"):
        convert(tmp_path / "new", tmp_path / "again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "old"]
