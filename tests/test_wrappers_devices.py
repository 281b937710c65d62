"""Where parameters live, and when the pipeline's host buffers are made (the CPU as device; CUDA where marked).

* Meta parameters hold no data: they do not switch the pipeline on and get no host buffer; a step
  with them is refused by the pre-flight, before anything is allocated.
* Every host buffer of the pipeline passes the host-memory pre-flight before it is allocated.
* Parameters cast or moved after construction get buffers laid out for their new dtype and device.
* With freed gradients, accumulation (the wait for the copy, the host add) runs on the pipeline's worker
  thread, never on the thread that runs backward, also for 3 and more micro-batches.
* CUDA (``gpu``): a CUDA tensor lr, parameters moved to CUDA after construction, arenas dropped while
  copies are in flight.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from offload_adamw import OffloadAdamW

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)


def _x(i: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(i)).to(device)


def _train_pair(model, opt, ref, ref_opt, *, steps=3, micro=1, device="cpu", dtype=None):
    for step in range(steps):
        for m, o in ((model, opt), (ref, ref_opt)):
            for k in range(micro):
                x = _x(step * 10 + k, device)
                m(x if dtype is None else x.to(dtype)).float().square().mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())


def test_meta_parameters_do_not_switch_the_pipeline_on():
    with torch.device("meta"):
        model = nn.Linear(4096, 4096)
    assert OffloadAdamW(model.parameters()).transfer_pipeline is None


def test_meta_parameters_get_no_buffers_and_the_step_refuses_them():
    # A meta model stands for a large one (here 4096 x 4096): constructing the optimizer allocates nothing
    # for it; materialising a model makes new parameters (as for torch's optimizers, build it after that).
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 3))
    opt = OffloadAdamW(model.parameters(), lr=1e-2, transfer_pipeline=True, offload_gradients=True)
    assert opt.host_buffer_bytes() == {}, "buffers were allocated for meta parameters"
    model(torch.ones(2, 4096, device="meta")).sum().backward()
    with pytest.raises(ValueError, match="meta device.*materialize"):
        opt.step()
    assert not opt.state and opt.host_buffer_bytes() == {}


def test_pipeline_buffers_pass_the_host_memory_preflight(monkeypatch):
    monkeypatch.setenv("OFFLOAD_ADAMW_HOST_AVAILABLE_BYTES", "1000")
    model = nn.Linear(100, 100)
    with pytest.raises(MemoryError, match=r"40,400 bytes of host gradients buffers.*Nothing was allocated"):
        OffloadAdamW(model.parameters(), transfer_pipeline=True, offload_gradients=True)


def test_parameters_cast_after_construction_accumulate_in_their_new_dtype():
    # Freed gradients accumulate in the gradient's dtype, as autograd does: after model.to(bfloat16)
    # the host buffers must be bfloat16 too, else the sums are float32 sums.
    model, ref = _model(), _model()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, transfer_pipeline=True, offload_gradients=True)
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    ref_opt = OffloadAdamW(ref.parameters(), lr=1e-2)  # the plain step reads bfloat16 p.grad that autograd summed
    _train_pair(model, opt, ref, ref_opt, micro=3, dtype=torch.bfloat16)
    assert all(g.dtype == torch.bfloat16 for g in opt.gradient_tensors() or [torch.zeros((), dtype=torch.bfloat16)])


class _HostAdds(TorchDispatchMode):
    """Records in-place adds into the pipeline's host buffers on the thread that runs the mode."""

    def __init__(self, buffers):
        super().__init__()
        self.spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
        self.hits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add_.Tensor and any(lo <= args[0].data_ptr() < hi for lo, hi in self.spans):
            self.hits += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("micro", [2, 3, 5])
def test_accumulation_runs_off_the_backward_thread(micro):
    model, ref = _model(), _model()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, transfer_pipeline=True, offload_gradients=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    model(_x(0)).sum().backward()
    opt.zero_grad()
    pipeline = opt.transfer_pipeline
    mode = _HostAdds([b for a in pipeline.slots.arenas() for b in a.buffers])
    with mode:
        for k in range(micro):
            model(_x(k)).square().mean().backward()
    assert mode.hits == 0, "the backward thread added into a host gradient"
    for k in range(micro):
        ref(_x(k)).square().mean().backward()
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensor_lr_reaches_the_host_kernel_as_its_value():
    results = []
    for lr in (torch.tensor(1e-2, device="cuda"), torch.tensor(1e-2)):
        model = _model("cuda")
        opt = OffloadAdamW(model.parameters(), lr=lr)
        for step in range(3):
            model(_x(step, "cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().cpu() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("freed", [False, True])
def test_parameters_moved_to_cuda_after_construction(freed):
    model, ref = _model(), _model("cuda")
    opt = OffloadAdamW(model.parameters(), lr=1e-2, transfer_pipeline=True, offload_gradients=freed)
    model.cuda()
    ref_opt = OffloadAdamW(ref.parameters(), lr=1e-2, offload_gradients=freed)
    _train_pair(model, opt, ref, ref_opt, micro=3, device="cuda")
    assert opt.pinned_bytes() > 0, "the buffers of the moved parameters are not page-locked"


@pytest.mark.gpu
@needs_cuda
def test_dropping_an_optimizer_between_backward_and_step():
    model = _model("cuda")
    opt = OffloadAdamW(model.parameters(), offload_gradients=True)
    for k in range(3):
        model(_x(k, "cuda")).sum().backward()
    del opt  # arenas unregistered after the pipeline's own streams are synchronised
    torch.cuda.synchronize()
    model2 = copy.deepcopy(model)
    OffloadAdamW(model2.parameters(), offload_gradients=True)


@pytest.mark.gpu
@needs_cuda
def test_accumulation_buffers_are_page_locked_after_backward_not_inside_it():
    model = _model("cuda")
    opt = OffloadAdamW(model.parameters(), offload_gradients=True)
    exact = sum(p.numel() * p.element_size() for p in model.parameters())
    before = opt.pinned_bytes()  # gradient and staging buffers, page-locked at construction
    for k in range(3):  # the second micro-batch lays out the accumulation buffers, inside backward
        model(_x(k, "cuda")).square().mean().backward()
    assert opt.host_buffer_bytes()["accumulation"] == exact
    assert opt.pinned_bytes() == before, "accumulation buffers were page-locked inside backward"
    opt.step()
    assert opt.pinned_bytes() == before + exact, "the step did not page-lock the accumulation buffers"
