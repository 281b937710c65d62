"""Placements on a CUDA device (``gpu``; skipped without one): docs/placement.md's bitwise guarantee where it matters.

Each group is held to the reference of where its update runs: a streamed or resident group to
``torch.optim.AdamW(fused=True)`` on float32 master copies on the GPU (the fp32-master AdamW people run when it
fits), fed the upcast gradients, the model receiving the round-to-nearest copy; a host group to the same
optimizer on float32 copies in host memory (the host kernel's definition). Rows: bf16 and float32 models,
placements alone and mixed, accumulation 1 and 4, max_grad_norm against torch's clip_grad_norm_ over the same
device gradients, fp16 autocast with GradScaler, updates during backward. Then: streamed state is pinned host
memory and resident state lives on the device, ``device_buffer_bytes()`` counts what is allocated, and a ring that
cannot fit on the device is refused with the figures before any update.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _parity import same_bits
from offload_adamw import OffloadAdamW, OffloadGradScaler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WIDTH = 256
BLOCKS = 4
CHUNK = 1 << 20
CLIP = 0.05


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(BLOCKS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _groups(model: Blocks, pattern: tuple[str, ...]) -> list[dict]:
    return [{"params": list(b.parameters()), "update_on": pattern[k % len(pattern)], "amsgrad": k == 1}
            for k, b in enumerate(model.blocks)]


ROWS = [
    # (model dtype, placements of the blocks in turn, accumulation, clip, GradScaler, updates during backward)
    ("bfloat16", ("stream",), 1, False, False, False),
    ("bfloat16", ("device", "stream", "host"), 4, True, False, False),
    ("float32", ("stream", "device"), 1, False, True, False),
    ("bfloat16", ("stream", "host"), 1, False, False, True),
    ("bfloat16", ("device", "stream"), 4, True, False, True),
]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r[0]}-{'+'.join(r[1])}-acc{r[2]}-clip{r[3]}-scaler{r[4]}-inbwd{r[5]}")
def test_each_group_is_bitwise_the_reference_of_where_it_runs(row) -> None:
    dtype_name, pattern, accumulation, clip, scaled, in_backward = row
    assert not (scaled and "host" in pattern), "one GradScaler drives one reference optimizer"
    dtype = getattr(torch, dtype_name)
    model = Blocks().to("cuda", dtype)
    reference = copy.deepcopy(model)
    groups = _groups(model, pattern)
    ref_groups = _groups(reference, pattern)
    copies = {}
    for g in ref_groups:
        where = "cpu" if g["update_on"] == "host" else "cuda"
        for p in g["params"]:
            copies[p] = nn.Parameter(p.detach().to(where, torch.float32, copy=True))
    # One torch optimizer per side of the host: each fused op runs where its group's update runs.
    theirs = [torch.optim.AdamW([{k: v for k, v in g.items() if k != "update_on"} | {"params": [copies[p] for p in g["params"]]}
                                 for g in ref_groups if (g["update_on"] == "host") == on_host], lr=1e-3, weight_decay=0.1,
                                fused=True)
              for on_host in (True, False) if any((g["update_on"] == "host") == on_host for g in ref_groups)]
    ours = OffloadAdamW(groups, lr=1e-3, weight_decay=0.1, offload_gradients=in_backward, update_in_backward=in_backward,
                        max_grad_norm=CLIP if clip else None, stream_chunk_bytes=CHUNK)
    scaler_a = OffloadGradScaler("cuda", init_scale=2.0**10) if scaled else None
    scalers_b = [torch.amp.GradScaler("cuda", init_scale=2.0**10) for _ in theirs] if scaled else []
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        batches = [torch.randn(64, WIDTH, generator=gen).to("cuda", dtype) for _ in range(accumulation)]
        for net, scaler in ((model, scaler_a), (reference, scalers_b[0] if scalers_b else None)):
            for micro, x in enumerate(batches):
                context = ours.no_sync() if net is model and micro < accumulation - 1 else torch.autocast("cuda", enabled=False)
                with context, torch.autocast("cuda", dtype=torch.float16, enabled=scaled):
                    loss = net(x).float().square().mean() / accumulation
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for g in ref_groups for p in g["params"]], CLIP)
        for p in reference.parameters():
            copies[p].grad = p.grad.detach().to(copies[p].device, torch.float32, copy=True)
        if scaled:
            scaler_a.step(ours)
            scaler_a.update()
            for opt, scaler in zip(theirs, scalers_b):
                scaler.step(opt)
                scaler.update()
        else:
            ours.step()
            for opt in theirs:
                opt.step()
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(copies[p])
        ours.zero_grad()
        reference.zero_grad()
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert same_bits(p, q)
        assert same_bits(ours.master_value(p).cpu(), copies[q].detach().cpu())
        state = next(opt.state[copies[q]] for opt in theirs if copies[q] in opt.state)
        assert same_bits(ours.state[p]["exp_avg_sq"].cpu(), state["exp_avg_sq"].cpu())


def test_state_lives_where_its_placement_says_and_is_counted() -> None:
    model = Blocks().to("cuda", torch.bfloat16)
    opt = OffloadAdamW(_groups(model, ("stream", "device")), stream_chunk_bytes=CHUNK, stream_buffers=3)
    model(torch.randn(8, WIDTH, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    resident = 0
    for k, block in enumerate(model.blocks):
        for p in block.parameters():
            for key, value in opt.state[p].items():
                if key == "step":
                    assert value.device.type == "cpu"
                elif k % 2 == 0:
                    assert value.device.type == "cpu" and value.is_pinned(), (k, key)
                else:
                    assert value.device == p.device, (k, key)
                    resident += value.numel() * value.element_size()
    assert opt.device_buffer_bytes() == 3 * CHUNK + CHUNK + resident  # ring, widening buffer, resident state
    assert "gradients" not in opt.host_buffer_bytes()


def test_a_ring_that_does_not_fit_the_device_is_refused_before_any_update() -> None:
    from offload_adamw.optim.placement import DeviceMemoryError, device_free_bytes

    model = Blocks().to("cuda", torch.bfloat16)
    too_big = (device_free_bytes(torch.device("cuda")) // 2 + (1 << 30)) // 4096 * 4096
    opt = OffloadAdamW(model.parameters(), update_on="stream", stream_chunk_bytes=too_big)
    model(torch.randn(8, WIDTH, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DeviceMemoryError, match="stream ring buffers on cuda"):
        opt.step()
    assert all(same_bits(a, p) for a, p in zip(before, model.parameters())) and not opt.state
