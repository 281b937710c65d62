"""The one update path (optim/update.py): the plain step and the transfer pipeline share it.

Properties:
* both paths call ``optim.update.update_group`` and nothing else to update tensors;
* the pipeline holds no optimizer: built from what optim/bucket.py's ``wiring`` hands it, driven by the
  step's sequence, it gives the plain step's bits, and the optimizer goes when it is let go while the
  pipeline lives on (nothing of the pipeline refers to it but weakly);
* a gradient of another floating dtype than its parameter is taken as it is by both paths
  (the same bits); where the pipeline cannot hold it (freed device gradients) it refuses,
  naming the parameter, before anything changes.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from _parity import same_bits
from offload_adamw import OffloadAdamW
from offload_adamw.accel.pipeline import GradientPipeline, PipelineConfig
from offload_adamw.optim import step as step_sequence
from offload_adamw.optim import update as update_path
from offload_adamw.optim.bucket import wiring


def _model(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3)).to(dtype)


def _set_grads(model: nn.Module, step: int, dtype: torch.dtype | None = None) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        if dtype is not None and dtype != p.dtype and hasattr(p, "grad_dtype"):
            p.grad_dtype = None  # torch >= 2.10 checks a gradient's dtype against this unless it is None
        p.grad = torch.randn(p.shape, generator=g).to(dtype or p.dtype)


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipeline"])
def test_every_update_goes_through_update_group(monkeypatch, pipeline: bool) -> None:
    calls: list[int] = []
    real = update_path.update_group

    def spy(group, updates, **kwargs):
        calls.append(len(updates))
        return real(group, updates, **kwargs)

    monkeypatch.setattr(update_path, "update_group", spy)
    model = _model()
    opt = OffloadAdamW(model.parameters(), transfer_pipeline=pipeline)
    before = [p.detach().clone() for p in model.parameters()]
    _set_grads(model, 0)
    opt.step()
    assert sum(calls) == 4, calls
    assert all(not same_bits(a, p.detach()) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", ["plain", "kept", "freed"])
@pytest.mark.parametrize("options", [{}, {"nonfinite": "skip", "max_grad_norm": 0.5}], ids=["bare", "skip-clip"])
def test_a_step_checks_each_gradient_once(monkeypatch, mode: str, options: dict[str, Any]) -> None:
    """Every gradient is checked before the first update, once: a second check of the same gradient in the same
    step is fixed cost per parameter and says nothing new (nothing runs between the two)."""
    checked: list[tuple[int, ...]] = []
    real = update_path.check_gradient

    def counted(describe, param, grad, state):
        checked.append(tuple(param.shape))
        return real(describe, param, grad, state)

    monkeypatch.setattr(update_path, "check_gradient", counted)
    model = _model(torch.float32)
    opt = OffloadAdamW(model.parameters(), transfer_pipeline=mode != "plain", offload_gradients=mode == "freed",
                       bucket_bytes=64, **options)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        model(x).square().mean().backward()
        checked.clear()
        opt.step()
        opt.zero_grad()
        assert sorted(checked) == sorted(tuple(p.shape) for p in model.parameters()), checked


@pytest.mark.parametrize("freed", [False, True], ids=["kept", "freed"])
def test_the_pipeline_holds_no_optimizer(freed: bool) -> None:
    plain_model, piped_model = _model(), _model()
    plain = OffloadAdamW(plain_model.parameters(), lr=1e-2, transfer_pipeline=False)
    target = OffloadAdamW(piped_model.parameters(), lr=1e-2, transfer_pipeline=False)
    pipeline = GradientPipeline(PipelineConfig(offload_gradients=freed, bucket_bytes=64), wiring(target))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for _ in range(4):
        for model in (plain_model, piped_model):
            model(x).float().square().mean().backward()
        plain.step()
        step_sequence.run(target, pipeline.transport, None, None, False)  # the step's sequence, the pipeline's transport
        plain.zero_grad()
        pipeline.zero_grad(True)
        piped_model.zero_grad()
    for p, q in zip(plain_model.parameters(), piped_model.parameters()):
        assert same_bits(p.detach(), q.detach())
        assert same_bits(plain.state[p]["master_param"], target.state[q]["master_param"])
    gone = weakref.ref(target)
    gc.disable()  # without the collector: only a reference cycle through the pipeline could keep it
    try:
        del target
        assert gone() is None, "the pipeline (or what it was handed) holds the optimizer"
    finally:
        gc.enable()
        pipeline.close()


def test_a_gradient_of_another_dtype_gives_the_same_bits_in_both_paths() -> None:
    models = {mode: _model() for mode in ("plain", "pipeline")}
    opts = {
        "plain": OffloadAdamW(models["plain"].parameters(), transfer_pipeline=False),
        "pipeline": OffloadAdamW(models["pipeline"].parameters(), transfer_pipeline=True),
    }
    for step in range(3):
        for mode in models:
            _set_grads(models[mode], step, torch.float32)  # float32 gradients for bf16 parameters
            opts[mode].step()
    for p, q in zip(models["plain"].parameters(), models["pipeline"].parameters()):
        assert same_bits(p.detach(), q.detach())
        assert same_bits(opts["plain"].state[p]["exp_avg_sq"], opts["pipeline"].state[q]["exp_avg_sq"])


def test_freed_gradients_of_another_dtype_are_refused_by_name_and_nothing_changes() -> None:
    model = _model()
    opt = OffloadAdamW(model.named_parameters(), transfer_pipeline=True, offload_gradients=True)
    _set_grads(model, 0)
    opt.step()
    snapshot = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for p in model.parameters()]
    _set_grads(model, 1, torch.float32)
    with pytest.raises(RuntimeError, match=r"'0.weight'.*float32.*offload_gradients=False"):
        opt.step()
    assert all(same_bits(a, p.detach()) for a, p in zip(values, model.parameters()))
    after = opt.state_dict()
    for key, state in snapshot["state"].items():
        for name, value in state.items():
            assert same_bits(value, after["state"][key][name]), (key, name)


def test_master_param_is_the_kept_master_and_master_value_always_a_value() -> None:
    model = _model()
    fp32 = nn.Linear(3, 2)
    opt = OffloadAdamW([*model.parameters(), *fp32.parameters()])
    low = next(model.parameters())
    assert opt.master_param(low) is None, "no master exists before the first update"
    start = opt.master_value(low)
    assert start.dtype == torch.float32 and same_bits(start.to(low.dtype), low.detach())
    assert opt.master_param(fp32.weight) is fp32.weight, "a float32 host parameter is its own master"
    _set_grads(model, 0)
    _set_grads(fp32, 0)
    opt.step()
    kept = opt.master_param(low)
    assert kept is opt.state[low]["master_param"] and kept is opt.master_value(low)
    assert same_bits(kept.to(low.dtype), low.detach())
