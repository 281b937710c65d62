"""Where parameter swaps, clipping in the model's order, updates during backward and placements meet (the CPU as device).

Properties:

* an optimizer dropped by its last reference (no cycle collector) takes with it what its on-device placements hold:
  the ring of a streamed group, the widening buffer of a resident one, and the device gradients that updates during
  backward recorded (``model.zero_grad()`` then frees them, as it does beside torch's AdamW);
* with updates during backward and no clipping, ``last_grad_norm`` of a mix of host and streamed or resident groups
  is the norm the hooks took, as for host groups alone (torch's ``clip_grad_norm_`` of the model, bitwise): the step
  reads no gradient again to know it (on an accelerator that re-read reduces host gradients on the host, other bits).
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
from torch import nn

from offload_adamw import OffloadAdamW

CHUNK = 1 << 20


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))


def loss(net: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return net(torch.randn(5, 6, generator=g)).square().mean()


def _placed(net: nn.Module, placement: str) -> list[dict]:
    """Weights off the host, biases on it: the groups list them in another order than the model."""
    params = list(net.parameters())
    return [{"params": params[0::2], "update_on": placement}, {"params": params[1::2], "weight_decay": 0.0}]


@pytest.mark.parametrize("placement", ["stream", "device"])
def test_a_dropped_optimizer_frees_its_device_buffers_and_landed_gradients(placement) -> None:
    net = model()
    warm = nn.Linear(2, 2)  # the first step of a process keeps its optimizer in a frame (torch's own AdamW too): not this one
    warm(torch.ones(1, 2)).sum().backward()
    torch.optim.AdamW(warm.parameters()).step()
    gc.collect()
    gc.disable()  # no collector: what the optimizer holds must go when its last reference does
    try:
        opt = OffloadAdamW(_placed(net, placement), lr=1e-2, offload_gradients=True, update_in_backward=True,
                           stream_chunk_bytes=CHUNK)
        for step in range(2):
            loss(net, step).backward()
            opt.step()
            opt.zero_grad()
        loss(net, 2).backward()
        time.sleep(0.1)  # the updates of this backward ran on the worker
        component = opt.transfer_pipeline.placements._components[placement]
        buffers = [weakref.ref(t) for t in (
            [r.raw for r in component._rings.values()] if placement == "stream" else list(component._buffers.values()))]
        assert buffers, "the placement made no device buffer: the test could not fail"
        device_grads = [weakref.ref(p.grad) for p in opt.param_groups[0]["params"]]
        del opt, component
        net.zero_grad(set_to_none=True)
        alive_buffers = sum(r() is not None for r in buffers)
        alive_grads = sum(r() is not None for r in device_grads)
    finally:
        gc.enable()
    assert alive_buffers == 0, f"{alive_buffers} device buffers of the dropped optimizer are still alive"
    assert alive_grads == 0, f"{alive_grads} device gradients cleared by model.zero_grad() are still alive"


@pytest.mark.parametrize("placement", ["stream", "device"])
def test_last_grad_norm_of_a_mix_with_updates_during_backward_is_the_hooks_norm(placement, monkeypatch) -> None:
    ours, theirs = model(1), model(1)
    opt = OffloadAdamW(_placed(ours, placement), lr=1e-2, weight_decay=0.1, offload_gradients=True,
                       update_in_backward=True, stream_chunk_bytes=CHUNK)
    ref = torch.optim.AdamW([{k: v for k, v in g.items() if k != "update_on"} for g in _placed(theirs, "host")],
                            lr=1e-2, weight_decay=0.1, fused=True)
    reads: list[int] = []
    get_total_norm = torch.nn.utils.get_total_norm

    def counted(*args, **kwargs):
        reads.append(1)
        return get_total_norm(*args, **kwargs)

    for step in range(3):
        loss(ours, step).backward()
        with monkeypatch.context() as patch:
            patch.setattr(torch.nn.utils, "get_total_norm", counted)
            opt.step()
        opt.zero_grad()
        loss(theirs, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), float("inf"))
        ref.step()
        ref.zero_grad()
        assert opt.last_grad_norm is not None and torch.equal(opt.last_grad_norm, norm), step
    assert not reads, f"the step read the gradients again {len(reads)} times to know their norm"
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
