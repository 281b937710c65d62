"""``offload-adamw selftest``: on this machine, does OffloadAdamW compute what it promises (and, with ``--bench``, how fast)?

Contract: checks ``--device`` (cpu, or a CUDA device torch sees; default cuda where there is one), ``--bench-size``
and the ``--json`` path before any work (a bad one is a usage error, exit status 2, one line naming it); then prints
the environment report (:mod:`offload_adamw.selftest.environment`), the parity table
(:mod:`offload_adamw.selftest.parity`: every placement x kept/freed gradients x update at the step/during backward
x clipping, each row bitwise against ``torch.optim.AdamW(fused=True)`` on float32 masters), with ``--bench`` the
measurements (:mod:`offload_adamw.selftest.bench`), and last a verdict line. Exit status 0 when every row that ran
is exact, 1 when any differs or raised (the verdict names the first such row and its first differing element);
rows refused by design are shown as skipped with the reason and do not count. ``--json [FILE]`` writes the same
as a document with ``schema_version`` (:mod:`offload_adamw.cli.common`; a file that cannot be written at the end
is exit status 74). A progress bar goes to stderr, by default only when stderr is a terminal. Tables fit the
terminal (the widest column wraps).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from offload_adamw.cli import common

__all__ = ["add_arguments", "run", "BENCH_SIZES"]

BENCH_SIZES = ("auto", "tiny", "1b")
"""``--bench-size``: the model of the step rows; ``auto`` is ``1b`` on a CUDA device and ``tiny`` on the CPU."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="where the model lives and the device placements run: cpu, cuda or cuda:N "
                             "(default: cuda where torch sees a GPU, else cpu)")
    parser.add_argument("--rows", default=None, metavar="PATTERNS",
                        help="only the parity rows whose name matches one of these comma-separated shell patterns, "
                             "e.g. 'host/freed/*,mix/*/backward/clip' (default: every row)")
    parser.add_argument("--bench", action="store_true",
                        help="also measure: pinned H2D/D2H bandwidth, the host triad, the host step against torch's "
                             "fused step, and the step of a Llama with every placement")
    parser.add_argument("--bench-size", choices=BENCH_SIZES, default="auto",
                        help="the Llama of the --bench step rows: 1b (about 1.1 B parameters), tiny (seconds on a "
                             "CPU), or auto: 1b on a GPU, tiny on the CPU (default)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="seconds the --bench rows may take in all; a row that would start later is skipped, "
                             "saying so (default 420)")
    common.add_json_argument(parser, what="the environment, every row and the verdict")
    common.add_progress_argument(parser)


def run(args: argparse.Namespace) -> int:
    if not args.budget_s > 0:  # written so that NaN fails too
        raise common.UsageError(f"--budget-s must be above 0, got {args.budget_s}")
    from offload_adamw.selftest import environment, parity

    asked = args.device or environment.default_device()
    try:
        device = environment.resolve_device(asked)
    except ValueError as exc:
        raise common.UsageError(f"--device {asked!r}: {exc}") from None
    rows_wanted = _rows(args.rows)
    quiet = common.json_to_stdout(args)
    out = (lambda *a: print(*a, file=sys.stderr)) if quiet else print
    progress = common.progress_wanted(args)

    env = environment.environment(device)
    out(_fill(_headline(env)))
    out()
    out(_environment_table(env))
    out()
    out(_fill(f"parity: each row against torch.optim.AdamW(fused=True) on float32 masters where its update runs, "
              f"bitwise; a bf16 model ({sum(p.numel() for p in parity.TinyModel().parameters()):,} parameters, "
              f"4 groups), {parity.STEPS} steps of {parity.ACCUMULATION} micro-batches per row, on {device}; "
              f"rows are placement/gradients/update/clipping"))
    rows = _parity(device, rows_wanted, progress)
    out(_parity_table(rows))
    bench: dict[str, Any] | None = None
    if args.bench:
        from offload_adamw.selftest import bench as bench_module

        out()
        size = args.bench_size if args.bench_size != "auto" else ("1b" if device.type == "cuda" else "tiny")
        # each row as it starts, on stderr like every message: a run stopped from outside shows where it was
        bench = bench_module.run_bench(device, size=size, budget_s=args.budget_s,
                                       log=lambda *a: print(*a, file=sys.stderr, flush=True))
        out(bench_module.format_bench(bench))
    verdict = _verdict(rows)
    out()
    out(verdict["line"])
    common.write_json("selftest", {"environment": env, "parity": {"rows": rows, "steps": parity.STEPS,
                                                                  "accumulation": parity.ACCUMULATION,
                                                                  "clip_norm": parity.CLIP_NORM},
                                   "bench": bench, "verdict": verdict}, args.json)
    return 0 if verdict["exact"] else 1


def _rows(patterns: str | None) -> tuple[Any, ...]:
    """The rows ``--rows`` selects (all without it); a pattern that matches no row is a usage error naming it."""
    import fnmatch

    from offload_adamw.selftest import parity

    if patterns is None:
        return parity.ROWS
    chosen = [p.strip() for p in patterns.split(",") if p.strip()]
    if not chosen:
        raise common.UsageError(f"--rows {patterns!r}: no pattern")
    for pattern in chosen:
        if not any(fnmatch.fnmatchcase(row.name, pattern) for row in parity.ROWS):
            raise common.UsageError(f"--rows: {pattern!r} matches no row; rows are PLACEMENT/GRADIENTS/UPDATE/CLIPPING "
                                    f"with {'|'.join(parity.PLACEMENTS)} / kept|freed / step|backward / noclip|clip")
    return tuple(row for row in parity.ROWS if any(fnmatch.fnmatchcase(row.name, p) for p in chosen))


def _parity(device: Any, rows: tuple[Any, ...], progress: bool) -> list[dict[str, Any]]:
    from offload_adamw.selftest import parity

    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(rows), desc="parity", unit="row", file=sys.stderr, leave=False)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            bar = None

    def advance(result: dict[str, Any]) -> None:
        if bar is not None:
            bar.set_postfix_str(result["row"], refresh=False)
            bar.update(1)

    try:
        return parity.run_table(device, rows, on_row=advance)
    finally:
        if bar is not None:
            bar.close()


def _fill(text: str) -> str:
    """``text`` wrapped to the terminal (tables and lines fit it; only the verdict stays one line, for grep)."""
    import textwrap

    return textwrap.fill(text, width=common.terminal_width(), subsequent_indent="  ")


def _gib(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**30:,.1f} GiB" if value >= 2**30 else f"{value / 2**20:,.1f} MiB"


def _headline(env: dict[str, Any]) -> str:
    return (f"offload-adamw {env['offload_adamw']} selftest on {env['device']}: torch {env['torch']}, "
            f"CUDA {env['cuda_build'] or '-'}, driver {env['driver'] or '-'}, numba {env['numba'] or '-'}")


def _environment_table(env: dict[str, Any]) -> str:
    memory, lock, pinned = env["host_memory"], env["memlock"], env["page_locking"]
    locked = ("unlimited" if lock.get("unlimited") else f"{_gib(lock['soft_bytes'])} soft, {_gib(lock['hard_bytes'])} hard"
              if lock["readable"] else "-")
    rows = [["host memory", f"{_gib(memory['total_bytes'])} total, {_gib(memory['available_bytes'])} available; "
                            f"sized by {_gib(memory['sizing_bytes'])} ({memory['sizing_source']})"],
            ["locked-memory limit", locked],
            ["cores", f"{env['cores_available']} available to this process of {env['cpu_count']}, "
                      f"torch uses {env['torch_threads']} threads"],
            ["host update", env["host_update"]["describe"]],
            ["torch's OpenMP team", f"{env['torch_openmp']['threads']} threads "
                                    f"({env['torch_openmp']['runtime'] or 'runtime unknown'}): "
                                    f"{env['torch_openmp']['after_each_region']}"],
            ["page-locking", {True: "works", False: "FAILS", None: "-"}[pinned["works"]] + f" ({pinned['why']})"],
            ["stream backend", env["stream_backend"]]]
    for gpu in env["gpus"]:
        numa = "-" if gpu["numa_node"] is None else str(gpu["numa_node"])
        rows.append([f"GPU {gpu['index']}", f"{gpu['name']}, {_gib(gpu['memory_bytes'])}, compute {gpu['capability']}, "
                                            f"PCI {gpu['pci_bus_id'] or '-'}, NUMA node {numa}"])
    if not env["gpus"]:
        rows.append(["GPUs", "none that torch sees"])
    return common.render_table(["environment", ""], rows, wrap=1)


def _difference_text(d: dict[str, Any] | None) -> str:
    if not d:
        return ""
    where = f"step {d.get('step')}: {d.get('parameter')} {d.get('tensor')}"
    if "why" in d:
        return f"{where}: {d['why']}"
    index = d.get("index")
    at = f"[{', '.join(map(str, index))}]" if index else ""
    bits = lambda key: f" ({d[key]})" if d.get(key) else ""  # noqa: E731
    extra = f", {d['elements_differing']:,} elements differ" if d.get("elements_differing", 0) > 1 else ""
    return f"{where}{at}: ours {d.get('ours')!r}{bits('ours_bits')}, torch {d.get('torch')!r}{bits('torch_bits')}{extra}"


def _parity_table(rows: list[dict[str, Any]]) -> str:
    shown = []
    for r in rows:
        status = {"exact": "exact", "differs": "NOT EXACT", "error": "ERROR"}.get(r["status"], r["status"])
        note = _difference_text(r["difference"]) or r.get("why", "")
        if not note and r.get("buckets"):  # that the updates did run during backward, not only that they are exact
            note = f"{r['buckets_started_in_backward']} of {r['buckets']} buckets began updating during backward"
        shown.append([r["row"], status, f"{r['seconds']:.2f}" if r["status"] != "skipped" else "-", note])
    return common.render_table(["row", "result", "s", "first difference, or note"],
                               shown, align="llrl", wrap=3)


def _verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [r for r in rows if r["status"] != "skipped"]
    bad = [r for r in ran if r["status"] != "exact"]
    skipped = len(rows) - len(ran)
    reasons = sorted({r["why"] for r in rows if r["status"] == "skipped"})
    skip_text = f"; {skipped} skipped ({'; '.join(reasons)})" if skipped else ""
    if not ran:
        line = f"selftest: NOTHING RAN{skip_text}"
    elif not bad:
        line = (f"selftest: EXACT: all {len(ran)} rows bitwise torch.optim.AdamW(fused=True) on float32 masters"
                f"{skip_text}")
    else:
        first = bad[0]
        what = _difference_text(first["difference"]) if first["status"] == "differs" else first.get("why", "")
        line = (f"selftest: NOT EXACT: {len(bad)} of {len(ran)} rows differ from torch.optim.AdamW(fused=True) or "
                f"failed; first {first['row']} ({first['status']}): {what}")
    return {"exact": bool(ran) and not bad, "line": line, "rows_run": len(ran), "rows_skipped": skipped,
            "rows_not_exact": [r["row"] for r in bad]}
