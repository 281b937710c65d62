"""The host-step benchmark's result as a table with its targets, and as a PNG chart."""

from __future__ import annotations

from offload_adamw.benchmarking.host_step import (
    BF16_CASES,
    CEILING,
    DEFAULT_MIXED,
    LOSSY_CASES,
    NAIVE,
    TRIAD_BYTES_PER_ELEMENT,
    TRIAD_CASE,
)
from offload_adamw.benchmarking.workload import BYTES_PER_ELEMENT, MIB, format_size

__all__ = ["format_report", "write_plot"]


def format_report(result: dict) -> str:
    m, bw = result["machine"], result["bandwidth"]
    lines = [
        f"machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
        f"load average {m.get('load_average_at_start')} -> {m.get('load_average_at_end')}",
        f"bandwidth ({bw['elements'] * 4 // MIB} MiB arrays, best of {bw['repeats']}): "
        f"triad {bw['triad_gbps']:.1f} GB/s, in-place triad {bw['inplace_triad_gbps']:.1f} GB/s "
        f"-> ceiling {bw['inplace_triad_gbps'] / BYTES_PER_ELEMENT:.2f} G elements/s at {BYTES_PER_ELEMENT} B/element",
    ]
    for key in ("chunk_loop", "numba_loop", "deepspeed_version", "deepspeed_load_s", "deepspeed_unavailable"):
        if key in m:
            lines.append(f"{key}: {m[key]}")
    for name, why in m.get("skipped", {}).items():
        lines.append(f"skipped {name}: {why}")
    parity = result.get("parity")
    if parity is not None:
        lines.append(f"parity ({format_size(parity['elements'])} elements, one step): {DEFAULT_MIXED} vs {NAIVE}: "
                     f"{parity['differing_elements']} differing elements")
    header = (f"{'case':22s} {'ms/step':>9s} {'min-max':>15s} {'G elem/s':>9s} {'GB/s@28B':>9s} {'of triad':>9s} "
              f"{'vs ref':>7s} {'step +MiB':>9s}")
    for size in result["sizes"]:
        lines += ["", f"{_label(size)} in {size['tensors']} tensors "
                      f"(state {size['state_bytes'] / MIB:.0f} MiB); in-place triad in the same rotation: "
                      f"{size['inplace_triad_gbps']:.1f} GB/s = {size['inplace_triad_gbps'] / BYTES_PER_ELEMENT:.3f} "
                      f"G elements/s at {BYTES_PER_ELEMENT} B", header, "-" * len(header)]
        cases = size["cases"]
        ordered = [n for n in cases if n not in LOSSY_CASES] + [n for n in cases if n in LOSSY_CASES]
        for name in ordered:
            row = cases[name]
            if name in LOSSY_CASES and name == next(n for n in ordered if n in LOSSY_CASES):
                lines.append("  a different algorithm, without a float32 master (bf16 parameters updated in place):")
            ref = NAIVE if name in BF16_CASES else CEILING
            vs = cases[ref]["ms_per_step"] / row["ms_per_step"] if ref in cases else float("nan")
            extra = f"{row['step_extra_mib']:.1f}" if row["step_extra_mib"] is not None else "n/a"
            spread = f"{row['ms_min']:.1f}-{row['ms_max']:.1f}"
            lines.append(
                f"{name:22s} {row['ms_per_step']:9.1f} {spread:>15s} {row['elements_per_s'] / 1e9:9.3f} "
                f"{row['effective_gbps']:9.2f} {row['fraction_of_inplace_triad']:9.2f} {vs:6.2f}x {extra:>9s}"
            )
        lines.append(f"(vs ref: speed relative to {NAIVE} for bf16 cases, to {CEILING} for float32 cases)")
    scaling = result.get("thread_scaling")
    if scaling:
        lines += ["", f"thread scaling, {format_size(scaling['elements'])} elements, ms/step (median):",
                  f"  {'threads':22s}" + "".join(f"{t:>9d}" for t in scaling["threads"])]
        for name, rows in scaling["cases"].items():
            lines.append(f"  {name:22s}" + "".join(f"{r['ms_per_step']:9.1f}" for r in rows))
    lines += ["", "targets:"]
    for t in result["targets"]:
        value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        where = f"{t['mix']} mix" if t.get("mix") else format_size(t["size"])
        lines.append(f"  {where:>5s}  {t['target']:62s} {value:>7s} (need {t['required']:g}): {verdict}")
    return "\n".join(lines)


def _label(size: dict) -> str:
    """'16M elements', or for a named mix of shapes 'llama-layers mix, 50,512,896 elements'."""
    if size.get("mix"):
        return f"{size['mix']} mix, {size['elements']:,} elements"
    return f"{format_size(size['elements'])} elements"


def write_plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    names = list(sizes[0]["cases"])
    scaling = result.get("thread_scaling")
    fig, axes = plt.subplots(1, 2 if scaling else 1, figsize=(13 if scaling else 9, 4.8),
                             gridspec_kw={"width_ratios": [3, 1]} if scaling else None)
    ax = axes[0] if scaling else axes
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [k + i * width for k in range(len(sizes))]
        rows = [s["cases"].get(name) for s in sizes]
        ys = [r["elements_per_s"] / 1e9 if r else 0 for r in rows]
        # error bars: the elements/s of the slowest and the fastest repetition
        lo = [y - (s["elements"] / (r["ms_max"] / 1e3) / 1e9) if r else 0 for y, r, s in zip(ys, rows, sizes)]
        hi = [(s["elements"] / (r["ms_min"] / 1e3) / 1e9) - y if r else 0 for y, r, s in zip(ys, rows, sizes)]
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name + (" (lossy)" if name in LOSSY_CASES else ""),
               color=plt.cm.tab10(i % 10), hatch="//" if "bf16" in name else None)
    for k, s in enumerate(sizes):
        ceiling = s["inplace_triad_gbps"] / BYTES_PER_ELEMENT
        ax.hlines(ceiling, k - width, k + 0.8, colors="black", linestyles="--", linewidth=1,
                  label="in-place triad / 28 B (same rotation)" if k == 0 else None)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(sizes))])
    ax.set_xticklabels([_label(s) for s in sizes])
    ax.set_ylabel("G elements / s (median; bars: fastest and slowest repetition)")
    ax.set_title(f"AdamW host step, {result['machine']['cpu']}, {result['machine']['torch_threads']} threads", fontsize=9)
    top = max([s["inplace_triad_gbps"] / BYTES_PER_ELEMENT for s in sizes]
              + [s["elements"] / (r["ms_min"] / 1e3) / 1e9 for s in sizes for r in s["cases"].values()])
    ax.set_ylim(0, top * 1.5)  # room for the legend above the bars and the ceiling
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    if scaling:
        sax = axes[1]
        for name, rows in scaling["cases"].items():
            # the triad as the step-equivalent ceiling: its bandwidth over a step's 28 bytes per element
            scale = TRIAD_BYTES_PER_ELEMENT / BYTES_PER_ELEMENT if name == TRIAD_CASE else 1.0
            label = "in-place triad / 28 B" if name == TRIAD_CASE else name
            sax.plot(scaling["threads"], [r["elements_per_s"] * scale / 1e9 for r in rows], marker="o", label=label,
                     linestyle="--" if name == TRIAD_CASE else "-", color="black" if name == TRIAD_CASE else None)
        sax.set_xlabel("torch threads")
        sax.set_xticks(scaling["threads"])
        sax.set_ylabel("G elements / s")
        sax.set_title(f"thread scaling, {format_size(scaling['elements'])} elements", fontsize=9)
        sax.set_ylim(bottom=0)
        sax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
