"""Training-step time with the host update after backward, and hidden behind it: one case of the overlap benchmark.

Contract: :func:`run_case` runs one case in this process (``benchmarks/overlap_bench.py`` starts one process
per case and round, for a clean peak resident memory) and returns its medians; :func:`summarise` turns the
rounds of every case into the benchmark's rows, each with its ratio to ``torch_fused``; :func:`format_table`
prints them. One training step is forward, backward and ``step()`` of an MLP of ``blocks`` residual blocks,
with the CPU as device (the pipeline's CPU mode: the "device" and the host share this machine's memory, so
what is measured is the host update hidden behind backward's compute, not PCIe). Backward computes on one
thread (``torch.set_num_threads(1)``) so that the update has a core of its own, as it has on a GPU machine,
where backward runs on the device.

Cases:

* ``torch_fused``: ``torch.optim.AdamW(fused=True)``, state next to the parameters (the baseline a
  careful engineer writes when everything fits);
* ``offload_step``: ``OffloadAdamW(offload_gradients=True)``: gradients to host buffers in backward's
  hooks, the whole update in ``step()``;
* ``offload_overlap``: the same with ``update_in_backward=True``: each block's update on a worker
  thread as soon as its gradients are in, while backward goes on.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Sequence
from typing import Any

CASES = ("torch_fused", "offload_step", "offload_overlap")


def build(blocks: int, width: int) -> Any:
    """The benchmark's model: ``blocks`` residual MLP blocks of width ``width`` (one bucket each)."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(blocks)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x)
            return x

    return Blocks()


def run_case(case: str, blocks: int, width: int, batch: int, steps: int, timeline: str | None) -> dict[str, Any]:
    """One case in this process: per-step times, forward+backward alone, overlap, peak RSS."""
    import torch

    from offload_adamw.optim.optimizer import OffloadAdamW

    torch.set_num_threads(1)
    model = build(blocks, width)
    params = list(model.parameters())
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(batch, width, generator=g) for _ in range(4)]

    def fwd_bwd(i: int) -> None:
        model(xs[i % len(xs)]).square().mean().backward()

    opt: Any
    if case == "torch_fused":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    else:
        opt = OffloadAdamW(params, lr=1e-4, weight_decay=0.1, offload_gradients=True, bucket_bytes=block_bytes,
                           update_in_backward=case == "offload_overlap")
    step_s: list[float] = []
    fwd_bwd_s: list[float] = []
    call_s: list[float] = []
    overlaps: list[float] = []
    for i in range(steps):
        t0 = time.perf_counter()
        fwd_bwd(i)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        step_s.append(t2 - t0)
        fwd_bwd_s.append(t1 - t0)
        call_s.append(t2 - t1)
        if case != "torch_fused":
            overlaps.append(opt.last_step_timeline().overlap)
    if timeline and case == "offload_overlap":
        opt.last_step_timeline().gantt_png(timeline, title=f"{blocks} blocks, width {width}, batch {batch}: "
                                                            f"overlap {overlaps[-1]:.2f}")
    warm = slice(2, None)  # the first step allocates state; the second is the first with early updates
    return {
        "case": case,
        "step_s": statistics.median(step_s[warm]),
        "fwd_bwd_s": statistics.median(fwd_bwd_s[warm]),
        "step_call_s": statistics.median(call_s[warm]),
        "overlap": statistics.median(overlaps[warm]) if overlaps else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def parameters(blocks: int, width: int) -> int:
    """Trainable elements of :func:`build`'s model (two linear layers of 2*width^2 weights, 3*width biases)."""
    return blocks * (4 * width * width + 3 * width)


def summarise(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of the benchmark from every round of each case: medians over the rounds, the peak RSS's maximum."""

    def median(case: str, key: str) -> Any:
        values = [r[key] for r in results[case] if r[key] is not None]
        return statistics.median(values) if values else None

    base = median("torch_fused", "step_s")
    rows = []
    for case in CASES:
        step, fb = median(case, "step_s"), median(case, "fwd_bwd_s")
        rows.append({
            "case": case, "step_s": step, "fwd_bwd_s": fb, "step_call_s": median(case, "step_call_s"),
            "step_vs_torch_fused": step / base, "overlap": median(case, "overlap"),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results[case]),
        })
    return rows


def format_table(rows: Sequence[dict[str, Any]], *, blocks: int, width: int, batch: int, rounds: int,
                 steps: int) -> str:
    """The rows as the benchmark prints them, under a line that says what was run."""
    lines = [f"{blocks} blocks x width {width} ({parameters(blocks, width) / 1e6:.1f}M parameters), batch {batch}, "
             f"median of {rounds} rounds x {steps - 2} steps, backward on 1 thread",
             f"{'case':<16} {'step ms':>8} {'vs fused':>8} {'fwd+bwd':>8} {'step()':>8} {'overlap':>7} {'peak RSS':>9}"]
    for r in rows:
        overlap = "-" if r["overlap"] is None else f"{r['overlap']:.2f}"
        lines.append(f"{r['case']:<16} {r['step_s'] * 1e3:>8.1f} {r['step_vs_torch_fused']:>8.2f} "
                     f"{r['fwd_bwd_s'] * 1e3:>8.1f} {r['step_call_s'] * 1e3:>8.1f} {overlap:>7} "
                     f"{r['peak_rss_bytes'] / 2**20:>7.0f}Mi")
    return "\n".join(lines)
