"""One optimizer step of each placement (update_on: host, stream, device, a mix) over the same tensors.

    python benchmarks/placement_bench.py                    # 16 Mi bf16 elements in a transformer's shapes, CPU as device
    python benchmarks/placement_bench.py --device cuda --elements 268435456 --json placement.json
    python benchmarks/placement_bench.py --quick            # a smoke run (seconds)

What each case builds and how it is timed: :mod:`offload_adamw.benchmarking.placement`. Printed: the median
``step()`` time of each case and its ratio to the host placement's, the bytes one step moves between host and
device and through host memory (counted from the state and buffers the optimizer holds), and the device buffer
bytes (``opt.device_buffer_bytes()``). ``--json`` writes them. Timings measured on a shared machine are not results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from offload_adamw._output import json_document, render_table
from offload_adamw.benchmarking.placement import PlacementConfig, run


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="placement_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=16 << 20, help="parameter elements (a transformer's shapes)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="model dtype")
    parser.add_argument("--device", default="cpu", help="where parameters and gradients live (cpu, cuda)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per case")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per case, rotated")
    parser.add_argument("--chunk-bytes", type=int, default=64 << 20, help="stream_chunk_bytes")
    parser.add_argument("--buffers", type=int, default=2, choices=[2, 3], help="stream_buffers")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="1 Mi elements, 1 MiB chunks, 2 repeats (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.elements, args.chunk_bytes, args.repeats = 1 << 20, 1 << 20, 2
    if args.chunk_bytes < 1 << 20:
        parser.error("--chunk-bytes must be at least 1 MiB (1048576)")
    try:
        config = PlacementConfig(elements=args.elements, dtype=args.dtype, device=args.device, warmup=args.warmup,
                                 repeats=args.repeats, chunk_bytes=args.chunk_bytes, buffers=args.buffers)
    except ValueError as error:
        parser.error(str(error))
    result = run(config)
    rows = [[c["case"], "+".join(c["placements"]), f"{c['step_s'] * 1e3:.1f}", f"{c['step_vs_host']:.2f}",
             _mib(c["transfer_bytes_per_step"]), _mib(c["host_bytes_per_step"]), _mib(c["device_buffer_bytes"])]
            for c in result["cases"]]
    print(f"{result['elements']:,} {args.dtype} elements in {result['tensors']} tensors on {args.device}; "
          f"{args.repeats} timed steps per case")
    print(render_table(["case", "placements", "step ms", "vs host", "transfers MiB", "host MiB", "device MiB"], rows,
                       align="llrrrrr"))
    if args.json:
        config_fields = {k: getattr(config, k) for k in ("elements", "dtype", "device", "warmup", "repeats",
                                                           "chunk_bytes", "buffers")}
        Path(args.json).write_text(json.dumps(json_document("placement_bench", {"config": config_fields, **result}),
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
