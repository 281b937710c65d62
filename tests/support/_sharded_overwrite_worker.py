"""A process that replaces one sharded (layout 2) checkpoint over and over, for tests/test_checkpoint_sharded_races.py.

    python _sharded_overwrite_worker.py PATH STOP_FILE MAX_SAVES [READY_FILE]

The model of ``_overwrite_worker.py`` under ``fully_shard`` on a 1-rank gloo group (so ``checkpoint.save``
writes the sharded layout through DCP); save ``i`` holds the value ``i`` everywhere a load could read it
(model, moments, step counts, recorded step, ``extra``). Runs until STOP_FILE exists or MAX_SAVES saves
are done, creating READY_FILE after its first save; prints the number of saves.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from offload_adamw import OffloadAdamW, checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _overwrite_worker import WIDTH, fill


def main(path: Path, stop: Path, max_saves: int, ready: Path | None) -> int:
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = OffloadAdamW(model.parameters(), lr=1e-3, pin_memory=False)
    model(torch.ones(1, WIDTH)).sum().backward()
    optimizer.step()  # creates every state
    optimizer.zero_grad(set_to_none=True)
    saves = 0
    while saves < max_saves and not stop.exists():
        saves += 1
        fill(model, optimizer, saves)
        extra = {"id": saves, "t": torch.full((WIDTH,), float(saves))}
        checkpoint.save(path, model, optimizer, extra=extra, step=saves, overwrite=True, rng=False)
        if ready is not None and saves == 1:
            ready.touch()
    print(saves)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]) if len(sys.argv) > 4 else None))
