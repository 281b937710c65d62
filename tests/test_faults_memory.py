"""Host-memory pre-flight: the bill is what OffloadAdamW allocates; too little memory fails early, with figures."""

from __future__ import annotations

import os
import resource
import warnings

import pytest
import torch

from offload_adamw import OffloadAdamW
from offload_adamw.optim.preflight import ENV_AVAILABLE, ENV_SWITCH, HostMemoryError, check_host_memory, host_memory, state_bill

# (parameter dtype, amsgrad): every kind of state the optimizer can allocate.
CONFIGS = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False), (torch.float64, True)]


def model_of(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False)).to(dtype)


def backward(model: torch.nn.Module, dtype: torch.dtype) -> None:
    model(torch.ones(2, 7, dtype=dtype)).float().sum().backward()


def fresh_of(optimizer):
    return [(g, i) for g in optimizer.param_groups for i, p in enumerate(g["params"]) if not optimizer.state.get(p)]


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(ENV_AVAILABLE, raising=False)
    monkeypatch.delenv(ENV_SWITCH, raising=False)


@pytest.mark.parametrize("dtype,amsgrad", CONFIGS)
def test_bill_equals_what_the_optimizer_allocates(dtype, amsgrad):
    model = model_of(dtype)
    optimizer = OffloadAdamW(model.parameters(), amsgrad=amsgrad, pin_memory=False)
    bill = state_bill(fresh_of(optimizer), pin_memory=False)
    backward(model, dtype)
    optimizer.step()
    assert bill.total == bill.moments + bill.masters + bill.steps == optimizer.host_state_bytes()
    masters = sum(s["master_param"].nbytes for s in optimizer.state.values() if "master_param" in s)
    assert bill.masters == masters and bill.tensors == 3


def test_bill_figures_by_hand():
    """bf16 Linear(100, 10): 1010 elements; 4 bytes each for m, v and the master (docs/contract.md#memory-bill)."""
    layer = torch.nn.Linear(100, 10).to(torch.bfloat16)
    optimizer = OffloadAdamW(layer.parameters())
    bill = state_bill(fresh_of(optimizer), pin_memory=False)
    assert (bill.moments, bill.masters, bill.steps) == (8080, 4040, 8)
    pinned = state_bill(fresh_of(optimizer), pin_memory=True)
    # per tensor and kind, power-of-two blocks: 1000 elements * 4 B = 4000 -> 4096; 10 * 4 = 40 -> 64
    assert pinned.pinned_blocks == 3 * 4096 + 3 * 64
    assert pinned.total == pinned.pinned_blocks + 8


@pytest.mark.parametrize("pin_memory", [False, True])
def test_refusal_gives_the_figures_per_kind(pin_memory):
    layer = torch.nn.Linear(100, 10).to(torch.bfloat16)
    optimizer = OffloadAdamW([("layer.weight", layer.weight), ("layer.bias", layer.bias)])
    fresh = fresh_of(optimizer)
    need = state_bill(fresh, pin_memory=pin_memory).total
    assert check_host_memory(fresh, pin_memory=pin_memory, available_bytes=need, memlock="ignore").total == need
    with pytest.raises(HostMemoryError) as info:
        check_host_memory(fresh, pin_memory=pin_memory, available_bytes=need - 1, memlock="ignore")
    message = str(info.value)
    for figure in ("moments 7.9 KiB (8,080 bytes)", "masters 3.9 KiB (4,040 bytes)", "step counters 8 bytes", f"{need - 1:,} bytes"):
        assert figure in message, (figure, message)
    assert ("power-of-two blocks" in message) == pin_memory and ("pin_memory=False" in message) == pin_memory
    assert info.value.bill.total == need and info.value.memory.available == need - 1


def test_step_fails_before_allocating_anything(monkeypatch):
    model = model_of(torch.bfloat16)
    backward(model, torch.bfloat16)
    optimizer = OffloadAdamW(model.parameters(), pin_memory=False)
    before = [p.detach().clone() for p in model.parameters()]
    monkeypatch.setenv(ENV_AVAILABLE, "600")  # the bill is 672 bytes
    with pytest.raises(HostMemoryError, match=ENV_AVAILABLE):
        optimizer.step()
    assert len(optimizer.state) == 0 and optimizer.host_state_bytes() == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is not None for p in model.parameters())
    monkeypatch.setenv(ENV_SWITCH, "0")
    optimizer.step()  # switched off: the same step runs
    assert optimizer.host_state_bytes() > 0


def test_only_parameters_without_state_are_billed(monkeypatch):
    model = model_of(torch.float32)
    optimizer = OffloadAdamW(model[0].parameters(), pin_memory=False)
    backward(model, torch.float32)
    optimizer.step()
    optimizer.add_param_group({"params": model[1].parameters()})
    new_bill = state_bill([(optimizer.param_groups[1], 0)], pin_memory=False).total
    monkeypatch.setenv(ENV_AVAILABLE, str(new_bill))
    optimizer.step()  # fits exactly: the old group's state is not counted again
    assert float(optimizer.state[model[1].weight]["step"]) == 1.0


def test_measured_host_memory_is_plausible():
    memory = host_memory()
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory.sources, "no figure found (no /proc/meminfo?)"
    assert 0 < memory.available <= physical


@pytest.fixture
def low_memlock():
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, hard))
    yield 4096
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_pinned_state_above_memlock_warns_or_raises(low_memlock):
    layer = torch.nn.Linear(100, 10)
    optimizer = OffloadAdamW(layer.parameters())
    fresh = fresh_of(optimizer)
    big = 1 << 40
    with pytest.warns(RuntimeWarning, match="RLIMIT_MEMLOCK 4.0 KiB"):
        check_host_memory(fresh, pin_memory=True, available_bytes=big)
    with pytest.raises(HostMemoryError, match="RLIMIT_MEMLOCK"):
        check_host_memory(fresh, pin_memory=True, available_bytes=big, memlock="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_host_memory(fresh, pin_memory=True, available_bytes=big, memlock="ignore")
        check_host_memory(fresh, pin_memory=False, available_bytes=big)  # unpinned state is not locked
