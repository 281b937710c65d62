"""Bad inputs to OffloadAdamW.step: each gives a clear error or a documented, tested behaviour.

* inf/NaN gradients under each ``nonfinite`` policy (propagate, skip, raise);
* gradients of another floating dtype (converted to the master's dtype),
  of an integer dtype (refused), on another device (torch refuses the assignment;
  a meta-device parameter is refused by name before any state exists);
* parameters added with add_param_group after state exists;
* a parameter whose shape changed under the optimizer.
"""

from __future__ import annotations

import math

import pytest
import torch

from configs import assert_bitwise_equal
from offload_adamw import OffloadAdamW

POLICIES = ["propagate", "skip", "raise"]
BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}



def make(dtype: torch.dtype, **options):
    gen = torch.Generator().manual_seed(0)
    params = {
        "w": torch.nn.Parameter(torch.randn(4, 3, generator=gen).to(dtype)),
        "b": torch.nn.Parameter(torch.randn(3, generator=gen).to(dtype)),
    }
    return params, OffloadAdamW(list(params.items()), lr=0.1, weight_decay=0.1, **options)


def set_grads(params: dict, step: int, bad: dict[str, float] | None = None) -> None:
    """The gradient of each tensor at ``step``; ``bad`` puts a value at element [1] of the named tensors."""
    for i, (name, p) in enumerate(params.items()):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)).to(p.dtype)
        if bad and name in bad:
            g.view(-1)[1] = bad[name]
        p.grad = g


def snapshot(params: dict, optimizer: OffloadAdamW) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in params.items():
        out[name] = p.detach().clone()
        for key, value in optimizer.state.get(p, {}).items():
            out[f"{name}/{key}"] = value.clone()
    return out


def assert_same(a: dict, b: dict, skip=lambda key: False) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if not skip(key):
            assert_bitwise_equal(a[key], b[key], key)


# ----------------------------------------------------------------- inf/NaN


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", BAD)
def test_propagate_spreads_only_where_the_gradient_was_not_finite(dtype, bad):
    """AdamW is elementwise: the bad element's state turns non-finite, every other element is untouched by it."""
    params, optimizer = make(DTYPES[dtype])
    clean_params, clean = make(DTYPES[dtype])
    for step in (1, 2):
        set_grads(params, step, {"w": BAD[bad]} if step == 2 else None)
        set_grads(clean_params, step)
        if step == 2:
            clean_params["w"].grad.view(-1)[1] = 0.0
        optimizer.step()
        clean.step()
    got, ref = snapshot(params, optimizer), snapshot(clean_params, clean)
    poisoned = {"w", "w/exp_avg", "w/exp_avg_sq", "w/master_param"}
    for key, value in got.items():
        flat, flat_ref = value.reshape(-1), ref[key].reshape(-1)
        if key in poisoned:
            assert not torch.isfinite(flat[1]), key
            flat, flat_ref = torch.cat([flat[:1], flat[2:]]), torch.cat([flat_ref[:1], flat_ref[2:]])
        assert_bitwise_equal(flat, flat_ref, key)


@pytest.mark.parametrize("bad", BAD)
def test_propagate_equals_torch_fused_adamw_bitwise(bad):
    params, optimizer = make(torch.float32)
    torch_params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    torch_opt = torch.optim.AdamW(list(torch_params.values()), lr=0.1, weight_decay=0.1, fused=True)
    for step in (1, 2, 3):
        for ps in (params, torch_params):
            set_grads(ps, step, {"w": BAD[bad]} if step == 2 else None)
        optimizer.step()
        torch_opt.step()
    for name, p in params.items():
        torch.testing.assert_close(p, torch_params[name], rtol=0, atol=0, equal_nan=True)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                optimizer.state[p][key], torch_opt.state[torch_params[name]][key], rtol=0, atol=0, equal_nan=True
            )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", BAD)
def test_skip_changes_nothing_and_the_run_continues_as_if_the_step_never_came(dtype, bad):
    params, optimizer = make(DTYPES[dtype], nonfinite="skip")
    never_params, never = make(DTYPES[dtype], nonfinite="skip")
    set_grads(params, 1)
    set_grads(never_params, 1)
    optimizer.step()
    never.step()
    before = snapshot(params, optimizer)
    set_grads(params, 2, {"b": BAD[bad]})
    optimizer.step()
    assert optimizer.skipped_steps == 1
    assert_same(snapshot(params, optimizer), before)
    set_grads(params, 3)
    set_grads(never_params, 3)
    optimizer.step()
    never.step()
    assert_same(snapshot(params, optimizer), snapshot(never_params, never))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", BAD)
def test_raise_names_every_offending_parameter_and_changes_nothing(dtype, bad):
    params, optimizer = make(DTYPES[dtype], nonfinite="raise")
    set_grads(params, 1)
    optimizer.step()
    before = snapshot(params, optimizer)
    set_grads(params, 2, {"w": BAD[bad]})
    with pytest.raises(FloatingPointError, match="'w'") as info:
        optimizer.step()
    assert "'b'" not in str(info.value)
    assert_same(snapshot(params, optimizer), before)
    set_grads(params, 2, {"w": BAD[bad], "b": BAD[bad]})
    with pytest.raises(FloatingPointError, match="2 parameter") as info:
        optimizer.step()
    assert "'w'" in str(info.value) and "'b'" in str(info.value)
    assert_same(snapshot(params, optimizer), before)


# ------------------------------------------------------- dtype and device


@pytest.mark.parametrize(
    "param_dtype,grad_dtype",
    [
        (torch.float32, torch.float64),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float32),
    ],
)
def test_gradient_of_another_floating_dtype_is_converted_to_the_master_dtype(param_dtype, grad_dtype):
    """Documented: any floating gradient is rounded to the master's dtype first (torch's own AdamW refuses it)."""
    gen = torch.Generator().manual_seed(1)
    value = torch.randn(16, generator=gen).to(param_dtype)
    grad = torch.randn(16, generator=gen, dtype=torch.float64).to(grad_dtype)
    p = torch.nn.Parameter(value.clone())
    p.grad_dtype = None  # torch checks a gradient's dtype unless told not to
    p.grad = grad
    optimizer = OffloadAdamW([p], lr=0.1)
    optimizer.step()

    master_dtype = torch.float64 if param_dtype == torch.float64 else torch.float32
    q = torch.nn.Parameter(value.to(master_dtype))
    q.grad = grad.to(master_dtype)
    reference = OffloadAdamW([q], lr=0.1)
    reference.step()
    assert_bitwise_equal(optimizer.master_param(p), q.detach(), "the master of p")
    assert_bitwise_equal(optimizer.state[p]["exp_avg_sq"], reference.state[q]["exp_avg_sq"], "exp_avg_sq of p")
    assert_bitwise_equal(p.detach(), q.detach().to(param_dtype), "parameter")


def test_integer_gradient_is_refused_naming_the_parameter():
    params, optimizer = make(torch.float32)
    set_grads(params, 1)
    optimizer.step()
    before = snapshot(params, optimizer)
    params["b"].grad_dtype = None
    params["b"].grad = torch.ones(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"'b'.*int64"):
        optimizer.step()
    assert_same(snapshot(params, optimizer), before, skip=lambda key: key.startswith("w"))


def test_gradient_on_another_device_is_refused_by_torch_at_assignment():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="device"):
        p.grad = torch.zeros(3, device="meta")


def test_parameter_on_the_meta_device_is_refused_by_name_before_any_state():
    p = torch.nn.Parameter(torch.empty(3, 4, device="meta"))
    p.grad = torch.empty(3, 4, device="meta")
    optimizer = OffloadAdamW([("layer.weight", p)])
    with pytest.raises(ValueError, match=r"'layer.weight' is on the meta device"):
        optimizer.step()
    assert len(optimizer.state) == 0


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipeline"])
def test_meta_parameters_are_refused_with_a_runtime_error_as_torch_and_train_once_materialized(pipeline):
    # torch's fused AdamW raises RuntimeError for a meta parameter at its step (test_fused_error_on_params_on_meta in
    # torch's suite); code catching it must catch ours, which keeps naming the parameter (and stays a ValueError).
    with torch.device("meta"):
        ours = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1))
        theirs = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1))
    optimizer = OffloadAdamW(ours.named_parameters(), transfer_pipeline=pipeline)
    torch_opt = torch.optim.AdamW(theirs.parameters(), fused=True)
    for model in (ours, theirs):
        with torch.device("meta"):
            for p in model.parameters():
                p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError):
        torch_opt.step()
    with pytest.raises(RuntimeError, match=r"'0.weight' is on the meta device") as refused:
        optimizer.step()
    assert isinstance(refused.value, ValueError) and len(optimizer.state) == 0
    gen = torch.Generator().manual_seed(0)
    for model, opt in ((ours, optimizer), (theirs, torch_opt)):
        opt.zero_grad(set_to_none=True)
        model.to_empty(device="cpu")
    for p, q in zip(ours.parameters(), theirs.parameters()):
        value = torch.randn(p.shape, generator=gen)
        with torch.no_grad():
            p.copy_(value)
            q.copy_(value)
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    optimizer.step()
    torch_opt.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), "parameter")


# -------------------------------------------------------- add_param_group


def test_add_param_group_after_state_exists_equals_torch():
    """Old tensors keep their state and count; new ones start at zero: bitwise equal to torch's fused AdamW."""
    gen = torch.Generator().manual_seed(3)
    old = [torch.randn(5, 4, generator=gen), torch.randn(4, generator=gen)]
    new = [torch.randn(6, generator=gen)]
    ours = [torch.nn.Parameter(t.clone()) for t in old + new]
    theirs = [torch.nn.Parameter(t.clone()) for t in old + new]
    optimizer = OffloadAdamW(ours[:2], lr=0.05, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(theirs[:2], lr=0.05, weight_decay=0.1, fused=True)

    def step(k: int, count: int) -> None:
        for i in range(count):
            g = torch.randn(ours[i].shape, generator=torch.Generator().manual_seed(10 * k + i))
            ours[i].grad, theirs[i].grad = g.clone(), g.clone()
        optimizer.step()
        torch_opt.step()

    step(1, 2)
    step(2, 2)
    optimizer.add_param_group({"params": ours[2:], "lr": 0.2, "amsgrad": True})
    torch_opt.add_param_group({"params": theirs[2:], "lr": 0.2, "amsgrad": True})
    step(3, 3)
    step(4, 3)
    for p, q in zip(ours, theirs):
        assert_bitwise_equal(p.detach(), q.detach(), "parameter")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_bitwise_equal(optimizer.state[p][key], torch_opt.state[q][key], key)
    assert [float(optimizer.state[p]["step"]) for p in ours] == [4.0, 4.0, 2.0]
    assert_bitwise_equal(optimizer.state[ours[2]]["max_exp_avg_sq"], torch_opt.state[theirs[2]]["max_exp_avg_sq"],
                         "max_exp_avg_sq of the amsgrad parameter")


def test_add_param_group_with_a_parameter_already_present_is_refused():
    params, optimizer = make(torch.float32)
    set_grads(params, 1)
    optimizer.step()
    with pytest.raises(ValueError, match="more than one parameter group"):
        optimizer.add_param_group({"params": [("w_again", params["w"])]})
    # Names are all or nothing across groups (torch's rule), so that state can always be matched by name.
    with pytest.raises(ValueError, match="with/without names"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert len(optimizer.param_groups) == 1


# ---------------------------------------------------------- shape changes


@pytest.mark.parametrize("dtype", DTYPES)
def test_parameter_whose_shape_changed_is_refused_by_name_and_nothing_changes(dtype):
    """fp32: the parameter is its own master, so the check must look at the state (it once read past the moments)."""
    params, optimizer = make(DTYPES[dtype])
    set_grads(params, 1)
    optimizer.step()
    before = snapshot(params, optimizer)
    params["b"].data = torch.zeros(5, dtype=DTYPES[dtype])
    set_grads(params, 2)
    with pytest.raises(RuntimeError, match=r"'b' changed shape under the optimizer: state has \(3,\), the parameter is \(5,\)"):
        optimizer.step()
    after = snapshot(params, optimizer)
    assert_same(after, before, skip=lambda key: key == "b")
    assert torch.equal(params["b"].detach(), torch.zeros(5, dtype=DTYPES[dtype]))


def test_shape_change_is_refused_on_the_transfer_pipeline_too():
    """The pipeline path (offload.py) uses the same check: a float32 host parameter is its own master."""
    from offload_adamw import OffloadAdamW

    p = torch.nn.Parameter(torch.ones(4))
    opt = OffloadAdamW([("w", p)], lr=0.1, transfer_pipeline=True)
    p.grad = torch.ones(4)
    opt.step()
    p.data = torch.ones(6)
    p.grad = torch.ones(6)
    with pytest.raises(RuntimeError, match="'w' changed shape under the optimizer"):
        opt.step()


def test_pipeline_checks_every_bucket_before_updating_any():
    """With tiny buckets, a bad parameter in the last bucket must leave the first buckets untouched."""
    from offload_adamw import OffloadAdamW

    first = torch.nn.Parameter(torch.ones(4))
    last = torch.nn.Parameter(torch.ones(3))
    opt = OffloadAdamW([("first", first), ("last", last)], lr=0.1, transfer_pipeline=True, bucket_bytes=1)
    first.grad, last.grad = torch.ones(4), torch.ones(3)
    opt.step()
    before = first.detach().clone(), opt.state[first]["exp_avg"].clone(), opt.state[first]["step"].clone()
    last.data = torch.ones(5)  # changed under the optimizer
    first.grad, last.grad = torch.ones(4), torch.ones(5)
    with pytest.raises(RuntimeError, match="'last' changed shape under the optimizer"):
        opt.step()
    after = first.detach(), opt.state[first]["exp_avg"], opt.state[first]["step"]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
