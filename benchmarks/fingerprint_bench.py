"""What the device fingerprint of updates during backward costs (docs/update-in-backward.md).

    python benchmarks/fingerprint_bench.py            # on the CPU (the simulated device's case)
    python benchmarks/fingerprint_bench.py --device cuda

Printed, each the median of ``--rounds`` timings: the fingerprint of one float32 tensor of 16 KiB, 4 MiB and 64 MiB
beside a ``clone`` of it (two reads against a read and a write) and the host fingerprint (one read); the fingerprints
of 200 tensors together (50 of 256 x 256, 150 of 256: a model's matrices and its biases and norms) as backward's end
takes them, and the comparison at ``step()`` with its one read back. On a GPU each timing ends with a synchronisation.
Timings on a shared machine are not results: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from offload_adamw.accel.changes import DeviceFingerprints, fingerprint


def _median_ms(work: Callable[[], object], rounds: int, device: torch.device) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    prints = DeviceFingerprints()
    for n in (4096, 1 << 20, 16 << 20):
        t = torch.randn(n, device=device)
        prints.take(t)  # its weights, once
        row = {"device fingerprint": _median_ms(lambda t=t: prints.take(t), args.rounds, device),
               "clone": _median_ms(t.clone, args.rounds, device)}
        if device.type == "cpu":
            row["host fingerprint"] = _median_ms(lambda t=t: fingerprint(t), args.rounds, device)
        print(f"{n * 4 / 2**20:8.3f} MiB: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row.items()))
    model = [torch.randn((256, 256) if k % 4 == 0 else (256,), device=device) for k in range(200)]
    kept = prints.take_all(model)
    took = _median_ms(lambda: prints.take_all(model), args.rounds, device)
    compared = _median_ms(lambda: prints.changed(list(zip(model, kept))), args.rounds, device)
    print(f"200 tensors (50 of 256 x 256, 150 of 256): taken {took:.2f} ms, compared at step() {compared:.2f} ms")


if __name__ == "__main__":
    main()
