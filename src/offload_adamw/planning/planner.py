"""What fits where, and how fast an optimizer step can be: the planner behind ``offload-adamw plan``.

Contract:

* Pure computation on plain numbers: no torch import, no I/O. The models it plans for (presets,
  Hugging Face configs, parameter counts) are :mod:`offload_adamw.planning.models`.
* Per-element memory bills are those of docs/contract.md#memory-bill (bf16 parameter
  2, gradient 2, float32 master 4, m 4, v 4; AMSGrad's max_v 4 more; an fp32
  parameter on the device is its own master). Where a strategy is PyTorch's
  own arrangement (FSDP2 CPU offload), the bill is what PyTorch allocates, and
  the strategy's notes say so.
* :func:`predict_host_optimizer_bytes` is exactly what
  :meth:`offload_adamw.OffloadAdamW.host_state_bytes` reports once every
  tensor has state (the validation tests hold the two equal byte for byte).
* :func:`fsdp_rank_host_bytes` is exactly what one FSDP2 rank's OffloadAdamW allocates in host memory
  once every tensor has stepped: its state (``host_state_bytes``) and its transfer pipeline's buffers
  (``host_buffer_bytes``: a gradient buffer per shard, an accumulation buffer where micro-batches are
  added on the host, a staging copy per shard of a parameter on an accelerator), for the shards FSDP2
  gives that rank (dim 0 in chunks of ``ceil(rows / world)``: rank 0 holds the largest). The
  OffloadAdamW strategies' host bills are these figures times the ranks of a node (tested at small
  scale against the real Trainer on FSDP2).
* The ideal host-step memory traffic is docs/contract.md#traffic-bill: 28 bytes per
  element (36 with AMSGrad); transfers add what they move. Step-time bounds are
  bytes / bandwidth per link, the slowest link wins (perfect overlap), so they
  are lower bounds: compute, kernel launch and collectives are not included.
* OffloadAdamW's strategies are placements of each group's update (``update_on``,
  :mod:`offload_adamw.planning.placement`, one count of their bytes): every update on the
  host (with and without ``offload_gradients``), every group streamed (``"stream"``: the
  state up and back over PCIe, its ring of device buffers), and the mix chosen for the
  hardware (some groups resident, ``"device"``, the others streamed or on the host), whose
  ``update_on`` per group is printed as the ``named_param_groups`` rules to pass. A mix is
  recommended only where its bound is more than 5% below every other fitting strategy's.
* :func:`plan` runs one small function per strategy of :data:`STRATEGIES` (a registry, in that order:
  a new strategy is its description there and its function registered under the same name), over what
  they share computed once; a strategy without its function, or out of order, fails at import.
* Activations follow Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (arXiv:2205.05198), with no tensor
  or sequence parallelism: per layer ``s*b*h*(34 + 5*a*s/h)`` bytes without
  recomputation, ``34*s*b*h`` when the attention core is not stored (their
  selective recomputation; FlashAttention has the same effect), and ``2*s*b*h``
  per layer (the layer input) with full activation checkpointing, plus the
  working set of the one layer being recomputed. Outside the layers we add the
  inputs of the final norm and output projection (4sbh) and the float32 logits
  of the loss (4sbv), as the paper's section 4.1 does. The paper models a GPT
  layer (4h MLP, dropout); for Llama-style layers (SwiGLU, no dropout, GQA) it
  is an estimate, not a count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from offload_adamw.contract import bills
from offload_adamw.planning import placement
from offload_adamw.planning.models import (
    Model,
    ModelConfig,
    ParamCountModel,
    ParamShapesModel,
    ParamSpec,
    dtype_bytes,
    dtype_name,
)
from offload_adamw.planning.overlap import step_times, training_step_model

__all__ = [
    "HardwareConfig",
    "TrainingConfig",
    "MemoryBill",
    "StrategyPlan",
    "Plan",
    "STRATEGIES",
    "COMPARISONS",
    "MIX",
    "predict_host_optimizer_bytes",
    "RankHostBytes",
    "fsdp_rank_host_bytes",
    "memory_bill",
    "activation_bytes",
    "plan",
]

GB = 1e9


# --------------------------------------------------------------------------- the state bill of parameters


def predict_host_optimizer_bytes(params: Iterable[ParamSpec], *, amsgrad: bool = False) -> int:
    """Host bytes of OffloadAdamW's state once every tensor in ``params`` has stepped.

    Per tensor: the float32 step count (4 bytes), exp_avg and exp_avg_sq (and
    max_exp_avg_sq with AMSGrad) in float32 (float64 for float64 parameters),
    and a master copy of the same dtype unless the parameter is a float32 or
    float64 tensor in host memory (then it is its own master).
    """
    total = 0
    for spec in params:
        total += bills.tensor_state_bytes(spec.numel, dtype_name(spec.dtype), on_host=spec.on_host, amsgrad=amsgrad).total
    return total


@dataclass(frozen=True, kw_only=True)
class RankHostBytes:
    """Host bytes one rank's OffloadAdamW allocates for its FSDP2 shards: the state and the transfer buffers."""

    master: int = 0
    """float32 masters (none for a float32 parameter in host memory: it is its own master)."""
    exp_avg: int = 0
    """m, float32."""
    exp_avg_sq: int = 0
    """v, float32."""
    max_exp_avg_sq: int = 0
    """AMSGrad's max_v, float32."""
    step_counts: int = 0
    """One float32 step count per tensor."""
    gradients: int = 0
    """The pipeline's host gradient buffers, in the parameters' dtype (``host_buffer_bytes()["gradients"]``)."""
    accumulation: int = 0
    """The second buffer of host accumulation, where FSDP2 reduces every micro-batch into the host gradient."""
    staging: int = 0
    """The parameter-dtype copies device parameters are sent back from (``"parameter staging"``)."""

    @property
    def state(self) -> int:
        """What ``OffloadAdamW.host_state_bytes()`` reports."""
        return self.master + self.exp_avg + self.exp_avg_sq + self.max_exp_avg_sq + self.step_counts

    def buffers(self) -> dict[str, int]:
        """What ``OffloadAdamW.host_buffer_bytes()`` reports, by purpose (its labels; nothing for a purpose not allocated)."""
        named = {"gradients": self.gradients, "accumulation": self.accumulation, "parameter staging": self.staging}
        return {label: value for label, value in named.items() if value}

    @property
    def total(self) -> int:
        return self.state + self.gradients + self.accumulation + self.staging

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "state": self.state, "total": self.total}


def fsdp_rank_host_bytes(
    shapes: Iterable[tuple[int, ...]], *, world: int, rank: int = 0, param_dtype: str = "bfloat16",
    on_host: bool = False, host_accumulation: bool = False, amsgrad: bool = False,
) -> RankHostBytes:
    """Host bytes of rank ``rank``'s OffloadAdamW with the transfer pipeline over the FSDP2 shards of ``shapes``.

    ``shapes``: the full shapes of the trainable parameters (each once); FSDP2 gives rank ``rank`` its chunk of dim 0.
    ``on_host``: the shards live in host memory (the CPU as device: no staging, a float32 shard its own master).
    ``host_accumulation``: micro-batches are added on the host (FSDP2 reducing every micro-batch), not inside
    ``set_requires_gradient_sync(False)`` (what accelerate's and the Trainer's ``no_sync`` does).
    """
    if not (isinstance(world, int) and 0 < world and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank must be in [0, world) and world positive, got rank={rank!r}, world={world!r}")
    name = dtype_name(param_dtype)
    p = dtype_bytes(name)
    state = bills.StateBytes()
    elements = 0
    for shape in shapes:
        local = placement.shard_numel(shape, world, rank)
        elements += local
        state = state + bills.tensor_state_bytes(local, name, on_host=on_host, amsgrad=amsgrad)
    one = state.moments // (3 if amsgrad else 2)  # bytes of one moment over every shard
    grads = p * elements
    return RankHostBytes(
        master=state.master, exp_avg=one, exp_avg_sq=one, max_exp_avg_sq=one if amsgrad else 0,
        step_counts=state.step, gradients=grads, accumulation=grads if host_accumulation else 0,
        staging=0 if on_host else grads,
    )


# --------------------------------------------------------------------------- hardware, training


@dataclass(frozen=True, kw_only=True)
class HardwareConfig:
    """The cluster. Defaults: a DGX H100-class node (8 x H100 SXM 80 GB, 2 TB host memory, PCIe Gen5)."""

    gpus_per_node: int = 8
    """GPUs (ranks) per node; they share the node's host memory and its bandwidth."""
    nodes: int = 1
    """Number of nodes."""
    replicas: int = 1
    """HSDP: copies of the sharded model (FSDP2's ``fully_shard`` over a 2-D mesh, replicated across its first
    dimension); each copy is sharded over ``world_size // replicas`` ranks. 1: FSDP over every rank."""
    gpu_memory_bytes: float = 80 * GB
    """Memory of one GPU. 80e9 for an "80 GB" H100 is conservative: an H100 80GB has 80 GiB (85.9e9 bytes),
    of which the driver keeps some."""
    gpu_reserved_bytes: float = 4 * GB
    """Per GPU, not available to tensors: CUDA context, NCCL buffers, allocator fragmentation (an estimate)."""
    host_memory_bytes: float = 2000 * GB
    """Host memory per node (DGX H100: 2 TB)."""
    host_reserved_bytes: float = 64 * GB
    """Per node, kept for the OS, the training processes (8 GB each for 8 ranks) and data loading (an estimate)."""
    pcie_bytes_per_s: float = 50 * GB
    """Host<->GPU bandwidth per GPU and per direction (PCIe Gen5 x16: 64 GB/s raw, about 50 GB/s with pinned memory).
    Each GPU is assumed to have its own link; links are full duplex."""
    host_memory_bytes_per_s: float = 400 * GB
    """Sustained host memory bandwidth per node, shared by its GPUs' host work (two sockets of 8-channel DDR5-4800
    peak at 614 GB/s; about two thirds of peak is sustained). ``--measure`` replaces it by a measurement."""
    gpu_memory_bytes_per_s: float = 3350 * GB
    """Device memory bandwidth of one GPU (H100 SXM HBM3: 3.35 TB/s)."""
    gpu_flops_per_s: float = 989e12
    """Peak dense 16-bit matrix throughput of one GPU (H100 SXM: 989 TFLOP/s), for the step-time estimate."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("gpus_per_node", "nodes", "replicas"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"hardware: {f.name} must be a positive integer, got {value!r}")
            elif f.name.endswith("_per_s") or f.name in ("gpu_memory_bytes", "host_memory_bytes"):
                if not value > 0:
                    raise ValueError(f"hardware: {f.name} must be positive, got {value!r}")
            elif not value >= 0:
                raise ValueError(f"hardware: {f.name} must be non-negative, got {value!r}")

        if self.world_size % self.replicas:
            raise ValueError(f"hardware: replicas must divide the {self.world_size} ranks "
                             f"({self.nodes} nodes x {self.gpus_per_node} GPUs), got {self.replicas}")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def shard_degree(self) -> int:
        """Ranks each parameter is sharded over: every rank under FSDP, one replica's under HSDP."""
        return self.world_size // self.replicas


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How the model is trained."""

    param_dtype: str = "bfloat16"
    """dtype of the model's parameters and gradients on the GPU (bfloat16, float16 or float32)."""
    seq_len: int = 4096
    """Tokens per sequence s."""
    micro_batch: int = 1
    """Sequences per GPU per forward/backward b."""
    activation_checkpointing: bool = True
    """Full activation checkpointing: each layer keeps only its input (2sbh) and is recomputed in backward."""
    flash_attention: bool = True
    """Attention that does not store the s x s scores (FlashAttention/SDPA): drops the 5as/h term."""
    grad_accumulation: int = 1
    """Micro-batches per optimizer step."""
    amsgrad: bool = False
    """AMSGrad keeps max_v (4 more bytes per element, read and written by every step)."""
    model_flops_utilization: float = 0.4
    """Fraction of the GPU's peak that forward and backward reach (the step-time estimate's one guess)."""
    clipping: bool = True
    """Gradient clipping by global norm (transformers' Trainer default): host updates wait for the norm."""
    stream_chunk_bytes: int = 64 * 2**20
    """Bytes of one device buffer of the streamed state's ring (OffloadAdamW's ``stream_chunk_bytes``)."""
    stream_buffers: int = 3
    """Device buffers in the ring, 2 or 3: with 3 the copy up of chunk k+1 and down of chunk k-1 run while chunk k is
    updated."""

    def __post_init__(self) -> None:
        if not 0.0 < self.model_flops_utilization <= 1.0:
            raise ValueError(f"training: model_flops_utilization must be in (0, 1], got {self.model_flops_utilization!r}")
        name = dtype_name(self.param_dtype)
        if name == "float64":
            raise ValueError("training: param_dtype float64 is not a GPU training dtype this planner models")
        object.__setattr__(self, "param_dtype", name)
        for f in ("seq_len", "micro_batch", "grad_accumulation", "stream_chunk_bytes"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"training: {f} must be a positive integer, got {value!r}")
        if self.stream_buffers not in (2, 3) or isinstance(self.stream_buffers, bool):
            raise ValueError(f"training: stream_buffers must be 2 or 3, got {self.stream_buffers!r}")


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True)
class MemoryBill:
    """Bytes held in one place (one GPU, or one node's host memory), by item."""

    parameters: int = 0
    """Model parameters in their training dtype (the local shard under FSDP)."""
    gradients: int = 0
    """Gradients (device tensors, or host buffers the gradients land in)."""
    master: int = 0
    """float32 master copies (none when the parameter is float32 and its own master)."""
    exp_avg: int = 0
    """First moment m, float32."""
    exp_avg_sq: int = 0
    """Second moment v, float32."""
    max_exp_avg_sq: int = 0
    """AMSGrad's max_v, float32."""
    step_counts: int = 0
    """OffloadAdamW's float32 step tensor per parameter tensor."""
    activations: int = 0
    """Activations kept for backward (see the module docstring)."""
    buffers: int = 0
    """Communication and staging buffers (FSDP all-gather/reduce-scatter, DDP buckets, streaming chunks)."""
    reserved: int = 0
    """Fixed reserve (CUDA context, allocator slack; OS and processes on the host)."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True, kw_only=True)
class StrategyPlan:
    """One strategy's memory per GPU and per node, traffic per step, and step-time bound."""

    name: str
    """Short identifier (used by --json and --plot)."""
    description: str
    """What the strategy is, in words."""
    gpu: MemoryBill
    """Bytes on each GPU."""
    host: MemoryBill
    """Bytes in each node's host memory."""
    gpu_capacity: float
    """Memory of one GPU."""
    host_capacity: float
    """Host memory of one node."""
    pcie_h2d_bytes: int
    """Host-to-device bytes per training step, per GPU."""
    pcie_d2h_bytes: int
    """Device-to-host bytes per training step, per GPU."""
    host_memory_traffic_bytes: int
    """Bytes read plus written in a node's host memory per training step (updates and DMA)."""
    gpu_memory_traffic_bytes: int
    """Bytes read plus written in one GPU's memory by the optimizer step (and state streaming)."""
    step_time_lower_bound_s: float
    """max over links (PCIe, host memory, GPU memory) of bytes / bandwidth: no compute, perfect overlap."""
    bottleneck: str
    """The link that sets the bound ("pcie", "host memory", "gpu memory")."""
    gpus_used: int
    """GPUs the strategy trains on."""
    notes: tuple[str, ...] = ()
    """Assumptions specific to this strategy."""
    comparison: bool = False
    """Planned only to compare with (see COMPARISONS): never the recommendation."""
    step_time_serial_s: float | None = None
    """Estimated training step with the optimizer after backward (planning/overlap.py); None without compute figures."""
    step_time_overlapped_s: float | None = None
    """The same with each group's host update started as its gradients arrive
    (equal to serial where the optimizer runs on the GPU)."""
    host_per_rank: RankHostBytes | None = None
    """What one rank's OffloadAdamW allocates in host memory (rank 0, which holds the largest shards); None where
    OffloadAdamW is not the optimizer. ``host`` holds it once per rank of a node."""
    mix: placement.Mix | None = None
    """Where OffloadAdamW runs each group's update (``update_on``); None for the strategies without OffloadAdamW."""

    @property
    def gpu_margin(self) -> float:
        return self.gpu_capacity - self.gpu.total

    @property
    def host_margin(self) -> float:
        return self.host_capacity - self.host.total

    @property
    def fits(self) -> bool:
        return self.gpu_margin >= 0 and self.host_margin >= 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "gpu_bytes": self.gpu.as_dict(),
            "host_bytes_per_node": self.host.as_dict(),
            "gpu_capacity": self.gpu_capacity,
            "host_capacity": self.host_capacity,
            "gpu_margin": self.gpu_margin,
            "host_margin": self.host_margin,
            "fits": self.fits,
            "pcie_h2d_bytes_per_gpu": self.pcie_h2d_bytes,
            "pcie_d2h_bytes_per_gpu": self.pcie_d2h_bytes,
            "host_memory_traffic_bytes_per_node": self.host_memory_traffic_bytes,
            "gpu_memory_traffic_bytes_per_gpu": self.gpu_memory_traffic_bytes,
            "step_time_lower_bound_s": self.step_time_lower_bound_s,
            "bottleneck": self.bottleneck,
            "gpus_used": self.gpus_used,
            "comparison": self.comparison,
            "step_time_serial_s": self.step_time_serial_s,
            "step_time_overlapped_s": self.step_time_overlapped_s,
            "host_bytes_per_rank": None if self.host_per_rank is None else self.host_per_rank.as_dict(),
            "placement": None if self.mix is None else mix_as_dict(self.mix),
            "notes": list(self.notes),
        }


def mix_as_dict(mix: placement.Mix) -> dict[str, Any]:
    """A placement mix as JSON: the flag, groups per placement, the rules to pass, and each group's placement."""
    rules, default = mix.param_group_rules()
    return {
        "offload_gradients": mix.offload_gradients,
        "groups_per_placement": {x: mix.count(x) for x in placement.PLACEMENTS},
        "elements_per_gpu": dict(mix.totals.elements),
        "param_group_rules": [[pattern, hyper] for pattern, hyper in rules],
        "default_group": default,
        "groups": [{"group": grp.label, "update_on": x, "elements_per_gpu": grp.elements, "tensors": grp.tensors}
                   for grp, x in mix.assignment],
    }


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Every strategy side by side, and the recommendation."""

    model_name: str
    """The model's label."""
    num_parameters: int
    """Trainable elements of the model."""
    hardware: HardwareConfig
    """The cluster planned for."""
    training: TrainingConfig
    """The training set-up planned for."""
    strategies: tuple[StrategyPlan, ...]
    """One entry per strategy, in STRATEGIES order."""
    recommendation: str | None
    """Name of the recommended strategy, None when nothing fits."""
    reason: str
    """Why that one (or why none)."""
    assumptions: tuple[str, ...]
    """Model-wide assumptions (activation formula, bandwidth sources)."""

    def strategy(self, name: str) -> StrategyPlan:
        for s in self.strategies:
            if s.name == name:
                return s
        raise KeyError(f"no strategy {name!r}; known: {[s.name for s in self.strategies]}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "num_parameters": self.num_parameters,
            "hardware": asdict(self.hardware),
            "training": asdict(self.training),
            "strategies": [s.as_dict() for s in self.strategies],
            "recommendation": self.recommendation,
            "reason": self.reason,
            "assumptions": list(self.assumptions),
        }


def memory_bill(num_parameters: int, *, param_dtype: str = "bfloat16", amsgrad: bool = False) -> MemoryBill:
    """docs/contract.md#memory-bill for ``num_parameters`` trainable elements in one place (no activations, no buffers).

    bf16/fp16: parameter 2, gradient 2, master 4, m 4, v 4 bytes per element; float32: 4, 4, 0 (its own
    master), 4, 4; AMSGrad adds max_v, 4 bytes.
    """
    p = dtype_bytes(param_dtype)
    n = int(num_parameters)
    return MemoryBill(
        parameters=p * n, gradients=p * n, master=0 if p >= 4 else 4 * n,
        exp_avg=4 * n, exp_avg_sq=4 * n, max_exp_avg_sq=4 * n if amsgrad else 0,
    )


# --------------------------------------------------------------------------- formulas


def activation_bytes(model: Model, training: TrainingConfig) -> int:
    """Activation bytes one GPU keeps for backward (Korthikanti et al. 2022; see the module docstring).

    0 for a model known only by its parameter count.
    """
    if not isinstance(model, ModelConfig):
        return 0
    s, b, h = training.seq_len, training.micro_batch, model.hidden_size
    a, layers, v = model.num_attention_heads, model.num_hidden_layers, model.vocab_size
    # per layer, 16-bit activations: 34sbh, plus 5as^2b for the stored attention scores, softmax and its mask
    full_layer = 34 * s * b * h + (0 if training.flash_attention else 5 * a * s * s * b)
    if training.activation_checkpointing:
        layers_bytes = layers * 2 * s * b * h + full_layer  # inputs kept, one layer recomputed at a time
    else:
        layers_bytes = layers * full_layer
    outside = 4 * s * b * h + 4 * s * b * v  # final norm + output projection inputs, float32 logits
    return layers_bytes + outside


STRATEGIES: dict[str, str] = {
    "single-gpu": "no sharding: one GPU holds parameters, gradients, master, m and v",
    "ddp": "DDP: every GPU holds a full replica and the step runs on the GPU",
    "fsdp": "FSDP full shard: everything sharded over all GPUs, step on the GPU",
    "fsdp+offload-adamw": "FSDP full shard, OffloadAdamW: master, m, v in host memory, step on the host",
    "fsdp+offload-adamw+offload-grads": "the same with offload_gradients=True: gradients freed on the GPU after their copy",
    "fsdp+streamed-state": "the same with update_on=\"stream\": master, m, v in pinned host memory, streamed through "
                           "the GPU in chunks for torch's fused AdamW there",
    "fsdp+placement-mix": "OffloadAdamW with update_on per group: some groups' state resident on the GPU, the others "
                          "streamed or updated on the host, as fits this hardware best",
    "fsdp+cpu-offload": "FSDP2 CPUOffloadPolicy: parameters, gradients and state in host memory, torch AdamW on the host",
}

#: the strategy of OffloadAdamW with a placement chosen per group (planning/placement.py).
MIX = "fsdp+placement-mix"
STAGING_NOTE = ("host buffers: the staging copy each updated shard is sent back from, in the parameters' dtype "
                "(accel/host_update.py)")

# Strategies planned only to compare with: never recommended, marked as comparisons in every output.
COMPARISONS: dict[str, str] = {
    "fsdp+cpu-offload": "PyTorch's FSDP2 CPUOffloadPolicy with torch AdamW, not this project",
}


def _bound(hardware: HardwareConfig, *, h2d: int, d2h: int, host: int, gpu: int) -> tuple[float, str]:
    times = {
        "pcie": max(h2d, d2h) / hardware.pcie_bytes_per_s,
        "host memory": host / hardware.host_memory_bytes_per_s,
        "gpu memory": gpu / hardware.gpu_memory_bytes_per_s,
    }
    bottleneck = max(times, key=lambda k: times[k])
    return times[bottleneck], bottleneck


# --------------------------------------------------------------------------- the strategies, one function each
#
# Each strategy of STRATEGIES is planned by one function of _PLANNERS, registered under its name in the order of
# STRATEGIES (the order of every output); what they share (the model's counts, the FSDP shard, the placement costs
# and limits, the step-time model) is computed once per plan, in a _Setting.


@dataclass(frozen=True, kw_only=True)
class _Setting:
    """What every strategy's plan reads, computed once per :func:`plan`."""

    hardware: HardwareConfig
    training: TrainingConfig
    n: int
    """Parameters of the model."""
    p: int
    """Bytes of a parameter on the GPU."""
    g: int
    """Bytes of a gradient on the GPU (the parameter's dtype)."""
    acts: int
    """Activation bytes per GPU."""
    shard: int
    """Elements per rank under FSDP (padded)."""
    fsdp_buffers: int
    """All-gather of the unsharded unit, prefetched one ahead, and the unit's unsharded gradients for reduce-scatter."""
    groups: int
    """Groups of the step-time model: the decoder layers and the other tensors (1 without an architecture)."""
    plan_groups: list[placement.PlanningGroup]
    costs: dict[bool, dict[str, placement.PlacementCost]]
    """Per placement, with and without ``offload_gradients``."""
    limits: placement.Limits
    world: int
    per_node: int
    amsgrad: bool
    update_bytes: int
    """docs/contract.md#traffic-bill: the ideal single pass per element."""
    gpu_reserved: int
    host_reserved: int
    ring: int
    """The device buffers of a streamed state's ring."""

    @classmethod
    def of(cls, model: Model, hardware: HardwareConfig, training: TrainingConfig) -> _Setting:
        shapes = model.parameter_shapes()
        p = dtype_bytes(training.param_dtype)
        g = p
        degree = hardware.shard_degree  # every rank (FSDP), or one replica's ranks (HSDP)
        shard = sum(placement.shard_numel(s, degree) for _, s in shapes)
        unit = model.largest_unit_parameters()
        fsdp_buffers = 2 * unit * p + unit * g
        acts = activation_bytes(model, training)
        amsgrad, accum = training.amsgrad, training.grad_accumulation
        costs = {flag: placement.placement_costs(param_bytes=p, grad_bytes=g, amsgrad=amsgrad, grad_accumulation=accum,
                                                 offload_gradients=flag) for flag in (False, True)}
        limits = placement.Limits(
            gpu_fixed_bytes=p * shard + acts + fsdp_buffers + int(hardware.gpu_reserved_bytes),
            gpu_capacity=hardware.gpu_memory_bytes, host_fixed_bytes=int(hardware.host_reserved_bytes),
            host_capacity=hardware.host_memory_bytes, ranks_per_node=hardware.gpus_per_node,
            ring_bytes=training.stream_buffers * training.stream_chunk_bytes, pcie_bytes_per_s=hardware.pcie_bytes_per_s,
            host_memory_bytes_per_s=hardware.host_memory_bytes_per_s,
            gpu_memory_bytes_per_s=hardware.gpu_memory_bytes_per_s,
        )
        return cls(hardware=hardware, training=training, n=sum(math.prod(s) for _, s in shapes), p=p, g=g, acts=acts,
                   shard=shard, fsdp_buffers=fsdp_buffers,
                   groups=(model.num_hidden_layers + 2) if isinstance(model, ModelConfig) else 1,
                   plan_groups=placement.planning_groups(shapes, degree), costs=costs, limits=limits,
                   world=hardware.world_size, per_node=hardware.gpus_per_node, amsgrad=amsgrad,
                   update_bytes=28 + (8 if amsgrad else 0), gpu_reserved=int(hardware.gpu_reserved_bytes),
                   host_reserved=int(hardware.host_reserved_bytes), ring=limits.ring_bytes)

    def device_state(self, elements: int) -> dict[str, int]:
        """A device-updated parameter's master (none where the parameter is float32, its own), m, v (, max_v)."""
        return {
            "master": 0 if self.p == 4 else 4 * elements,
            "exp_avg": 4 * elements,
            "exp_avg_sq": 4 * elements,
            "max_exp_avg_sq": 4 * elements if self.amsgrad else 0,
        }

    def times(self, host_traffic: int, gpu_traffic: int, h2d: int, d2h: int,
              lanes: dict[str, Any] | None) -> tuple[float, float]:
        """The training step's serial and overlapped time (planning/overlap.py) for these lanes."""
        hardware, training = self.hardware, self.training
        if lanes is None:  # one lane: the host update (or the GPU's own step) and the copies around it
            lanes = dict(
                host_update_s=host_traffic / hardware.host_memory_bytes_per_s + gpu_traffic / hardware.gpu_memory_bytes_per_s,
                d2h_s=d2h / hardware.pcie_bytes_per_s, h2d_s=h2d / hardware.pcie_bytes_per_s,
                groups=self.groups if host_traffic else 1,
            )
        step = training_step_model(
            num_parameters=self.n, tokens_per_gpu=training.seq_len * training.micro_batch,
            gpu_flops_per_s=hardware.gpu_flops_per_s, model_flops_utilization=training.model_flops_utilization,
            activation_checkpointing=training.activation_checkpointing, grad_accumulation=training.grad_accumulation,
            clipping=training.clipping, **lanes,
        )
        t = step_times(step)
        return t.serial_s, t.overlapped_s

    def strategy(self, name: str, *, gpu: MemoryBill, host: MemoryBill, h2d: int, d2h: int, host_traffic: int,
                 gpu_traffic: int, gpus_used: int, notes: Sequence[str] = (), mix: placement.Mix | None = None,
                 lanes: dict[str, Any] | None = None, per_rank: RankHostBytes | None = None) -> StrategyPlan:
        """The plan of strategy ``name`` from its bills and traffic: its bound, its step times, the HSDP note."""
        hardware = self.hardware
        bound, bottleneck = _bound(hardware, h2d=h2d, d2h=d2h, host=host_traffic, gpu=gpu_traffic)
        serial, overlapped = self.times(host_traffic, gpu_traffic, h2d, d2h, lanes)
        if hardware.replicas > 1 and name.startswith("fsdp"):
            degree = hardware.shard_degree
            notes = (f"HSDP: {hardware.replicas} replicas, each sharded over {degree} ranks: every rank holds "
                     f"1/{degree} of the model, not 1/{self.world}; gradients are all-reduced across replicas", *notes)
        return StrategyPlan(
            name=name, description=STRATEGIES[name], gpu=gpu, host=host,
            gpu_capacity=hardware.gpu_memory_bytes, host_capacity=hardware.host_memory_bytes,
            pcie_h2d_bytes=h2d, pcie_d2h_bytes=d2h, host_memory_traffic_bytes=host_traffic,
            gpu_memory_traffic_bytes=gpu_traffic, step_time_lower_bound_s=bound, bottleneck=bottleneck,
            gpus_used=gpus_used, notes=tuple(notes), comparison=name in COMPARISONS,
            step_time_serial_s=serial, step_time_overlapped_s=overlapped, mix=mix,
            host_per_rank=per_rank,
        )

    def uniform(self, where: str, offload_gradients: bool) -> placement.Mix:
        """Every group's update in one place."""
        elements = {where: sum(grp.elements for grp in self.plan_groups)}
        tensors = {where: sum(grp.tensors for grp in self.plan_groups)}
        return placement.Mix(offload_gradients=offload_gradients,
                             assignment=tuple((grp, where) for grp in self.plan_groups),
                             totals=placement.evaluate(elements, tensors, self.costs[offload_gradients], self.limits))

    def offload(self, name: str, mix: placement.Mix, notes: Sequence[str]) -> StrategyPlan:
        """An OffloadAdamW strategy: each group's update where ``mix`` puts it (planning/placement.py's bytes)."""
        p, g, amsgrad, per_node = self.p, self.g, self.amsgrad, self.per_node
        t = mix.totals
        e, k = t.elements, t.tensors
        flag = mix.offload_gradients
        state = {"master": 4, "exp_avg": 4, "exp_avg_sq": 4, "max_exp_avg_sq": 4 if amsgrad else 0}
        kept = e["device"] + e["stream"] + (0 if flag else e["host"])  # gradients that stay on the GPU
        # host buffers the host groups' gradients land in
        landing = g * e["host"] * (2 if flag and self.training.grad_accumulation > 1 else 1)
        streamed = e["stream"] > 0 or k["stream"] > 0
        gpu = MemoryBill(parameters=p * self.shard, gradients=g * kept, **{key: b * e["device"] for key, b in state.items()},
                         step_counts=bills.STEP_COUNT_BYTES * k["device"], activations=self.acts,
                         buffers=self.fsdp_buffers + (self.ring if streamed else 0), reserved=self.gpu_reserved)
        # One rank's host bytes (fsdp_rank_host_bytes for the groups on the host): the state of host and streamed
        # groups; the host groups' gradient buffers, their accumulation buffer, and the staging copies their updated
        # parameters are sent back from. The node holds it once per rank.
        held = e["host"] + e["stream"]
        rank = RankHostBytes(
            master=4 * held, exp_avg=4 * held, exp_avg_sq=4 * held, max_exp_avg_sq=4 * held if amsgrad else 0,
            step_counts=bills.STEP_COUNT_BYTES * (k["host"] + k["stream"]), gradients=g * e["host"],
            accumulation=landing - g * e["host"], staging=p * e["host"],
        )
        host = MemoryBill(
            gradients=per_node * (rank.gradients + rank.accumulation), master=per_node * rank.master,
            exp_avg=per_node * rank.exp_avg, exp_avg_sq=per_node * rank.exp_avg_sq,
            max_exp_avg_sq=per_node * rank.max_exp_avg_sq, step_counts=per_node * rank.step_counts,
            buffers=per_node * rank.staging, reserved=self.host_reserved,
        )
        assert gpu.total == t.gpu_bytes and host.total == t.host_bytes, (name, gpu.total, t.gpu_bytes, host.total, t.host_bytes)
        return self.strategy(name, gpu=gpu, host=host, h2d=t.h2d, d2h=t.d2h, host_traffic=t.host_traffic,
                             gpu_traffic=t.gpu_traffic, gpus_used=self.world, notes=notes, mix=mix,
                             lanes=None if mix.uniform == "host" else self.lanes(mix), per_rank=rank)

    def lanes(self, mix: placement.Mix) -> dict[str, float]:
        """The step-time model's lanes of a mix (planning/overlap.py): host updates, device updates, host memory."""
        e = mix.totals.elements
        c = self.costs[mix.offload_gradients]
        per_node = self.per_node
        pcie, host_bw, gpu_bw = (self.hardware.pcie_bytes_per_s, self.hardware.host_memory_bytes_per_s,
                                 self.hardware.gpu_memory_bytes_per_s)
        stream = e["stream"]
        # a streamed group takes as long as its slowest link; the resident groups' update reads and writes device memory
        device = max(c["stream"].h2d * stream / pcie, per_node * c["stream"].host_traffic * stream / host_bw,
                     c["stream"].gpu_traffic * stream / gpu_bw) + c["device"].gpu_traffic * e["device"] / gpu_bw
        # what uses host memory once updates may start: the host update and its parameters going out, the streams
        after_start = per_node * ((self.update_bytes + self.p) * e["host"] + c["stream"].host_traffic * stream)
        return {
            "host_update_s": per_node * c["host"].host_traffic * e["host"] / host_bw,
            "d2h_s": c["host"].d2h * e["host"] / pcie, "h2d_s": c["host"].h2d * e["host"] / pcie,
            "groups": max(1, mix.count("host")), "device_update_s": device,
            "device_groups": max(1, mix.count("stream") + mix.count("device")), "host_memory_s": after_start / host_bw,
        }


_PLANNERS: dict[str, Callable[[_Setting], StrategyPlan]] = {}
"""The strategies' planners by name, in the order of STRATEGIES (checked below, once they are all registered)."""


def _planner(name: str) -> Callable[[Callable[[_Setting], StrategyPlan]], Callable[[_Setting], StrategyPlan]]:
    """Register the decorated function as the planner of strategy ``name`` (one of STRATEGIES)."""
    def register(function: Callable[[_Setting], StrategyPlan]) -> Callable[[_Setting], StrategyPlan]:
        if name not in STRATEGIES or name in _PLANNERS:
            raise ValueError(f"planner: {name!r} is not a strategy of STRATEGIES, or has a planner already")
        _PLANNERS[name] = function
        return function
    return register


# Unsharded: the whole bill on one GPU; DDP adds its gradient buckets (gradient_as_bucket_view=False).
@_planner("single-gpu")
def _single_gpu(s: _Setting) -> StrategyPlan:
    n = s.n
    return s.strategy(
        "single-gpu",
        gpu=MemoryBill(parameters=s.p * n, gradients=s.g * n, **s.device_state(n), activations=s.acts,
                       reserved=s.gpu_reserved),
        host=MemoryBill(reserved=s.host_reserved), h2d=0, d2h=0, host_traffic=0, gpu_traffic=s.update_bytes * n,
        gpus_used=1, notes=("trains on one GPU; the others idle",) if s.world > 1 else ())


@_planner("ddp")
def _ddp(s: _Setting) -> StrategyPlan:
    n = s.n
    return s.strategy(
        "ddp",
        gpu=MemoryBill(parameters=s.p * n, gradients=s.g * n, **s.device_state(n), activations=s.acts,
                       buffers=s.g * n, reserved=s.gpu_reserved),
        host=MemoryBill(reserved=s.host_reserved), h2d=0, d2h=0, host_traffic=0, gpu_traffic=s.update_bytes * n,
        gpus_used=s.world,
        notes=("buffers: DDP's gradient buckets, a second copy of the gradients (gradient_as_bucket_view=False)",))


@_planner("fsdp")
def _fsdp(s: _Setting) -> StrategyPlan:
    shard = s.shard
    return s.strategy(
        "fsdp",
        gpu=MemoryBill(parameters=s.p * shard, gradients=s.g * shard, **s.device_state(shard), activations=s.acts,
                       buffers=s.fsdp_buffers, reserved=s.gpu_reserved),
        host=MemoryBill(reserved=s.host_reserved), h2d=0, d2h=0, host_traffic=0, gpu_traffic=s.update_bytes * shard,
        gpus_used=s.world,
        notes=("FSDP2 with MixedPrecisionPolicy arranges the same 16 bytes/element as fp32 shard + fp32 grad + m + v",))


# OffloadAdamW: each group's update on the host, streamed through the GPU, or on the GPU (update_on), one count of
# their bytes (planning/placement.py). On the host the gradients go down once per step (accumulated on the GPU) and
# the updated parameters come back; with offload_gradients every micro-batch's gradient goes down and is
# accumulated in host memory.
@_planner("fsdp+offload-adamw")
def _offload_adamw(s: _Setting) -> StrategyPlan:
    return s.offload("fsdp+offload-adamw", s.uniform("host", False), (
        "host traffic: gradient DMA in, the 28-byte single-pass update (docs/contract.md, section Traffic bill), "
        "parameter DMA out", STAGING_NOTE))


@_planner("fsdp+offload-adamw+offload-grads")
def _offload_adamw_offload_grads(s: _Setting) -> StrategyPlan:
    return s.offload("fsdp+offload-adamw+offload-grads", s.uniform("host", True), (
        "GPU gradients are transient (one FSDP unit, inside buffers)",
        "accumulation > 1: FSDP2 reduces every micro-batch and the host adds it, through an accumulation buffer "
        "next to the host gradient; 4 bytes of traffic per byte of gradient per extra micro-batch. (accelerate's "
        "and the Trainer's no_sync instead keep FSDP2's unsharded gradients on the GPU until the last one.)",
        STAGING_NOTE))


@_planner("fsdp+streamed-state")
def _streamed_state(s: _Setting) -> StrategyPlan:
    training = s.training
    state_bytes = placement.state_bytes_per_element(amsgrad=s.amsgrad)  # a device parameter's master, m, v (, max_v)
    return s.offload("fsdp+streamed-state", s.uniform("stream", False), (
        f"update_on=\"stream\": buffers include the ring of {training.stream_buffers} x "
        f"{training.stream_chunk_bytes / 2**20:g} MiB device buffers (opt.device_buffer_bytes())",
        f"{state_bytes} bytes per parameter each way over PCIe (master, m, v), {2 * state_bytes} through host "
        "memory, no host core; the gradient and the parameter stay on the GPU"))


@_planner(MIX)
def _placement_mix(s: _Setting) -> StrategyPlan:
    chosen = placement.choose_mix(s.plan_groups, s.costs, s.limits)
    mix_notes = [
        "per group: update_on=\"device\" (state on the GPU, 12 bytes per parameter, 16 with amsgrad), \"stream\" or "
        "\"host\", chosen for the smallest bound that fits (planning/placement.py); resident: the first layers, "
        "whose gradients come last in backward",
    ]
    if chosen is None:
        chosen = s.uniform("host", True)
        mix_notes.append("no mix of placements fits; shown: every group on the host with offload_gradients")
    mix_notes.extend(chosen.notes)
    return s.offload(MIX, chosen, mix_notes)


# FSDP2 CPU offload: fp32 shards on the host are copied up for every all-gather (forward and backward), the reduced
# gradient is cast to fp32 on the GPU and copied down (torch's foreach_reduce), torch AdamW runs on the host.
@_planner("fsdp+cpu-offload")
def _fsdp_cpu_offload(s: _Setting) -> StrategyPlan:
    shard, accum, amsgrad = s.shard, s.training.grad_accumulation, s.amsgrad
    node_shard = s.per_node * shard
    return s.strategy(
        "fsdp+cpu-offload",
        gpu=MemoryBill(activations=s.acts, buffers=s.fsdp_buffers, reserved=s.gpu_reserved),
        host=MemoryBill(parameters=4 * node_shard, gradients=4 * node_shard, exp_avg=4 * node_shard,
                        exp_avg_sq=4 * node_shard, max_exp_avg_sq=4 * node_shard if amsgrad else 0,
                        reserved=s.host_reserved),
        h2d=accum * 2 * 4 * shard, d2h=accum * 4 * shard,
        host_traffic=node_shard * (accum * 2 * 4 + 4 + (accum - 1) * 4 * 4 + s.update_bytes), gpu_traffic=0,
        gpus_used=s.world,
        notes=("as PyTorch arranges it: the fp32 shard is the master, gradients come down in fp32",
               "comparison only: PyTorch's own offload with torch AdamW, never recommended here"))


if list(_PLANNERS) != list(STRATEGIES):  # pragma: no cover - a strategy without its planner, or out of order
    raise ImportError(f"planner: the planners {list(_PLANNERS)} are not those of STRATEGIES {list(STRATEGIES)}")


def plan(model: Model, hardware: HardwareConfig = HardwareConfig(), training: TrainingConfig = TrainingConfig()) -> Plan:
    """Plan every strategy in STRATEGIES for ``model`` on ``hardware`` trained as ``training``."""
    setting = _Setting.of(model, hardware, training)
    strategies = tuple(planner(setting) for planner in _PLANNERS.values())
    recommendation, reason = _recommend(strategies, hardware.world_size)
    return Plan(
        model_name=model.name, num_parameters=setting.n, hardware=hardware, training=training, strategies=strategies,
        recommendation=recommendation, reason=reason, assumptions=_assumptions(model, hardware, training),
    )


def _assumptions(model: Model, hardware: HardwareConfig, training: TrainingConfig) -> tuple[str, ...]:
    """What every plan assumes, in words, and what this model's kind leaves out."""
    assumptions = [
        "activations: Korthikanti et al. 2022 (arXiv:2205.05198), "
        + ("full checkpointing: 2sbh per layer + one layer recomputed" if training.activation_checkpointing
           else "no recomputation: sbh(34 + 5as/h) per layer")
        + ("; attention scores not stored (flash attention)" if training.flash_attention else "")
        + "; + 4sbh + 4sbv outside the layers; 16-bit activations, no tensor/sequence parallelism",
        "step-time bound: max over links of bytes/bandwidth (perfect overlap, no compute); "
        "collectives over NVLink/network are not counted",
        "FSDP units: one per decoder layer, the embedding and the output projection; shards padded on dim 0",
        f"step time: 2 FLOPs per parameter and token forward, 4 backward (+2 recomputed under checkpointing) at "
        f"{training.model_flops_utilization:.0%} of {hardware.gpu_flops_per_s / 1e12:.0f} TFLOP/s; the host update at the "
        "host-memory bandwidth, one group at a time; 'overlapped' starts each group's update as its gradient "
        "arrives" + (", but with clipping not before the last group's norm (end of backward), so only the copies "
                     "are hidden" if training.clipping else "") + " (planning/overlap.py). OffloadAdamW overlaps "
        "with update_in_backward=True and freed gradients, on one device, under DDP and under FSDP2 (one FSDP unit at a time)",
    ]
    if isinstance(model, ParamCountModel):
        assumptions.append("--params gives no architecture: activations and FSDP gather buffers are not estimated (0)")
    if isinstance(model, ParamShapesModel):
        assumptions.append("parameters counted from the transformers model built on the meta device; its activations "
                           "are not estimated (0)")
    if isinstance(model, ModelConfig) and model.is_moe:
        assumptions.append(f"mixture of experts: all {model.num_experts} experts per MoE layer are trained parameters "
                           "(each rank holds all of them; no expert parallelism); activations as for a dense layer")
    return tuple(assumptions)


def _fmt_gb(x: float) -> str:
    return f"{x / GB:,.1f} GB"


def _recommend(strategies: Sequence[StrategyPlan], world: int) -> tuple[str | None, str]:
    """The fitting strategy with the smallest step-time bound; ties go to the larger GPU margin.

    Only strategies this project provides are candidates; comparisons are never recommended.
    """
    provided = [s for s in strategies if not s.comparison]
    candidates = [s for s in provided if s.fits and not (s.name == "single-gpu" and world > 1)]
    if not candidates:
        closest = min(provided, key=lambda s: max(-s.gpu_margin / s.gpu_capacity, -s.host_margin / s.host_capacity))
        short = []
        if closest.gpu_margin < 0:
            short.append(f"{_fmt_gb(-closest.gpu_margin)} per GPU")
        if closest.host_margin < 0:
            short.append(f"{_fmt_gb(-closest.host_margin)} of host memory per node")
        fitting_comparisons = [s.name for s in strategies if s.comparison and s.fits]
        also = (f"; of the comparisons, {', '.join(fitting_comparisons)} would fit (not provided by this project)"
                if fitting_comparisons else "")
        return None, (
            f"nothing fits; the closest is {closest.name}, short by {' and '.join(short)}: "
            "add GPUs or nodes, shorten sequences or micro-batches, or turn on activation checkpointing" + also
        )
    best_time = min(s.step_time_lower_bound_s for s in candidates)
    # within 5% of the best bound the difference is below what the bound can tell apart
    close = [s for s in candidates if s.step_time_lower_bound_s <= best_time * 1.05 + 1e-12]
    # a mix of placements is chosen only where it beats every other strategy that fits by more than that
    if len(close) > 1:
        close = [s for s in close if s.name != MIX]
    best = max(close, key=lambda s: s.gpu_margin)
    others = [s for s in candidates if s is not best]
    misfits = [s for s in provided if not s.fits]
    parts = [
        f"{best.name} fits ({_fmt_gb(best.gpu.total)} of {_fmt_gb(best.gpu_capacity)} per GPU, "
        f"{_fmt_gb(best.host.total)} of {_fmt_gb(best.host_capacity)} host memory per node) and has the smallest "
        f"step-time bound of the strategies that fit, {best.step_time_lower_bound_s:.3g} s, set by {best.bottleneck}"
    ]
    if others:
        runner = min(others, key=lambda s: s.step_time_lower_bound_s)
        parts.append(f"next: {runner.name} at {runner.step_time_lower_bound_s:.3g} s ({runner.bottleneck})")
    if misfits:
        parts.append("does not fit: " + ", ".join(
            f"{s.name} ({_fmt_gb(s.gpu.total)}/GPU)" if s.gpu_margin < 0 else f"{s.name} ({_fmt_gb(s.host.total)} host)"
            for s in misfits))
    return best.name, "; ".join(parts)
