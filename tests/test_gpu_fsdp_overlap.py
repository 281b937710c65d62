"""FSDP2 on one GPU (NCCL, world size 1): freed gradients and host updates during backward (``gpu``).

Skipped without CUDA. 8 sharded blocks trained with FSDP2 + OffloadAdamW(offload_gradients=True,
update_in_backward=True[, max_grad_norm]) and, from the same initialisation on the same batches with the
same user calls, with FSDP2 + torch.optim.AdamW(fused=True) as the README defines parity on CUDA: torch's
fused AdamW on float32 host copies of the reference's local shards (the CUDA fused kernel rounds
differently), clipped with torch's ``clip_grad_norm_`` over the reference model's device gradients.
Micro-batches that only accumulate run with ``set_requires_gradient_sync(False)`` on both.

Properties, for accumulation 1 and 4 and with and without clipping: every shard, master and moment is
bitwise equal to the reference, and so is the gradient norm; after backward each ``p.grad`` stands for a
host shard (no device gradient); each FSDP group is one bucket. Without clipping some of the host update
runs before backward ends (the timeline's overlap > 0 in a step after the first, which knows no order yet).
"""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from configs import same_bits
from offload_adamw import OffloadAdamW, is_host_resident

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCKS = 8
WIDTH = 256
ROWS = 256
STEPS = 5
LR = 1e-3
WEIGHT_DECAY = 0.1
CLIP = 0.05  # below every step's norm: the clipping acts
CASES = [(None, 1), (None, 4), (CLIP, 1), (CLIP, 4)]  # (max_grad_norm, accumulation)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(BLOCKS)
        )
        torch.random.set_rng_state(generator_state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _sharded(mesh, device: str) -> Blocks:
    from torch.distributed.fsdp import fully_shard

    model = Blocks().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _shard(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as float32 (a DTensor norm: its reduced value), for same_bits."""
    whole = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return whole.float()


def _batch(step: int, micro: int, device: str) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(100 * step + micro)).to(device)


def train_and_compare(mesh, device: str, clip: float | None, accumulation: int) -> dict:
    """Both trainings on ``mesh``; asserts bitwise equality and returns what the timelines measured."""
    reference = _sharded(mesh, device)
    copies = [nn.Parameter(_shard(p.detach()).to("cpu", torch.float32, copy=True)) for p in reference.parameters()]
    theirs = torch.optim.AdamW(copies, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    model = _sharded(mesh, device)
    ours = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, offload_gradients=True,
                        update_in_backward=True, max_grad_norm=clip)
    timelines = []
    norms_differ = []
    for step in range(STEPS):
        for micro in range(accumulation):
            x = _batch(step, micro, device)
            for net in (model, reference):
                net.set_requires_gradient_sync(micro == accumulation - 1)
                (net(x).square().mean() / accumulation).backward()
        assert all(p.grad is not None and is_host_resident(p.grad) for p in model.parameters()), \
            "a device gradient was kept (offload_gradients=True frees each one after its copy)"
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        for c, p in zip(copies, reference.parameters()):
            c.grad = _shard(p.grad).detach().to("cpu", torch.float32, copy=True)
        ours.step()
        theirs.step()
        if clip is not None:
            assert ours.last_grad_norm is not None
            if not same_bits(_norm(ours.last_grad_norm), _norm(norm)):
                norms_differ.append(step)
        with torch.no_grad():
            for c, p in zip(copies, reference.parameters()):
                _shard(p).copy_(c)
        timelines.append(ours.last_step_timeline())
        ours.zero_grad()
        reference.zero_grad()
        theirs.zero_grad()
    if device == "cuda":
        torch.cuda.synchronize()
    differing = [] if not norms_differ else [f"gradient norm at steps {norms_differ}"]
    for index, (p, q, c) in enumerate(zip(reference.parameters(), model.parameters(), copies)):
        if not same_bits(p, q):  # a DTensor: its local shard
            differing.append(f"shard {index}: max |diff| {(_shard(p) - _shard(q)).abs().max().item():.3g}")
        if not same_bits(ours.master_param(q), c):
            differing.append(f"master {index}")
        for key in ("exp_avg", "exp_avg_sq"):
            if not same_bits(ours.state[q][key], theirs.state[c][key]):
                differing.append(f"{key} {index}")
    assert not differing, "not bitwise FSDP2 + torch.optim.AdamW(fused=True): " + "; ".join(differing[:6])
    assert all(t is not None for t in timelines)
    return {"overlaps": [t.overlap for t in timelines], "buckets": [len(t.buckets) for t in timelines]}


@pytest.fixture(scope="module")
def cuda_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("clip", "accumulation"), CASES, ids=[f"clip={c}-accumulation={a}" for c, a in CASES])
def test_fsdp2_nccl_updates_during_backward_are_bitwise_fused_adamw(cuda_mesh, clip, accumulation) -> None:
    measured = train_and_compare(cuda_mesh, "cuda", clip, accumulation)
    assert measured["buckets"] == [BLOCKS] * STEPS, f"one bucket per FSDP group: {measured}"
    assert measured["overlaps"][0] == 0.0, "the first step knows no order of gradients: nothing runs early"
    if clip is None:
        assert max(measured["overlaps"][1:]) > 0.0, f"no host update ran before backward ended: {measured}"
    else:
        assert max(measured["overlaps"]) == 0.0, f"a clipped update started before the global norm was known: {measured}"
