"""Two gloo ranks find how many of them share this host (distributed/node.py), each way the library can tell.

Run as ``python _node_worker.py OUT``: rank r writes OUT.r, a JSON object of what each way found.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from offload_adamw import OffloadAdamW
from offload_adamw.distributed import node


def _worker(rank: int, port: int, out: str) -> None:
    for name in ("LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                 "SLURM_PROCID", "SLURM_NODEID"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1
    # No MASTER_ADDR: only a gather of the host names can tell.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    found: dict[str, object] = {}
    found["before_gather"] = node.ranks_on_node(gather=False)
    optimizer = OffloadAdamW([torch.nn.Parameter(torch.ones(4))])  # every rank constructs: the gather meets
    found["optimizer"] = [optimizer.node.ranks, optimizer.node.ranks_source, optimizer.host_threads]
    found["after_gather"] = node.ranks_on_node(gather=False)  # the gathered answer is kept
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    node._gathered.clear()
    found["loopback"] = node.ranks_on_node(gather=False)
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    found["variable"] = node.ranks_on_node()
    found["cores"] = len(os.sched_getaffinity(0))
    Path(f"{out}.{rank}").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(_worker, args=(free, sys.argv[1]), nprocs=2, join=True)
