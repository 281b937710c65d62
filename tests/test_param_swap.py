"""A ``param_groups`` swap under the transfer pipeline (the CPU as device), as accelerate and the HF Trainer do it.

accelerate and the Trainer build the optimizer over a model's parameters, shard the model (FSDP2) and then put the
shards into the optimizer's ``param_groups`` in place of the originals; any edit of ``param_groups`` may do the
same. Properties, for every pipeline mode (kept, freed, updates during backward):

* the pipeline keeps nothing of a parameter that left ``param_groups``: the parameter dies with its model (weak
  references), its hooks are removed and its host buffers freed (``host_buffer_bytes`` is the new parameters' bill);
* a parameter put into ``param_groups`` gets its hooks before the first backward that uses it (its first gradient
  is already freed when the gradients are freed); training the new parameters is bitwise torch's AdamW in every
  configuration (a generic property: tests/test_optim_info.py);
* a released parameter whose gradient was held in host memory gets it back in ``p.grad``, bitwise, as a real
  tensor (torch's optimizers never touch ``p.grad`` of a parameter they lose).

The 2-rank FSDP2 version, with the real Trainer and accelerate, is tests/test_integrations_fsdp.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from configs import MODES, assert_bitwise_equal
from offload_adamw import OffloadAdamW, is_host_resident

#: the pipeline's modes (configs.MODES; the plain step keeps nothing of a parameter, and training after a swap in every
#: configuration is the generic property of tests/test_optim_info.py)
PIPELINE_MODES = ["kept", "freed", "update_in_backward"]


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))


def loss(net: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return net(torch.randn(5, 6, generator=g)).square().mean()


def exact_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def swap(opt: torch.optim.Optimizer, new: nn.Module) -> None:
    """What accelerate's fsdp2_switch_optimizer_parameters does: each group's list replaced by the new parameters."""
    mapping = iter(list(new.parameters()))
    for group in opt.param_groups:
        group["params"] = [next(mapping) for _ in group["params"]]


@pytest.mark.parametrize("mode", PIPELINE_MODES)
def test_a_swap_before_training_releases_the_original_parameters(mode):
    original, shards = model(), model()
    opt = OffloadAdamW(original.parameters(), **MODES[mode].kwargs(lr=1e-2))
    refs = [weakref.ref(p) for p in original.parameters()]
    hooked = [p._post_accumulate_grad_hooks for p in original.parameters()]
    assert all(hooked), "the pipeline did not hook the parameters at construction"
    swap(opt, shards)
    loss(shards, 0).backward()  # the first forward after the swap is where the pipeline looks
    kept_parameter = next(original.parameters())
    assert not kept_parameter._post_accumulate_grad_hooks, "the released parameter kept its hooks"
    del original, kept_parameter, hooked
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of {len(refs)} original parameters are still referenced"
    opt.step()
    assert opt.host_buffer_bytes()["gradients"] == exact_bytes(shards.parameters())


@pytest.mark.parametrize("mode", ["freed", "update_in_backward"])
def test_the_first_backward_after_a_swap_frees_the_new_parameters_gradients(mode):
    original, shards = model(), model()
    opt = OffloadAdamW(original.parameters(), **MODES[mode].kwargs(lr=1e-2))
    swap(opt, shards)
    loss(shards, 0).backward()
    assert all(is_host_resident(p.grad) for p in shards.parameters()), "the first step's gradients stayed on the device"
    opt.step()


@pytest.mark.parametrize("mode", PIPELINE_MODES)
def test_a_swap_in_mid_training_keeps_only_what_torch_keeps(mode):
    """After a step the old parameters have state; torch keeps it too (``opt.state`` is keyed by them). Once the user
    drops that state, nothing of the pipeline may keep them alive, and the buffers are the new parameters' bill."""
    first, second = model(), model(2)
    opt = OffloadAdamW(first.parameters(), **MODES[mode].kwargs(lr=1e-2))
    for step in range(2):
        loss(first, step).backward()
        opt.step()
        opt.zero_grad()
    refs = [weakref.ref(p) for p in first.parameters()]
    swap(opt, second)
    for step in range(2):
        loss(second, step).backward()
        opt.step()
        opt.zero_grad()
    for r in refs:
        opt.state.pop(r(), None)
    del first
    gc.collect()
    assert sum(r() is not None for r in refs) == 0, "the pipeline keeps swapped-out parameters alive"
    assert opt.host_buffer_bytes()["gradients"] == exact_bytes(second.parameters())


@pytest.mark.parametrize("edit", ["replace_one", "append", "delete_one", "add_param_group"])
def test_any_param_groups_edit_is_seen_before_the_next_backward(edit):
    net = model()
    params = list(net.parameters())
    opt = OffloadAdamW(params[:2], lr=1e-2, offload_gradients=True)
    added: list[torch.Tensor] = []
    removed: list[torch.Tensor] = []
    if edit == "replace_one":
        removed.append(opt.param_groups[0]["params"][0])
        opt.param_groups[0]["params"][0] = params[2]
        added.append(params[2])
    elif edit == "append":
        opt.param_groups[0]["params"].append(params[2])
        added.append(params[2])
    elif edit == "delete_one":
        removed.append(opt.param_groups[0]["params"].pop(0))
    else:
        opt.add_param_group({"params": [params[2], params[3]]})
        added += params[2:]
    loss(net, 0).backward()
    for p in added:
        assert is_host_resident(p.grad), "a parameter put into param_groups was not hooked before the backward"
    for p in removed:
        assert p.grad is not None and not is_host_resident(p.grad), "a removed parameter's gradient was taken"
    opt.step()


def test_a_released_parameters_host_gradient_comes_back_in_p_grad():
    net = model()
    opt = OffloadAdamW(net.parameters(), lr=1e-2, offload_gradients=True)
    reference = model()
    loss(reference, 0).backward()
    loss(net, 0).backward()
    assert all(is_host_resident(p.grad) for p in net.parameters())
    new = model(3)
    swap(opt, new)
    loss(new, 0)  # the first forward after a backward: the pipeline looks at param_groups again
    for p, q in zip(net.parameters(), reference.parameters()):
        assert not is_host_resident(p.grad), "the released parameter's p.grad still stands for a host buffer"
        assert_bitwise_equal(p.grad, q.grad, "the released parameter's gradient")
    opt.step()


def test_a_swap_frees_the_old_host_buffers_at_the_first_forward():
    original = nn.Linear(64, 64)
    shard = nn.Linear(64, 8)  # what FSDP2 leaves on one rank: a smaller tensor
    opt = OffloadAdamW(original.parameters(), lr=1e-2, offload_gradients=True)
    assert opt.host_buffer_bytes() == {"gradients": exact_bytes(original.parameters())}
    swap(opt, shard)
    shard(torch.ones(1, 64))
    assert opt.host_buffer_bytes() == {"gradients": exact_bytes(shard.parameters())}


def test_a_swap_seen_first_in_inference_mode_is_taken_in_at_the_next_forward_outside_it():
    """An evaluation under torch.inference_mode() between the swap and training must not lay out host buffers there:
    inference tensors cannot be written by the next backward's copies."""
    original, shards = model(), model()
    opt = OffloadAdamW(original.parameters(), lr=1e-2, offload_gradients=True)
    swap(opt, shards)
    with torch.inference_mode():
        loss(shards, 0)
    loss(shards, 1).backward()
    assert all(is_host_resident(p.grad) for p in shards.parameters())
    opt.step()
    assert opt.host_buffer_bytes()["gradients"] == exact_bytes(shards.parameters())


def test_a_pipeline_whose_optimizer_is_gone_is_passed_over_by_the_next_forward():
    # A pipeline built over an optimizer that is then let go waits in the forward pre-hook's set until the
    # collector finds it; the next module forward anywhere must not reach for the gone optimizer.
    from offload_adamw.accel.pipeline import PipelineConfig
    from offload_adamw.optim.bucket import pipeline_for

    model = nn.Linear(4, 4)
    target = OffloadAdamW(model.parameters(), transfer_pipeline=False)
    pipeline = pipeline_for(target, PipelineConfig(offload_gradients=True))
    gc.disable()
    try:
        del target
        other = nn.Linear(4, 4)
        other(torch.randn(2, 4)).sum().backward()  # raised ReferenceError from the first pipeline's refresh
    finally:
        gc.enable()
        pipeline.close()
