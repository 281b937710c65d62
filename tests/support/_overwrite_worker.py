"""A process that replaces one checkpoint over and over (``overwrite=True``), for tests/test_checkpoint_races.py.

    python _overwrite_worker.py PATH STOP_FILE MAX_SAVES [READY_FILE] [sharded]

Save ``i`` (1, 2, ...) holds the value ``i`` everywhere a load could read it: every model entry, every
optimizer state (moments and step count), the recorded step, ``extra["id"]`` and the tensor
``extra["t"]``, so a load that mixes two saves is seen in its result. Runs until STOP_FILE exists or
MAX_SAVES saves are done, creating READY_FILE after its first save;
prints the number of saves. ``OFFLOAD_ADAMW_CHECKPOINT_EXCHANGE=0`` in the
environment selects the two-rename publication. With ``sharded`` the model is under ``fully_shard`` on a
1-rank gloo group of this process (its state DTensors, its saves DCP's sharded planning), and a load into the
plain model reshards. Also imported by the concurrent-save worker for ``build`` and ``fill``.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch

from offload_adamw import OffloadAdamW, checkpoint

WIDTH = 192  # tensors of about 0.15 MB each: reading and hashing them takes a while


def build(*, sharded: bool = False) -> tuple[torch.nn.Module, OffloadAdamW]:
    """The model and its optimizer with every state created; ``sharded``: under fully_shard on a 1-rank gloo group
    of its own (a free port of its own, so that forked processes each have one)."""
    if sharded:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    if sharded:
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = OffloadAdamW(model.named_parameters(), lr=1e-3, pin_memory=False)
    model(torch.ones(1, WIDTH)).sum().backward()
    optimizer.step()  # creates every state
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def fill(model: torch.nn.Module, optimizer: OffloadAdamW, value: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                optimizer.state[p][key].fill_(value)


def main(path: Path, stop: Path, max_saves: int, ready: Path | None, sharded: bool) -> int:
    torch.set_num_threads(1)
    model, optimizer = build(sharded=sharded)
    saves = 0
    while saves < max_saves and not stop.exists():
        saves += 1
        fill(model, optimizer, saves)
        extra = {"id": saves, "t": torch.full((WIDTH,), float(saves))}
        checkpoint.save(path, model, optimizer, extra=extra, step=saves, overwrite=True, rng=False)
        if ready is not None and saves == 1:
            ready.touch()
    print(saves)
    if sharded:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "sharded"]
    sys.exit(main(Path(args[0]), Path(args[1]), int(args[2]), Path(args[3]) if len(args) > 3 else None,
                  "sharded" in sys.argv[1:]))
