"""``offload-adamw plan``: what each GPU and each node holds, per strategy, and which one to use.

Contract: reads a model (``--preset``, ``--config`` or ``--params N``), the cluster and the training
set-up from the command line, prints the plan's tables (rendered by :mod:`offload_adamw.planning.report`;
or JSON with ``--json``, see :mod:`offload_adamw.cli.common`), optionally writes a PNG of stacked bars per
strategy against the GPU and host capacities (``--plot FILE.png``). Exit status 0 when a strategy this project provides fits, 1
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
from typing import Any

from offload_adamw.cli import common
from offload_adamw.planning import models, planner
from offload_adamw.planning.from_transformers import model_from_config
from offload_adamw.planning.planner import GB, HardwareConfig, Plan, TrainingConfig
from offload_adamw.planning.report import render, write_plot

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
