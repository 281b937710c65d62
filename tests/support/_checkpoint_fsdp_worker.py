"""The 2-process half of tests/test_checkpoint_fsdp.py: checkpoint.save and load of an FSDP2 model (gloo).

Run as ``python tests/support/_checkpoint_fsdp_worker.py --out DIR``: two ranks build a model whose first layer
stays a plain module and whose second is sharded with ``fully_shard`` (so ``1.weight`` is the first
DTensor entry of its state), train one step with OffloadAdamW, then try ``checkpoint.save`` (with the
optimizer, and of the model alone) and ``checkpoint.load`` of a checkpoint of the same model unsharded.
Each rank writes ``DIR/rank{r}.json``: per attempt the error's type and message (or null), and the
entries under its save directory afterwards.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _distributed_common import spawn_ranks
from offload_adamw import OffloadAdamW, checkpoint

WORLD = 2


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))


def attempt(call) -> dict | None:
    try:
        call()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return None


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    root = Path(out) / f"rank{rank}"
    root.mkdir(parents=True)
    plain = build()
    plain_optimizer = OffloadAdamW(plain.parameters(), lr=1e-2)
    plain(torch.randn(3, 6)).square().mean().backward()
    plain_optimizer.step()
    unsharded = checkpoint.save(root / "unsharded", plain, plain_optimizer)
    model = build()
    fully_shard(model[1], mesh=init_device_mesh("cpu", (WORLD,)))
    optimizer = OffloadAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    optimizer.step()
    before = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone() for k, v in model.state_dict().items()}
    result = {
        "save": attempt(lambda: checkpoint.save(root / "sharded", model, optimizer)),
        "save_model_only": attempt(lambda: checkpoint.save(root / "sharded-model", model, None)),
        "load": attempt(lambda: checkpoint.load(unsharded, model, optimizer)),
        "entries": sorted(p.name for p in root.iterdir()),
    }
    after = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    result["load_changed_nothing"] = all(torch.equal(after[k], before[k]) for k in before)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    spawn_ranks(worker, parser.parse_args().out, world=WORLD)


if __name__ == "__main__":
    main()
