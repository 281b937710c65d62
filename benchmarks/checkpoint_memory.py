"""Peak host memory of a checkpoint save, against the size of the state saved (one process, CPU).

    python benchmarks/checkpoint_memory.py                       # about 200 MB of state, both kinds of model
    python benchmarks/checkpoint_memory.py --mb 50 --json out.json

A model of fp32 linear layers is trained one step by OffloadAdamW, so that its state is the parameters
and the two moments (``--mb`` MB in all). Then, in a fresh process for each layout (so that one's
allocator does not serve the other), ``checkpoint.save`` runs while a thread samples the resident set
(``/proc/self/statm``) every millisecond. Both write layout 2 (DCP's planning, the streaming safetensors
writer), the only format ``save`` writes:

* ``one-process``: the plain model, no process group (what one process and, per rank, DDP write);
* ``sharded``: the same model under ``fully_shard`` on a 1-rank gloo group (what FSDP2 runs write).

Printed per layout: the state's size, the resident set before the save and its peak during it, and the
peak's excess over the state (1.0 = the save held a second copy of the whole state). Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def one(layout: str, mb: float) -> dict:
    import torch

    from offload_adamw import OffloadAdamW, checkpoint

    torch.set_num_threads(1)
    width = 1024
    layers = max(1, round(mb * 2**20 / (3 * 4 * width * width)))  # parameters + two moments, fp32
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    if layout == "sharded":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
        dist.init_process_group("gloo", rank=0, world_size=1)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = OffloadAdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state_bytes = 3 * sum(p.numel() * 4 for p in model.parameters())
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    with tempfile.TemporaryDirectory() as tmp:
        before = rss()
        peak[0] = before
        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.perf_counter()
        checkpoint.save(Path(tmp) / "ck", model, optimizer)
        seconds = time.perf_counter() - started
        done.set()
        sampler.join()
    return {"layout": layout, "state_mb": state_bytes / 2**20, "rss_before_mb": before / 2**20,
            "rss_peak_mb": peak[0] / 2**20, "excess_over_state": (peak[0] - before) / state_bytes, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=200.0, help="size of the state (parameters and moments), MB")
    parser.add_argument("--json", default=None)
    parser.add_argument("--layout", choices=("one-process", "sharded"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout:
        print(json.dumps(one(args.layout, args.mb)))
        return
    rows = []
    for layout in ("one-process", "sharded"):
        out = subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--layout", layout],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for r in rows:
        print(f"{r['layout']:>12}: state {r['state_mb']:.0f} MB, RSS {r['rss_before_mb']:.0f} MB before, "
              f"{r['rss_peak_mb']:.0f} MB peak (+{r['excess_over_state']:.2f} x the state), {r['seconds']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
