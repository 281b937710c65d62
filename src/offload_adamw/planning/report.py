"""The plan's report: the tables ``offload-adamw plan`` prints, the Python of its placement, and its chart.

Contract: :func:`render` is the terminal text of a :class:`~offload_adamw.planning.planner.Plan` (the
memory per GPU and per node, the host memory OffloadAdamW allocates per rank, the traffic and the
step-time bound, the estimated training step, where each group's update runs, the recommendation and
why, the notes); the strategies that are not this project's are labelled comparisons. Where a placement
of OffloadAdamW is recommended (or the mix fits), :func:`param_groups_code` prints the Python that builds
it (``named_param_groups`` rules with ``update_on``, :mod:`offload_adamw.planning.placement`) and the same
for the HF Trainer. :func:`write_plot` draws stacked bars per strategy against the GPU's and the node's
capacity (matplotlib, imported only then). Only plain numbers are read: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.colors import ListedColormap

from offload_adamw._output import render_table
from offload_adamw.planning import placement, planner
from offload_adamw.planning.planner import GB, Plan

__all__ = ["render", "param_groups_code", "write_plot"]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """First column (the strategy) left, numbers right; wraps the strategy names when the terminal is narrow."""
    return render_table(headers, rows, align="l" + "r" * (len(headers) - 1), wrap=0)


def _label(s: planner.StrategyPlan) -> str:
    return f"{s.name} (comparison)" if s.comparison else s.name


def _gb(x: float) -> str:
    return f"{x / GB:,.1f}"


def _margin(margin: float) -> str:
    return ("+" if margin >= 0 else "-") + f"{abs(margin) / GB:,.1f}"


def render(result: Plan) -> str:
    hw, tr = result.hardware, result.training
    amsgrad = tr.amsgrad
    out = [
        f"{result.model_name}: {result.num_parameters:,} parameters; {hw.nodes} node(s) x {hw.gpus_per_node} GPU(s) of "
        f"{_gb(hw.gpu_memory_bytes)} GB, {_gb(hw.host_memory_bytes)} GB host memory per node"
        + (f"; HSDP: {hw.replicas} replicas of {hw.shard_degree}-way shards" if hw.replicas > 1 else ""),
        f"training: {tr.param_dtype} parameters, seq {tr.seq_len}, micro-batch {tr.micro_batch}, "
        f"accumulation {tr.grad_accumulation}, checkpointing {'on' if tr.activation_checkpointing else 'off'}, "
        f"{'flash' if tr.flash_attention else 'eager'} attention{', amsgrad' if amsgrad else ''}",
        f"bandwidths: PCIe {_gb(hw.pcie_bytes_per_s)} GB/s per GPU and direction, host memory "
        f"{_gb(hw.host_memory_bytes_per_s)} GB/s per node, GPU memory {_gb(hw.gpu_memory_bytes_per_s)} GB/s",
        "",
    ]
    state_cols = ["master", "m", "v"] + (["max_v"] if amsgrad else [])

    def bill_cells(bill: planner.MemoryBill) -> list[str]:
        cells = [_gb(bill.parameters), _gb(bill.gradients), _gb(bill.master), _gb(bill.exp_avg), _gb(bill.exp_avg_sq)]
        if amsgrad:
            cells.append(_gb(bill.max_exp_avg_sq))
        return cells

    rows = []
    for s in result.strategies:
        rows.append([_label(s), *bill_cells(s.gpu), _gb(s.gpu.activations), _gb(s.gpu.buffers), _gb(s.gpu.reserved),
                     _gb(s.gpu.total), _margin(s.gpu_margin)])
    out.append("Memory per GPU (GB)")
    out.append(_table(["strategy", "params", "grads", *state_cols, "activ.", "buffers", "reserved", "total", "margin"], rows))
    out.append("")
    rows = []
    for s in result.strategies:
        rows.append([_label(s), *bill_cells(s.host), _gb(s.host.step_counts), _gb(s.host.buffers), _gb(s.host.reserved),
                     _gb(s.host.total), _margin(s.host_margin), "yes" if s.fits else "no"])
    out.append("Host memory per node (GB)")
    out.append(_table(
        ["strategy", "params", "grads", *state_cols, "steps", "buffers", "reserved", "total", "margin", "fits GPU+host"],
        rows,
    ))
    out.append("")
    rows = []
    for s in result.strategies:
        r = s.host_per_rank
        if r is not None:
            rows.append([_label(s), _gb(r.state), _gb(r.gradients), _gb(r.accumulation), _gb(r.staging), _gb(r.total),
                         f"{r.total:,}"])
    if rows:
        out.append("Host memory per rank that OffloadAdamW allocates (GB; rank 0, the largest shards): its state "
                   "(host_state_bytes) and transfer buffers (host_buffer_bytes)")
        out.append(_table(["strategy", "state", "grads", "accum.", "staging", "total", "total bytes"], rows))
        out.append("")
    rows = []
    for s in result.strategies:
        rows.append([_label(s), _gb(s.pcie_h2d_bytes), _gb(s.pcie_d2h_bytes), _gb(s.host_memory_traffic_bytes),
                     _gb(s.gpu_memory_traffic_bytes), f"{s.step_time_lower_bound_s:.3f}", s.bottleneck])
    out.append("Traffic per training step (GB) and the optimizer step-time lower bound")
    out.append(_table(["strategy", "PCIe h2d/GPU", "PCIe d2h/GPU", "host mem/node", "GPU mem/GPU", "bound s", "set by"], rows))
    out.append("")
    rows = [[_label(s), f"{s.step_time_serial_s:.2f}", f"{s.step_time_overlapped_s:.2f}"]
            for s in result.strategies if s.step_time_serial_s is not None and s.step_time_overlapped_s is not None]
    if rows:
        out.append(f"Estimated training step (s): the optimizer after backward, and overlapped with it"
                   f"{' (clipping: updates wait for the global norm)' if tr.clipping else ''}")
        out.append(_table(["strategy", "serial s", "overlapped s"], rows))
        out.append("")
    out.extend(_placement_section(result))
    if result.recommendation:
        out.append(f"Recommendation: {result.recommendation}")
    else:
        out.append("Recommendation: none fits")
    out.append(f"  because {result.reason}")
    out.append("")
    shown = result.strategy(result.recommendation) if result.recommendation else None
    if shown is None or shown.mix is None:
        mix = result.strategy(planner.MIX)
        shown = mix if mix.fits else None
    if shown is not None and shown.mix is not None:
        out.append(f"As OffloadAdamW's param_groups ({shown.name}):")
        out.extend(("    " + line) if line else "" for line in param_groups_code(shown.mix))
        out.append("")
    out.append("Notes:")
    for s in result.strategies:
        for note in s.notes:
            out.append(f"  {s.name}: {note}")
    for assumption in result.assumptions:
        out.append(f"  {assumption}")
    return "\n".join(out)


def _placement_section(result: Plan) -> list[str]:
    """Groups per placement of each OffloadAdamW strategy, and the chosen mix against the single placements."""
    offload = [s for s in result.strategies if s.mix is not None]
    if not offload:
        return []
    rows = []
    for s in offload:
        mix = s.mix
        assert mix is not None
        rows.append([_label(s), *(str(mix.count(x)) for x in placement.PLACEMENTS),
                     "yes" if mix.offload_gradients else "no", _gb(s.gpu.total), f"{s.step_time_lower_bound_s:.3f}",
                     s.bottleneck, "yes" if s.fits else "no"])
    out = ["Where each group's update runs (OffloadAdamW update_on; groups: decoder layers and the other tensors)"]
    out.append(_table(["strategy", *placement.PLACEMENTS, "offload grads", "GB/GPU", "bound s", "set by", "fits"], rows))
    chosen = result.strategy(planner.MIX)
    mix = chosen.mix
    assert mix is not None
    if chosen.fits:
        counts = ", ".join(f"{mix.count(x)} {word}" for x, word in
                           (("device", "resident on the GPU"), ("stream", "streamed"), ("host", "on the host")))
        singles = [s for s in offload if s.name != planner.MIX and s.fits]
        against = ", ".join(f"{s.step_time_lower_bound_s:.2f} s ({s.name})" for s in singles)
        out.append(f"Chosen mix of the {len(mix.assignment)} groups: {counts}; bound {chosen.step_time_lower_bound_s:.2f} s "
                   f"({chosen.bottleneck}){' against ' + against if against else ''}")
    else:
        out.append("Chosen mix: none fits")
    out.append("")
    return out


def param_groups_code(mix: placement.Mix) -> list[str]:
    """The Python that builds OffloadAdamW with this placement (named_param_groups rules, first match wins), and the
    same for the HF Trainer (integrations/hf.py: the Trainer's decay split within each rule's group)."""
    trainer = "# with the HF Trainer (offload_adamw.integrations.hf), which splits each group by decay as it does:"
    if mix.uniform is not None:
        options = {"update_on": mix.uniform, **({"offload_gradients": True} if mix.offload_gradients else {})}
        keywords = ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in options.items())
        return ["from offload_adamw import OffloadAdamW",
                f"opt = OffloadAdamW(model.parameters(), {keywords})  # and your lr, weight_decay, ...", trainer,
                f"#   OffloadAdamWTrainer(model=model, args=args, offload_adamw_kwargs={_hyper(options)})"]
    flag = ", offload_gradients=True" if mix.offload_gradients else ""
    rules, default = mix.param_group_rules()
    lines = ["from offload_adamw import OffloadAdamW, named_param_groups", "", "rules = ["]
    lines += [f"    (r\"{pattern}\", {_hyper(hyper)})," for pattern, hyper in rules]
    lines += ["]", f"default = {_hyper(default)}",
              f"opt = OffloadAdamW(named_param_groups(model, rules, default=default){flag})  # and your lr, weight_decay, ...",
              trainer,
              "#   OffloadAdamWTrainer(model=model, args=args, param_group_rules=rules, param_group_default=default"
              + (', offload_adamw_kwargs={"offload_gradients": True})' if mix.offload_gradients else ")")]
    return lines


def _hyper(hyper: dict[str, Any]) -> str:
    return "{" + ", ".join(f'"{key}": ' + (f'"{value}"' if isinstance(value, str) else repr(value))
                           for key, value in hyper.items()) + "}"


_PLOT_ITEMS = (
    ("parameters", "parameters"), ("gradients", "gradients"), ("master", "master (fp32)"), ("exp_avg", "m"),
    ("exp_avg_sq", "v"), ("max_exp_avg_sq", "max_v"), ("step_counts", "step counts"), ("activations", "activations"),
    ("buffers", "buffers"), ("reserved", "reserved"),
)


def write_plot(result: Plan, path: str) -> None:
    """Stacked bars per strategy (per GPU and per node) with the capacity as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.name for s in result.strategies]
    fig, axes = plt.subplots(1, 2, figsize=(15, 7.5))
    # tab10 is a ListedColormap (get_cmap is typed as the base class); its colors: a list of RGB tuples
    colors: Any = cast("ListedColormap", plt.get_cmap("tab10")).colors
    for ax, where, capacity, title in (
        (axes[0], "gpu", result.hardware.gpu_memory_bytes, "per GPU"),
        (axes[1], "host", result.hardware.host_memory_bytes, "host memory per node"),
    ):
        bottoms = [0.0] * len(names)
        for index, (attr, label) in enumerate(_PLOT_ITEMS):
            values = [getattr(getattr(s, where), attr) / GB for s in result.strategies]
            if not any(values):
                continue
            ax.bar(names, values, bottom=bottoms, label=label, color=colors[index % len(colors)])
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.axhline(capacity / GB, color="black", linestyle="--", linewidth=1.5, label=f"capacity {capacity / GB:,.0f} GB")
        top = max(*bottoms, capacity / GB)
        ax.set_ylim(0, min(top, 4 * capacity / GB) * 1.08)  # a huge misfit would squash the others
        for x, total in enumerate(bottoms):
            ax.text(x, min(total, ax.get_ylim()[1] / 1.08), f"{total:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{result.model_name}: {title}")
        ax.set_ylabel("GB")
        ax.set_xticks(range(len(names)), [name.replace("+", "+\n") for name in names], fontsize=8)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)  # below: bars stay visible
    hw = result.hardware
    fig.suptitle(
        f"{result.num_parameters / 1e9:,.1f}B parameters on {hw.nodes} x {hw.gpus_per_node} GPUs; "
        f"recommended: {result.recommendation or 'none fits'}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
