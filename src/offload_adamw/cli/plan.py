"""``offload-adamw plan``: what each GPU and each node holds, per strategy, and which one to use.

Contract: reads a model (``--preset``, ``--config`` or ``--params N``), the cluster and the training
set-up from the command line, prints tables (or JSON with ``--json``, see
:mod:`offload_adamw.cli.common`), optionally writes a PNG of stacked bars per strategy against the GPU
and host capacities (``--plot FILE.png``). Exit status 0 when a strategy this project provides fits, 1
when none does, 2 on bad input (a ``--config`` file that is not a regular file of at most 16 MiB among
them: a FIFO or ``/dev/zero`` is refused by what it is, never read). Only provided strategies are
recommended; the others (``planner.COMPARISONS``) are shown marked as comparisons. For OffloadAdamW's
strategies a table shows how many groups each runs on the device, streamed and on the host, and the
chosen mix's bound against the single placements'; the recommended placement (or the mix, when the
recommendation is not OffloadAdamW's) is printed as the Python that builds it (``named_param_groups``
rules with ``update_on``, :mod:`offload_adamw.planning.placement`).

``--config`` takes a ``config.json``, or a directory holding one, read without transformers
(Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, DeepSeek-V3). With transformers installed it also
takes whatever ``AutoConfig.from_pretrained`` reads (a model id, a cached model), and a config of
another architecture is counted from the model built on the meta device (activations then not
estimated); :mod:`offload_adamw.planning.from_transformers`. Without transformers such a config is
refused, naming the model_type or key.

No torch import unless ``--measure`` or the meta-device count needs it. ``--measure`` takes the
host memory bandwidth from ``offload_adamw.benchmarking.bandwidth.measure_host_bandwidth()``
(imported only then); when that module is not installed it says so and keeps the default.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.colors import ListedColormap

from offload_adamw.cli import common
from offload_adamw.planning import models, placement, planner
from offload_adamw.planning.from_transformers import model_from_config
from offload_adamw.planning.planner import GB, HardwareConfig, Plan, TrainingConfig

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """A parameter count: 70000000000, 70e9, 70B, 6.7b, 125M."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (examples: 7e9, 70B, 125M)")
    value = float(match.group(1)) * _SUFFIXES[match.group(2)]
    if not math.isfinite(value) or value > 1e18:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} is out of range (at most 1e18)")
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole positive parameter count: {text!r}")
    return int(value)


def _defaults() -> tuple[HardwareConfig, TrainingConfig]:
    return HardwareConfig(), TrainingConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    hw, tr = _defaults()
    model = parser.add_argument_group("model (one of)").add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(models.PRESETS), help="a built-in model configuration")
    model.add_argument("--config", metavar="CONFIG",
                       help="a Hugging Face config.json or a directory holding one (Llama, Mistral, Qwen2, Mixtral, "
                            "Qwen2-MoE, DeepSeek-V3); with transformers installed, whatever AutoConfig reads")
    model.add_argument("--params", type=parse_count, metavar="N", help="only a parameter count (7e9, 70B): no activations")

    h = parser.add_argument_group("hardware (defaults: one DGX H100-class node)")
    h.add_argument("--gpus-per-node", type=int, default=hw.gpus_per_node)
    h.add_argument("--nodes", type=int, default=hw.nodes)
    h.add_argument("--replicas", type=int, default=hw.replicas, metavar="R",
                   help="HSDP: R copies of the model, each sharded over (nodes x GPUs) / R ranks (1: FSDP)")
    h.add_argument("--gpu-memory-gb", type=float, default=hw.gpu_memory_bytes / GB, help="memory of one GPU, GB (1e9)")
    h.add_argument("--gpu-reserved-gb", type=float, default=hw.gpu_reserved_bytes / GB,
                   help="per GPU: CUDA context, NCCL, allocator slack")
    h.add_argument("--host-memory-gb", type=float, default=hw.host_memory_bytes / GB, help="host memory per node")
    h.add_argument("--host-reserved-gb", type=float, default=hw.host_reserved_bytes / GB,
                   help="per node: OS, training processes, data loading")
    h.add_argument("--pcie-gbps", type=float, default=hw.pcie_bytes_per_s / GB,
                   help="host<->GPU GB/s per GPU and direction (PCIe Gen5 x16 with pinned memory)")
    h.add_argument("--host-bandwidth-gbps", type=float, default=hw.host_memory_bytes_per_s / GB,
                   help="sustained host memory GB/s per node")
    h.add_argument("--gpu-bandwidth-gbps", type=float, default=hw.gpu_memory_bytes_per_s / GB,
                   help="GPU memory GB/s (H100 SXM)")
    h.add_argument("--gpu-tflops", type=float, default=hw.gpu_flops_per_s / 1e12,
                   help="peak dense 16-bit TFLOP/s of one GPU (H100 SXM), for the step-time estimate")
    h.add_argument("--measure", action="store_true",
                   help="measure this machine's host memory bandwidth (offload_adamw.benchmarking.bandwidth) instead")

    t = parser.add_argument_group("training")
    t.add_argument("--dtype", default=tr.param_dtype, help="parameter/gradient dtype on the GPU: bf16, fp16, fp32")
    t.add_argument("--seq-len", type=int, default=tr.seq_len)
    t.add_argument("--micro-batch", type=int, default=tr.micro_batch, help="sequences per GPU per forward")
    t.add_argument("--grad-accum", type=int, default=tr.grad_accumulation, help="micro-batches per optimizer step")
    t.add_argument("--checkpointing", choices=("on", "off"), default="on" if tr.activation_checkpointing else "off",
                   help="full activation checkpointing")
    t.add_argument("--eager-attention", action="store_true", help="attention stores the s x s scores (no flash)")
    t.add_argument("--amsgrad", action="store_true")
    t.add_argument("--no-clipping", action="store_true", help="no gradient clipping: host updates may start during backward")
    t.add_argument("--mfu", type=float, default=tr.model_flops_utilization, metavar="FRACTION",
                   help="fraction of the GPU's peak that forward and backward reach (step-time estimate)")
    t.add_argument("--stream-chunk-mib", type=float, default=tr.stream_chunk_bytes / 2**20, metavar="MIB",
                   help="bytes of one device buffer of update_on='stream' (OffloadAdamW's stream_chunk_bytes), MiB")
    t.add_argument("--stream-buffers", type=int, choices=(2, 3), default=tr.stream_buffers,
                   help="device buffers in the ring of update_on='stream'")

    o = parser.add_argument_group("output")
    common.add_json_argument(parser, what="the plan", parent=o)
    common.add_plot_argument(parser, what="stacked bars per strategy against the capacities", parent=o)


def measured_host_bandwidth(**probe_options: Any) -> tuple[float | None, str]:
    """(bytes/s, where it came from) by offload_adamw.benchmarking.bandwidth, or (None, why not).

    The in-place triad (``a += s*b``) is the figure used: it has the optimizer
    step's access pattern (read-modify-write, no write-allocate); its median
    over the probe's passes where the probe reports one.
    """
    try:
        module = importlib.import_module("offload_adamw.benchmarking.bandwidth")
    except ModuleNotFoundError as exc:
        if exc.name != "offload_adamw.benchmarking.bandwidth":
            raise  # the module is there but one of its own imports is broken: show that
        return None, "--measure: offload_adamw.benchmarking.bandwidth is not available in this installation; keeping the default"
    result = module.measure_host_bandwidth(**probe_options)
    for key, scale in _BANDWIDTH_KEYS:
        value = result.get(key) if isinstance(result, dict) else getattr(result, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value) * scale, f"host memory bandwidth: {key} measured by offload_adamw.benchmarking.bandwidth"
    return None, f"--measure: no bandwidth in the probe's result {result!r}; keeping the default"


# (key, factor to bytes/s), in order of preference
_BANDWIDTH_KEYS = (
    ("inplace_triad_gbps_median", 1e9),
    ("inplace_triad_gbps", 1e9),
    ("inplace_triad_bytes_per_s", 1.0),
)


def build(args: argparse.Namespace) -> tuple[Plan, list[str]]:
    """The plan for parsed arguments, and messages for the user. Raises ValueError/OSError on bad input."""
    messages: list[str] = []
    if args.preset:
        model: models.Model = models.PRESETS[args.preset]
    elif args.config:
        model = model_from_config(args.config)
    else:
        model = models.ParamCountModel(name=f"--params {args.params:,}", params=args.params)
    host_bw = args.host_bandwidth_gbps * GB
    if args.measure:
        value, source = measured_host_bandwidth()
        messages.append(source)
        if value is not None:
            host_bw = value
    hardware = HardwareConfig(
        gpus_per_node=args.gpus_per_node, nodes=args.nodes, replicas=args.replicas,
        gpu_memory_bytes=args.gpu_memory_gb * GB,
        gpu_reserved_bytes=args.gpu_reserved_gb * GB, host_memory_bytes=args.host_memory_gb * GB,
        host_reserved_bytes=args.host_reserved_gb * GB, pcie_bytes_per_s=args.pcie_gbps * GB,
        host_memory_bytes_per_s=host_bw, gpu_memory_bytes_per_s=args.gpu_bandwidth_gbps * GB,
        gpu_flops_per_s=args.gpu_tflops * 1e12,
    )
    training = TrainingConfig(
        param_dtype=args.dtype, seq_len=args.seq_len, micro_batch=args.micro_batch,
        activation_checkpointing=args.checkpointing == "on", flash_attention=not args.eager_attention,
        grad_accumulation=args.grad_accum, amsgrad=args.amsgrad,
        model_flops_utilization=args.mfu, clipping=not args.no_clipping,
        stream_chunk_bytes=_chunk_bytes(args.stream_chunk_mib), stream_buffers=args.stream_buffers,
    )
    return planner.plan(model, hardware, training), messages


def _chunk_bytes(mib: float) -> int:
    """--stream-chunk-mib as whole bytes; not a positive size: ValueError naming the option."""
    if not (math.isfinite(mib) and mib > 0 and mib * 2**20 >= 1):
        raise ValueError(f"--stream-chunk-mib must be a positive size in MiB, got {mib!r}")
    return int(mib * 2**20)


# ----------------------------------------------------------------------------- rendering


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """First column (the strategy) left, numbers right; wraps the strategy names when the terminal is narrow."""
    return common.render_table(headers, rows, align="l" + "r" * (len(headers) - 1), wrap=0)


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


def _check_config_file(text: str) -> None:
    """A ``--config`` that names a file (or a directory holding config.json) names a regular file of at most
    16 MiB; anything else (a model id) is left to the planner."""
    if os.path.isdir(text):
        text = os.path.join(text, "config.json")
    if os.path.lexists(text):
        common.input_file(text, "--config")


def run(args: argparse.Namespace) -> int:
    if args.config is not None:
        _check_config_file(args.config)
    try:
        result, messages = build(args)
    except (ValueError, OSError) as exc:
        raise common.UsageError(str(exc)) from None
    for message in messages:
        print(message, file=sys.stderr)
    if not common.json_to_stdout(args):
        print(render(result))
    if args.json is not None:
        common.write_json("plan", {**result.as_dict(), "messages": messages}, args.json)
    if args.plot:
        with common.writing("--plot", args.plot):
            write_plot(result, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0 if result.recommendation else 1
