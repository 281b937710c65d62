"""Four gloo ranks train a small model under HSDP (FSDP2 over a 2 x 2 mesh: 2 replicas of 2-way shards) with
OffloadAdamW and with torch's AdamW, and report what each rank holds and whether the two runs agree.

Run as ``python _hsdp_worker.py OUT``: rank r writes OUT.r (JSON): the host bytes OffloadAdamW allocated, the
planner's per-rank bill for this rank's shard index, and whether the parameters are torch's bit for bit.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from offload_adamw import OffloadAdamW
from offload_adamw.planning.planner import fsdp_rank_host_bytes

REPLICAS, SHARDS = 2, 2
STEPS = 3


def model() -> nn.Module:
    torch.manual_seed(0)
    # rows 13 and 7: the shards are uneven (7 + 6, 4 + 3), as the planner pads them
    return nn.Sequential(nn.Linear(16, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 3))


def train(optimizer_factory, rank: int) -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[int, ...]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = model()
    shapes = [tuple(p.shape) for p in net.parameters()]
    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = optimizer_factory(net.parameters())
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 16, generator=g)
        net(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return net, optimizer, shapes


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=REPLICAS * SHARDS)
    ours, opt, shapes = train(lambda ps: OffloadAdamW(ps, lr=1e-2, transfer_pipeline=True), rank)
    theirs, _, _ = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), rank)
    bill = fsdp_rank_host_bytes(shapes, world=SHARDS, rank=rank % SHARDS, param_dtype="float32", on_host=True)
    same = [torch.equal(a.detach().full_tensor(), b.detach().full_tensor())
            for a, b in zip(ours.parameters(), theirs.parameters())]
    Path(f"{out}.{rank}").write_text(json.dumps({
        "state": opt.host_state_bytes(), "buffers": opt.host_buffer_bytes(), "bill_state": bill.state,
        "bill_buffers": bill.buffers(), "bitwise_equal": all(same), "ranks_on_node": opt.node.ranks,
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(_worker, args=(free, sys.argv[1]), nprocs=REPLICAS * SHARDS, join=True)
