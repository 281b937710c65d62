"""The GPU run's report: the targets, one headline per row, the summary table and the PNGs, from its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_run_rows import GIB, LLAMA_VARIANTS

# ------------------------------------------------------------------------------ targets, table


def _row(result: dict, section: str, row: str) -> dict:
    r = result.get("sections", {}).get(section, {}).get("rows", {}).get(row, {})
    return r if r.get("status") in ("ok", "failed") else {}


def targets(result: dict) -> list[dict]:
    """The targets of the ~1B run, reported against (never tuned to), each against torch AdamW(fused=True) with
    float32 masters and moments on the device measured in the same run; met is None where a figure is missing."""
    out = []
    rehearsal = result.get("mode", "gpu") != "gpu"

    def add(name: str, value: float | None, required: str, met: bool | None) -> None:
        if rehearsal:  # tiny CPU stand-ins say nothing about the targets
            met = None
        out.append({"target": name, "value": value, "required": required, "met": met})

    a = _row(result, "llama", "a")
    for key, label, limit in (("e", "freed, updates in backward, no clipping", 1.10),
                              ("f", "the same with max_grad_norm", 1.20)):
        r = _row(result, "llama", key)
        ratio = r["step_s_median"] / a["step_s_median"] if a and r else None
        add(f"llama ({key}) {label}: step time / (a) fp32-master torch AdamW", ratio, f"<= {limit:.2f}",
            None if ratio is None else ratio <= limit)
    for key in ("d", "e"):
        r = _row(result, "llama", key)
        share = r.get("optimizer_share_bytes") if r else None
        param_bytes = 2 * r["parameters"] if r else None
        add(f"llama ({key}) optimizer share of peak device memory, GiB", None if share is None else share / GIB,
            "about 0: parameters and transient gradients only (<= 5% of the bf16 parameter bytes)",
            None if share is None else share <= 0.05 * param_bytes)
    e = _row(result, "llama", "e")
    hidden = e.get("timeline_overlap") if e else None
    add("llama (e) share of the host update hidden behind backward (the optimizer's timeline, host clock)", hidden,
        ">= 0.75", None if hidden is None else hidden >= 0.75)
    peak = _row(result, "pcie", "pinned-peak")
    per_tensor = _row(result, "pcie", "per-tensor-1b-shapes")
    d = _row(result, "llama", "d")
    overlap = d.get("overlap", {}) if d else {}
    for tag in ("h2d", "d2h"):
        p = peak.get(f"{tag}_GBps")
        t = per_tensor.get(f"{tag}_GBps")
        frac = t / p if p and t else None
        add(f"pcie {tag}: per-tensor copies of the 1B shapes / pinned peak", frac, ">= 0.85",
            None if frac is None else frac >= 0.85)
        busy = overlap.get(f"{tag}_GBps_while_busy")
        frac = busy / p if p and busy else None
        add(f"pcie {tag}: the pipeline's own copies in (d) (profiler, while busy) / pinned peak", frac, ">= 0.85",
            None if frac is None else frac >= 0.85)
    return out


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def headline(section: str, row: str, r: dict) -> str:
    """The row's key figures, one line (empty where the row has none)."""
    if r.get("status") not in ("ok", "failed"):
        return ""
    try:
        return _headline(section, row, r)
    except (KeyError, TypeError, ValueError):
        return "(figures incomplete: see the JSON)"


def _headline(section: str, row: str, r: dict) -> str:
    if section == "parity" and "continuation_bitwise" in r:  # the checkpoint row
        return (f"resumed bitwise={r['continuation_bitwise']} rng={r['rng_restored']} "
                f"(device rng saved: {r['device_rng_saved']}) schedule={r['schedule_restored']} "
                f"mismatches={r['mismatch_count']} load problems={len(r['load_problems'])}")
    if section == "parity":
        text = (f"bitwise={r.get('bitwise')} grads@1={r.get('first_step_gradients_bitwise')} "
                f"clip={r.get('clip_norms_bitwise')} scale={r.get('loss_scales_equal')} "
                f"mismatches={r.get('mismatch_count')} max|d|={r.get('max_abs_param_diff', 0):.2e}")
        if "buckets" in r:  # the rows with host updates during backward
            median = r.get("timeline_overlap_median")
            text += f" buckets={r['buckets']}/{r.get('fsdp_groups')} overlap={'-' if median is None else f'{median:.2f}'}"
        return text
    if section == "llama":
        sm = r.get("step_memory", {})
        text = (f"{r['parameters'] / 1e9:.3f} B params; step {r['step_s_median'] * 1e3:.0f} ms, fwd+bwd "
                f"{r['forward_backward_s_median'] * 1e3:.0f} ms, exposed {r['exposed_optimizer_s'] * 1e3:.0f} ms")
        if sm:
            text += (f"; peak alloc {_gb(sm['peak_allocated_bytes'])} GiB, reserved {_gb(sm['peak_reserved_bytes'])} GiB,"
                     f" optimizer share {_gb(r.get('optimizer_share_bytes'))} GiB")
        if "parity" in r:  # a row with a placement of the update (docs/placement.md)
            text += (f"; parity bitwise={r['parity']['bitwise']}, step() alone "
                     f"{r['optimizer_step_s_median'] * 1e3:.0f} ms moving {r['transfer_bytes_per_step'] / GIB:.2f} GiB "
                     f"over PCIe ({r['pcie_GBps_achieved']:.1f} GB/s), device buffers {_gb(r['device_buffer_bytes'])} GiB")
        ov = r.get("overlap", {})
        if ov.get("measured"):
            frac = ov.get("d2h_overlap_fraction")
            text += (f"; d2h before end of backward {'-' if frac is None else f'{frac:.0%}'},"
                     f" tail {(ov.get('d2h_tail_after_backward_us') or 0) / 1e3:.1f} ms")
        return text
    if section == "pcie":
        return f"h2d {r['h2d_GBps']:.1f} GB/s, d2h {r['d2h_GBps']:.1f} GB/s, both {r['both_GBps']:.1f} GB/s"
    if section == "host":
        if row == "triad":
            return f"in-place triad {r['inplace_triad_gbps']:.1f} GB/s, triad {r['triad_gbps']:.1f} GB/s ({r['threads']} threads)"
        return ", ".join(f"{name} {c['ms_per_step']:.1f} ms" for name, c in r["cases"].items())
    if section == "gpu_tests":
        return ", ".join(f"{v} {k}" for k, v in r.get("counts", {}).items())
    return ""


def summary_table(result: dict) -> str:
    m = result["machine"]
    lines = [
        (f"GPU run ({result['mode']}, sizes {result['sizes_preset']}): {m.get('gpu', 'no GPU')}, {m.get('cpu', '?')} "
         f"x{m.get('logical_cpus')}, torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), {result['started_utc']}, "
         f"{result.get('elapsed_s', 0):.0f} s"),
        f"{'section/row':44} {'status':36} {'s':>6}  figures",
    ]
    for section, body in result["sections"].items():
        for row, r in body["rows"].items():
            lines.append(f"{section + '/' + row:44} {str(r.get('status'))[:36]:36} {r.get('seconds', 0):6.1f}  "
                         f"{headline(section, row, r)}")
    lines.append("")
    lines.append("targets (reported against, not tuned to):")
    for t in result.get("targets", []):
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        if t["met"] is None and t["value"] is not None:
            verdict = "not a GPU figure (rehearsal)"
        lines.append(f"  {t['target']:78} {value:>8} ({t['required']}): {verdict}")
    return "\n".join(lines)


def bad_rows(result: dict) -> list[str]:
    return [f"{s}/{r}" for s, body in result["sections"].items() for r, v in body["rows"].items()
            if not (v.get("status") == "ok" or str(v.get("status", "")).startswith("skipped"))]


# ------------------------------------------------------------------------------------ plots


def plot(json_path: Path) -> list[str]:
    """PNGs next to the JSON; returns the notes (what was drawn or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["matplotlib is not installed: no PNGs (run `python benchmarks/gpu_run.py --plot gpu_run.json` where it is)"]
    result = json.loads(json_path.read_text())
    notes = []
    out = json_path.parent
    title = f"{result['machine'].get('gpu', 'CPU rehearsal')}, torch {result['machine'].get('torch')}"

    llama = {k: v for k, v in result["sections"].get("llama", {}).get("rows", {}).items() if v.get("status") == "ok"}
    if llama:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        keys = list(llama)
        labels = [f"({k}) {LLAMA_VARIANTS[k].short if k in LLAMA_VARIANTS else k}" for k in keys]
        x = list(range(len(keys)))
        ax1.bar(x, [llama[k]["step_s_median"] * 1e3 for k in keys], 0.6, label="full step")
        ax1.bar(x, [llama[k]["forward_backward_s_median"] * 1e3 for k in keys], 0.3, label="forward+backward only")
        ax1.set_xticks(x, labels, fontsize=7, rotation=15)
        ax1.set_ylim(0, 1.3 * max(max(llama[k]["step_s_median"], llama[k]["forward_backward_s_median"]) for k in keys) * 1e3)
        ax1.set_ylabel("ms per step (median)")
        ax1.set_title("step time", fontsize=9)
        ax1.legend(fontsize=8)
        if all(llama[k].get("step_memory") for k in keys):
            alloc = [llama[k]["step_memory"]["peak_allocated_bytes"] / GIB for k in keys]
            reserved = [llama[k]["step_memory"]["peak_reserved_bytes"] / GIB for k in keys]
            fbm = [llama[k]["forward_backward_memory"]["peak_allocated_bytes"] / GIB for k in keys]
            ax2.bar([i - 0.27 for i in x], fbm, 0.27, label="fwd+bwd only, allocated")
            ax2.bar(list(x), alloc, 0.27, label="full step, allocated")
            ax2.bar([i + 0.27 for i in x], reserved, 0.27, label="full step, reserved")
            ax2.set_xticks(x, labels, fontsize=7, rotation=15)
            ax2.set_ylim(0, 1.3 * max(reserved + alloc + fbm))
            ax2.set_ylabel("peak device memory, GiB")
            ax2.legend(fontsize=8)
        else:
            ax2.text(0.5, 0.5, "no device memory figures (CPU)", ha="center", transform=ax2.transAxes)
        ax2.set_title("peak device memory", fontsize=9)
        params = llama[keys[0]]["parameters"]
        fig.suptitle(f"Llama, {params / 1e9:.3f} B parameters, {llama[keys[0]]['tokens_per_step']} tokens per step; {title}",
                     fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "gpu_run_llama.png", dpi=120)
        plt.close(fig)
        notes.append(str(out / "gpu_run_llama.png"))

    host = result["sections"].get("host", {}).get("rows", {})
    sweep = sorted((v for k, v in host.items() if k.startswith("threads-") and v.get("status") == "ok"),
                   key=lambda v: v["threads"])
    if sweep:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name in sweep[0]["cases"]:
            ax.plot([v["threads"] for v in sweep], [v["cases"][name]["GBps_at_28B"] for v in sweep], marker="o", label=name)
        triad = host.get("triad", {})
        if triad.get("status") == "ok":
            ax.axhline(triad["inplace_triad_gbps"], color="black", linestyle="--", linewidth=1,
                       label=f"in-place triad, {triad['threads']} threads")
        ax.set_xscale("log", base=2)
        ax.set_xticks([v["threads"] for v in sweep], [str(v["threads"]) for v in sweep])
        ax.set_xlabel("torch threads")
        ax.set_ylabel("GB/s at 28 B/element (median)")
        ax.set_title(f"host AdamW step, {sweep[0]['elements'] / 2**20:.0f} Mi elements\n{result['machine'].get('cpu', '')}",
                     fontsize=8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "gpu_run_host_threads.png", dpi=120)
        plt.close(fig)
        notes.append(str(out / "gpu_run_host_threads.png"))

    pcie = {k: v for k, v in result["sections"].get("pcie", {}).get("rows", {}).items() if v.get("status") == "ok"}
    if pcie:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        kinds = ["h2d_GBps", "d2h_GBps", "both_GBps"]
        for i, (name, r) in enumerate(pcie.items()):
            ax.bar([k + i * 0.4 for k in range(3)], [r[k] for k in kinds], 0.4, label=name)
        ax.set_xticks([k + 0.2 for k in range(3)], ["host->device", "device->host", "both at once"])
        ax.set_ylabel("GB/s (best)")
        ax.set_title(f"PCIe from pinned memory\n{title}", fontsize=8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "gpu_run_pcie.png", dpi=120)
        plt.close(fig)
        notes.append(str(out / "gpu_run_pcie.png"))
    if not notes:
        notes.append("nothing to plot (no llama, host or pcie rows finished)")
    return notes


