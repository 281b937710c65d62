"""OffloadAdamW: torch.optim.AdamW with its state in host memory, in float32.

Contract (docs/contract.md):

* Same constructor, validation messages, defaults, parameter-group keys and
  ``state_dict`` layout as ``torch.optim.AdamW`` (PyTorch 2.8 to 2.13), except that a tensor
  listed twice in one group (torch: updated once per listing, deprecated) is refused by name.
* Per parameter tensor the state is ``step``, ``exp_avg``, ``exp_avg_sq`` (and
  ``max_exp_avg_sq``) and, unless the parameter is its own master, a float32
  ``master_param``, all in host memory (optim/state.py), or on the parameter's device for a
  group with ``update_on="device"`` (optim/placement.py, docs/placement.md). After every update a
  low-precision or device parameter receives the round-to-nearest copy of its master.
* A complex parameter is updated as its ``view_as_real`` (its state complex), as torch's loops update it.
* The update math is :mod:`offload_adamw.kernels`; every update runs through
  :mod:`offload_adamw.optim.update`, with or without the transfer pipeline.
  This class owns the groups, where state lives and the order of work: every ``step()`` is the one sequence
  of optim/step.py (check, clip, non-finite policy, pre-flight, updates) over a transport, the transfer
  pipeline's (accel/transport.py) or the plain one that reads ``p.grad`` where it lies; clipping and the
  non-finite decision are optim/policy.py's.
* ``load_state_dict`` is all or nothing and matches by name (optim/loading.py).
* The transfer pipeline (accel/pipeline.py) holds no optimizer and calls none: it is built by
  optim/bucket.py's ``pipeline_for``, handed a :class:`~offload_adamw.accel.pipeline.Wiring` of narrow
  callables over a weak reference to this optimizer, and hands out each bucket's work (accel/work.py),
  which optim/bucket.py does with ``update_group`` (host groups) or ``state_operands`` (streamed and
  resident groups); updates during backward go through optim/bucket.py's ``BackwardBuckets`` likewise.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._compile import _disable_dynamo
from torch.optim.optimizer import ParamsT

from offload_adamw.accel import ddp as _ddp
from offload_adamw.accel import streams
from offload_adamw.accel.amp import HostGradientHolder
from offload_adamw.accel.pipeline import GradientPipeline, PipelineConfig
from offload_adamw.contract import bills
from offload_adamw.contract.rules import (
    MASTER_KEY,
    NONFINITE_POLICIES,
    PLACEMENT_KEY,
    Unsupported,
    check_hyperparameter_ranges,
    check_placement,
)
from offload_adamw.distributed import dtensor as _distributed
from offload_adamw.distributed import node as _node
from offload_adamw.kernels.adamw import StepHyper
from offload_adamw.kernels.fused_device import StateOperands
from offload_adamw.optim import bucket as _bucket
from offload_adamw.optim import loading as _loading
from offload_adamw.optim import placement as _placement
from offload_adamw.optim import policy as _policy
from offload_adamw.optim import preflight as _preflight
from offload_adamw.optim import state as host_state
from offload_adamw.optim import step as _step
from offload_adamw.optim import update as _update
from offload_adamw.optim.clip_order import ClipOrder
from offload_adamw.optim.loading import StateDictMismatch

__all__ = ["OffloadAdamW", "StateDictMismatch"]


def _to_scalar(x: Any) -> Any:
    """As torch's ``_to_scalar``: a 1-element tensor becomes a 0-dim tensor (betas stay tensors, as in torch's groups)."""
    return x.squeeze() if isinstance(x, Tensor) and x.dim() != 0 else x


def _saved_group(group: dict[str, Any]) -> dict[str, Any]:
    """A group as ``state_dict()`` writes it: without the placement (where this process runs the update is not
    state), and ``fused=True`` where it says None. Here None runs torch's fused kernel; torch's load adopts the saved
    group, and to torch None means its default (the for-loop on the CPU), so that a run leaving for
    ``torch.optim.AdamW`` would go on with another kernel, ~1e-8 away. The saved group names the kernel the run used:
    ``fused=False`` is torch's single-tensor loop, which ``foreach=False`` names (torch's default on a GPU is foreach)."""
    saved = {k: v for k, v in group.items() if k != PLACEMENT_KEY}
    if "fused" in saved and saved["fused"] is None:
        saved["fused"] = True
    elif saved.get("fused") is False and "foreach" in saved:
        saved["foreach"] = False
    return saved


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW whose master weights and moments live in (pinned) host memory, in float32.

    Arguments are those of ``torch.optim.AdamW``. Options of torch's AdamW that
    concern how torch schedules the update on the parameter's device have this
    meaning here:

    * ``fused`` (None or True): the fused host kernel, bitwise equal to
      ``torch.optim.AdamW(fused=True)``. ``fused=False`` picks the readable
      per-tensor loop, bitwise equal to torch's ``foreach=False, fused=False``.
    * ``foreach``: accepted and ignored (the host kernel is not a foreach loop);
      ``foreach=True`` together with ``fused=True`` is refused as in torch.
    * ``capturable=True`` and ``differentiable=True`` are refused: the state is
      in host memory (no CUDA graph capture) and the step is not differentiable.

    Keyword-only options of this class:

    * ``pin_memory`` (default None: not pinned) places the host state in
      page-locked memory. The state is pinned only where it is asked for
      (``pin_memory=True``): nothing copies the state asynchronously (the transfer
      pipeline carries every transfer through its own exactly-sized pinned
      buffers; the plain step, e.g. FSDP2 with kept gradients, copies
      synchronously), and torch's pinned allocator rounds each tensor up to a
      power of two. ``pin_memory=True`` without an accelerator is refused here
      (optim/state.py, ``pins_state``).
    * ``nonfinite``: what a step does when a gradient holds inf or NaN.
      ``"propagate"`` (default, as torch.optim.AdamW) applies the update and the
      non-finite values spread into the state; ``"skip"`` skips the whole step
      for every tensor (no state changes, ``skipped_steps`` counts it), like
      GradScaler's found_inf; ``"raise"`` raises FloatingPointError naming every
      offending parameter, before any state changes. ``skip`` and ``raise`` cost
      one extra read of the gradients.
    * ``offload_gradients`` (default False): free each device gradient right
      after backward's hook has started its copy to host memory; accumulation
      over micro-batches then happens in host memory. ``p.grad`` is then a
      storage-less stand-in of the host gradient (accel/freed.py): torch's
      ``clip_grad_norm_``, ``GradScaler`` and ``model.zero_grad()`` act on the host
      gradient through it, anything else is refused; ``gradient(p)`` reads it.
      For a DTensor (FSDP2) parameter the stand-in is a DTensor over the host
      shard, so torch's clipping still reduces the norm across ranks. An optimizer dropped
      before its step gives each gradient back as a real tensor on the parameter's device.
    * ``transfer_pipeline`` (default: on when a parameter lives on an
      accelerator, or with ``offload_gradients``; for DTensor (FSDP2) parameters with kept gradients only
      when asked: FSDP2 calls the hooks of each shard after its reduce-scatter):
      gradients go to exactly-sized pinned host buffers during backward, the step
      runs bucket by bucket (``bucket_bytes`` of gradient each) and parameters
      return non-blocking (accel/pipeline.py). ``True`` with CPU parameters runs the
      same pipeline with the CPU as device. The state is not pinned unless
      ``pin_memory=True``: the pipeline's buffers carry the transfers.
    * ``compiled_kernel``: deprecated and without effect (accepted with a
      DeprecationWarning): the default host step is the single loop it named,
      compiled by numba without a C++ compiler (kernels/numba_loop.py).
    * ``max_grad_norm`` (default None): clip the gradients to this total 2-norm
      inside ``step``, before the update (like DeepSpeed's ``gradient_clipping``),
      with torch's ``clip_grad_norm_`` arithmetic over the gradients in the model's
      parameter order (``clip_order``, optim/clip_order.py), as
      ``clip_grad_norm_(model.parameters())``; ``last_grad_norm`` holds the norm before clipping. With
      GradScaler, unscale first (``scaler.unscale_(opt)``). With ``update_in_backward``
      the norms are taken in backward's hooks and the updates start when backward ends.
    * ``update_in_backward`` (default False; needs ``offload_gradients``): start each
      bucket's (FSDP2: each group's) host update on a worker thread during backward,
      from the second step on (accel/overlap.py). Every backward outside ``no_sync()``
      must be followed by ``step()``; loss scaling is refused. With ``max_grad_norm`` or a
      ``nonfinite`` policy the updates start when backward ends (norms and non-finite counts are
      taken on the device in backward's hooks); ``last_grad_norm`` is each step's total norm, clipping or not.
    * ``update_on`` (default ``"host"``; also a parameter-group key): where a group's update runs
      (docs/placement.md). ``"host"``: the state in host memory, the host kernel. ``"stream"``: the
      float32 master and moments stay in (page-locked) host memory and are streamed through a ring of
      device buffers, updated on the device by torch's fused kernel and streamed back; the gradient
      never leaves the device. ``"device"``: the state lives on the parameter's device, no transfer.
      Every placement is bitwise torch.optim.AdamW(fused=True) on float32 masters on the device where
      it runs. Streamed and resident groups need the transfer pipeline (on by default for them);
      ``offload_gradients`` frees the gradients of host groups only. ``state_dict()`` leaves the key
      out and a load keeps the optimizer's own: a resume may change placement.
    * ``stream_chunk_bytes`` (default 64 MiB, at least 1 MiB) and ``stream_buffers`` (2 or 3): the size
      and number of the ring's device buffers per device (``device_buffer_bytes()`` reports them).
    * ``host_numa_node`` (default None: the NUMA node of the parameters' GPU, from sysfs, on a host of two or
      more nodes): the NUMA node whose memory holds the host state and whose cores run the host update
      (``node.numa`` says which, and why; distributed/node.py). One node, or none known: as the OS places them.
    * ``host_threads`` (default None: this rank's share of its node, distributed/node.py): the worker
      threads of the host update, whatever ``OMP_NUM_THREADS`` says (torchrun and accelerate set it to 1
      in every rank). The default is the cores in this process's affinity set, divided among the ranks
      of this node when they share them; ``node`` says how it was found, ``host_threads`` what was
      chosen. The bits do not depend on it. Without a launcher's variable (``LOCAL_WORLD_SIZE``,
      Open MPI's, MPICH's, Slurm's) and with a multi-host process group, the constructor gathers the
      ranks' host names once (a collective): construct the optimizer on every rank.

    Wrappers: under DistributedDataParallel call ``opt.attach(ddp_model)`` once,
    before the first backward (the pipeline then receives the reduced gradients
    from DDP's communication hook).

    Copies: ``copy.deepcopy(opt)``, ``pickle`` and ``torch.save(opt)`` give, as for
    torch's AdamW, an optimizer over copies of the parameters with copies of the
    state and every option; a copy with the transfer pipeline builds its own from
    the same options (attach a DDP model to it again). With ``offload_gradients``
    copy at a step boundary (after ``step()`` and ``zero_grad()``): the gradients
    held in the pipeline's host buffers are not copied, and a copy is refused.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        pin_memory: bool | None = None,
        nonfinite: str = "propagate",
        offload_gradients: bool = False,
        transfer_pipeline: bool | None = None,
        bucket_bytes: int = 32 << 20,
        compiled_kernel: bool = False,
        max_grad_norm: float | None = None,
        update_in_backward: bool = False,
        update_on: str = "host",
        stream_chunk_bytes: int = 64 << 20,
        stream_buffers: int = 2,
        host_threads: int | None = None,
        host_numa_node: int | None = None,
    ) -> None:
        # The same checks, in the same order and words, as torch.optim.Adam.
        if isinstance(lr, Tensor):
            if foreach and not capturable:
                raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
        check_hyperparameter_ranges(lr, betas, eps, weight_decay)
        if not (
            (isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor))
        ):
            raise ValueError("betas must be either both floats or both Tensors")
        for index, beta in enumerate(betas):
            if isinstance(beta, Tensor):
                if not capturable and foreach:
                    raise ValueError(
                        f"betas[{index}] as a Tensor is not supported for capturable=False and foreach=True"
                    )
                if beta.numel() != 1:
                    raise ValueError(f"Tensor betas[{index}] must be 1-element")
        betas = tuple(map(_to_scalar, betas))
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        if capturable:
            raise Unsupported(
                "OffloadAdamW does not support capturable=True: its state lives in host memory, "
                "outside any CUDA graph"
            )
        if differentiable:
            raise Unsupported("OffloadAdamW does not support differentiable=True: its step runs under no_grad")

        PipelineConfig(stream_chunk_bytes=stream_chunk_bytes, stream_buffers=stream_buffers)  # refuses bad values now
        if host_threads is not None and not (
            isinstance(host_threads, int) and not isinstance(host_threads, bool) and 1 <= host_threads
        ):
            raise ValueError(f"host_threads must be a positive integer or None, got {host_threads!r}")
        if host_numa_node is not None and not (
            isinstance(host_numa_node, int) and not isinstance(host_numa_node, bool) and 0 <= host_numa_node
        ):
            raise ValueError(f"host_numa_node must be a NUMA node number or None, got {host_numa_node!r}")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and 0.0 < max_grad_norm):
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.last_grad_norm: Tensor | None = None
        self._clip_order = ClipOrder()
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._pin_memory = host_state.pins_state(pin_memory, accelerator=host_state.pinned_allocator_available())
        if compiled_kernel:
            warnings.warn(
                "OffloadAdamW(compiled_kernel=True) is deprecated and has no effect: the default host step "
                "is the single loop it named (compiled by numba, no C++ compiler needed)",
                DeprecationWarning,
                stacklevel=2,
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": True,
        }
        # Not in defaults, which stay torch's: add_param_group gives each group without one this placement.
        self._update_on = check_placement(update_on, "OffloadAdamW(update_on=...)")
        super().__init__(params, defaults)
        # DTensor (FSDP2) parameters: state_dict() shows their states as DTensors (distributed/dtensor.py).
        self.register_state_dict_post_hook(_distributed.wrap_state_dict_post_hook)
        first = next((_distributed.local_tensor(p) for g in self.param_groups for p in g["params"]), None)
        numa = _node.numa_placement(node=host_numa_node,
                                    pci_bus_id=None if first is None else streams.pci_bus_id(first.device))
        self.node = _node.node_share(numa=numa)
        self.host_threads = self.node.threads if host_threads is None else host_threads
        self._pipeline: GradientPipeline | None = None
        # Kept for a copy or an unpickled optimizer, which builds its own pipeline from them (__setstate__).
        self._pipeline_options: dict[str, Any] = dict(
            offload_gradients=offload_gradients, transfer_pipeline=transfer_pipeline, bucket_bytes=bucket_bytes,
            pin_memory=pin_memory, update_in_backward=update_in_backward, stream_chunk_bytes=stream_chunk_bytes,
            stream_buffers=stream_buffers,
        )
        self._setup_pipeline(**self._pipeline_options)

    # --------------------------------------------------------- copy and pickle

    #: attributes of this class that a copy or a pickle carries, beside torch's defaults, state and groups
    _COPIED_ATTRIBUTES = ("max_grad_norm", "last_grad_norm", "nonfinite", "skipped_steps", "_pin_memory", "_pipeline_options",
                          "_update_on", "node", "host_threads")

    def __getstate__(self) -> dict[str, Any]:
        """torch's (defaults, state, param_groups) and this class's options; the transfer pipeline is not
        pickled (hooks, streams, threads): the copy builds its own from the same options.

        Refused where a copy would lose gradients: between a backward and ``step()`` with device
        gradients freed (they live in the pipeline's host buffers) or with updates already run in backward.
        """
        pipeline = self.__dict__.get("_pipeline")
        if pipeline is not None:
            pipeline.refuse_mid_step("be copied or pickled")
            if pipeline.offload_gradients and any(p.grad is not None for g in self.param_groups for p in g["params"]):
                raise RuntimeError(
                    "the optimizer cannot be copied or pickled while its gradients are held in the transfer "
                    "pipeline's host buffers (offload_gradients=True, between backward and zero_grad()): a copy "
                    "would not take them. Copy it at a step boundary, after step() and zero_grad()"
                )
        state = super().__getstate__()
        state["offload_adamw"] = {name: self.__dict__[name] for name in self._COPIED_ATTRIBUTES if name in self.__dict__}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        options = dict(state.pop("offload_adamw", {}))
        super().__setstate__(state)
        self.max_grad_norm = options.get("max_grad_norm")
        self.last_grad_norm = options.get("last_grad_norm")
        self.nonfinite = options.get("nonfinite", "propagate")
        self.skipped_steps = options.get("skipped_steps", 0)
        self._clip_order = ClipOrder()  # the copy's parameters are others: their model is searched for again
        self._update_on = options.get("_update_on", "host")
        # An optimizer pickled before these existed: this process's share, found without a collective.
        self.node = options.get("node") or _node.node_share(gather=False)
        self.host_threads = options.get("host_threads") or self.node.threads
        self._pin_memory = bool(options.get("_pin_memory", False))
        self._pipeline_options = dict(options.get("_pipeline_options", {"transfer_pipeline": False,
                                                                           "offload_gradients": False,
                                                                           "bucket_bytes": 32 << 20,
                                                                           "pin_memory": None}))
        self.register_state_dict_post_hook(_distributed.wrap_state_dict_post_hook)  # torch keeps no hooks
        self._pipeline = None
        pin_memory = self._pin_memory
        self._setup_pipeline(**self._pipeline_options)
        self._pin_memory = pin_memory

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        pipeline = getattr(self, "_pipeline", None)  # None while torch's constructor adds the first groups
        if pipeline is not None:
            pipeline.refuse_mid_step("add a parameter group")
        with warnings.catch_warnings():
            # A tensor listed twice is refused below; torch's warning that it is deprecated would only add noise.
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate parameters")
            super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault(PLACEMENT_KEY, getattr(self, "_update_on", "host"))
        first_at: dict[int, int] = {}
        for index, p in enumerate(group["params"]):
            if id(p) in first_at:
                # torch updates such a tensor once per listing (deprecated: it will refuse it), a bucketed step would
                # update it once: the same training everywhere only by refusing it.
                described = self._describe(group, first_at[id(p)])
                self.param_groups.pop()
                raise ValueError(
                    f"{described} is listed twice in param_groups[{len(self.param_groups)}] (at positions "
                    f"{first_at[id(p)]} and {index}): torch.optim.AdamW would update it once per listing, which torch "
                    "deprecates; list each tensor once (named_parameters() and parameters() do)"
                )
            first_at[id(p)] = index
        for index, p in enumerate(group["params"]):
            if p.dtype == torch.complex32:
                raise Unsupported(
                    f"OffloadAdamW does not support complex32 parameters: {self._describe(group, index)} "
                    "is complex32; use complex64"
                )
            if not (p.is_floating_point() or p.is_complex()):
                raise Unsupported(f"OffloadAdamW needs floating-point parameters: {self._describe(group, index)} is {p.dtype}")
        try:
            placement = _placement.group_placement(group, len(self.param_groups) - 1)
            if placement != "host" and pipeline is None and hasattr(self, "_pipeline_options"):
                raise ValueError(self.needs_pipeline(len(self.param_groups) - 1, placement))
        except ValueError:
            self.param_groups.pop()  # a refused group is not added
            raise
        if pipeline is not None:
            pipeline.refresh()  # hooks for the new parameters before the next backward, whose clipping must count them

    @staticmethod
    def needs_pipeline(group_index: int, placement: str) -> str:
        """Why a group placed off the host cannot be updated by an optimizer without the transfer pipeline."""
        return (f"param_groups[{group_index}] has {PLACEMENT_KEY}={placement!r}, whose update runs on the device through "
                "the transfer pipeline, but this optimizer has none (transfer_pipeline=False, or created with host "
                "groups only): create it with transfer_pipeline=True, or keep the group on update_on='host'")

    def _describe(self, group: dict[str, Any], index: int) -> str:
        """The parameter's name where names were given, else its place and shape."""
        names = group.get("param_names")
        if names is not None and index < len(names):
            return f"parameter {names[index]!r}"
        try:
            group_index = next(i for i, g in enumerate(self.param_groups) if g is group)
        except StopIteration:
            group_index = len(self.param_groups)
        shape = tuple(group["params"][index].shape)
        return f"parameter {index} of param_groups[{group_index}] (shape {shape})"

    def describe_param(self, group_index: int, index: int) -> str:
        """``group_index``/``index``'s parameter as messages name it: its name where names were given."""
        return self._describe(self.param_groups[group_index], index)

    # ------------------------------------------------------------------- state

    def master_param(self, p: Tensor) -> Tensor | None:
        """The master the optimizer keeps for ``p``: the tensor the next update writes.

        That is the stored float32 (float64) master, or ``p`` itself when ``p`` is its own master
        (a float32 host parameter); None while a parameter that needs a master has none yet (its
        master is created at its first update). :meth:`master_value` always returns a tensor. The
        stored master is returned as it is: edits of a low-precision host parameter since the last
        update (docs/contract.md#edits-between-steps) reach it at the next update, or at
        :meth:`master_value` and ``state_dict()``.
        """
        local = _distributed.local_tensor(p)
        if host_state.is_own_master(local):
            return p
        state = self.state.get(p)
        return state.get(MASTER_KEY) if state else None

    def master_value(self, p: Tensor) -> Tensor:
        """The float32 (float64) value of ``p``'s master: :meth:`master_param`, or before ``p``'s
        first update the value its master will start from (a new host copy of ``p``). A low-precision
        host parameter's edits since the last update are taken into its master first (what the next
        update would do), so that a checkpoint of the master holds the edited parameter."""
        state = self.state.get(p)
        if state:
            host_state.follow_parameter_edits_(state, _distributed.local_tensor(p))
        master = self.master_param(p)
        if master is not None:
            return master
        local = _distributed.local_tensor(p)
        return local.detach().to("cpu", host_state.state_dtype(local))

    def host_state_bytes(self) -> int:
        """Bytes of optimizer state allocated in host memory (moments, masters, step counts), measured."""
        return host_state.state_tensor_bytes(self, host_only=True)

    # ------------------------------------------------------- transfer pipeline

    def _setup_pipeline(self, offload_gradients: bool, transfer_pipeline: bool | None, bucket_bytes: int, pin_memory: bool | None,
                        update_in_backward: bool = False, stream_chunk_bytes: int = 64 << 20,
                        stream_buffers: int = 2) -> None:
        """The device path (accel/pipeline.py): hooks, exactly-sized pinned buffers, streams, bucketed step."""
        params = [p for g in self.param_groups for p in g["params"]]
        sharded = any(_distributed.is_dtensor(p) for p in params)
        if update_in_backward and transfer_pipeline is False:
            raise ValueError("update_in_backward=True needs the transfer pipeline (transfer_pipeline=False was given)")
        if update_in_backward and transfer_pipeline is None:
            transfer_pipeline = True
        placements = [_placement.group_placement(g, gi) for gi, g in enumerate(self.param_groups)]
        on_device = next((gi for gi, name in enumerate(placements) if name != "host"), None)
        if transfer_pipeline is None:
            # Meta parameters hold no data and say nothing about where they will live: they do not switch it on.
            transfer_pipeline = offload_gradients or on_device is not None or (
                any(p.device.type not in ("cpu", "meta") for p in params) and not sharded
            )
        if on_device is not None and not transfer_pipeline:
            raise ValueError(self.needs_pipeline(on_device, placements[on_device]))
        if offload_gradients and not transfer_pipeline:
            raise ValueError("offload_gradients=True needs the transfer pipeline (transfer_pipeline=False was given)")
        if not transfer_pipeline:
            return
        if pin_memory is None:
            self._pin_memory = False  # the pipeline's own exact pinned buffers carry every transfer
        self._pipeline = _bucket.pipeline_for(self, PipelineConfig(
            offload_gradients=offload_gradients, bucket_bytes=bucket_bytes, update_in_backward=update_in_backward,
            stream_chunk_bytes=stream_chunk_bytes, stream_buffers=stream_buffers,
        ))
        # GradScaler hands grad_scale / found_inf to step() instead of unscaling p.grad itself.
        self._step_supports_amp_scaling = True

    @property
    def offload_gradients(self) -> bool:
        """Whether device gradients are freed after their copy to the host (the host buffer is then the gradient)."""
        return self._pipeline is not None and self._pipeline.offload_gradients

    @property
    def transfer_pipeline(self) -> GradientPipeline | None:
        """The transfer pipeline, or None when the plain host step runs."""
        return self._pipeline

    @property
    def update_in_backward(self) -> bool:
        """Whether host updates start during backward (the pipeline's worker thread)."""
        return self._pipeline is not None and self._pipeline.config.update_in_backward

    def no_sync(self) -> Any:
        """A context for micro-batches that only accumulate (with update_in_backward: they start no update)."""
        if self._pipeline is None:
            import contextlib

            return contextlib.nullcontext()
        return self._pipeline.no_sync()

    def last_step_timeline(self) -> Any:
        """When each bucket's gradient, copies and host update happened in the latest step (accel/timeline.py).

        Its ``overlap`` is the fraction of host-update time that ran before backward ended. None
        without the transfer pipeline or before the first step.
        """
        return None if self._pipeline is None else self._pipeline.last_step_timeline()

    def gradient(self, p: Tensor) -> Tensor | None:
        """The current gradient of ``p`` wherever it lives (the host buffer when device gradients are freed)."""
        return p.grad if self._pipeline is None else self._pipeline.gradient(p)

    def gradient_tensors(self) -> list[Tensor]:
        """Every current gradient as the truth holds it (host buffers when device gradients are freed)."""
        if self._pipeline is not None:
            return self._pipeline.gradient_tensors()
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    def host_gradient_holder(self) -> HostGradientHolder | None:
        """Where GradScaler must unscale: the pipeline when device gradients are freed, else None (``p.grad``)."""
        if self.update_in_backward:
            raise RuntimeError(
                "update_in_backward=True cannot be combined with loss scaling: the updates run during backward, "
                "before GradScaler knows whether to skip the step; use bf16, or update_in_backward=False"
            )
        return self._pipeline if self.offload_gradients else None

    def pinned_bytes(self) -> int:
        """Page-locked host bytes held for transfers (the pipeline's exactly-sized buffers, plus pinned state)."""
        total = 0 if self._pipeline is None else self._pipeline.slots.pinned_bytes()
        for state in self.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and value.device.type == "cpu" and value.is_pinned():
                    total += value.numel() * value.element_size()
        return total

    def host_buffer_bytes(self) -> dict[str, int]:
        """Host bytes of the transfer pipeline's buffers by purpose (gradients, accumulation, parameter staging),
        exactly as allocated; empty without the pipeline. Optimizer state is :meth:`host_state_bytes`."""
        return {} if self._pipeline is None else self._pipeline.slots.host_buffer_bytes()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's zero_grad, for device gradients and for gradients held in host memory."""
        if self._pipeline is not None:
            self._pipeline.zero_grad(set_to_none)
        super().zero_grad(set_to_none)

    def attach(self, model: torch.nn.Module) -> None:
        """Attach a DistributedDataParallel model (also one compiled by torch.compile), once, before the first backward.

        With the transfer pipeline DDP's reduced gradients reach the host through a DDP communication
        hook (accel/ddp.py). Without the pipeline the step reads ``p.grad``, which DDP has reduced:
        nothing to do.
        """
        ddp = _ddp.unwrap(model)
        if not _ddp.is_ddp(ddp):
            raise TypeError(f"opt.attach takes a DistributedDataParallel model, got {type(model).__name__}")
        if self._pipeline is not None:
            self._pipeline.attach_ddp(ddp)

    def clip_order(self, model: torch.nn.Module) -> None:
        """Reduce the gradient norms of ``max_grad_norm=`` in ``model.parameters()``' order, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does (optim/clip_order.py: without this call the
        model is searched for)."""
        self._clip_order.use(model)

    def clip_parameters(self) -> list[Tensor]:
        """This optimizer's parameters in the order clipping reduces their norms: the model's (optim/clip_order.py)."""
        return self._clip_order.of([p for g in self.param_groups for p in g["params"]])

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False, foreach: bool | None = None
    ) -> Tensor:
        """torch.nn.utils.clip_grad_norm_ over this optimizer's gradients, wherever they live (optim/policy.py)."""
        if self.update_in_backward:
            raise RuntimeError(
                "clip_grad_norm_ cannot clip with update_in_backward=True: the updates already ran during backward; "
                "use update_in_backward=False to clip"
            )
        return _policy.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach)

    # ------------------------------- the update path (optim/bucket.py, optim/step.py)

    def kernel_impl(self, group: dict[str, Any]) -> str:
        """The kernel that updates ``group``: "for_loop" with fused=False, else "blocked"."""
        return _update.kernel_impl(group)

    def check_gradient(self, group_index: int, index: int, grad: Tensor) -> None:
        """Refuse, naming the parameter, a gradient no update may consume (optim/update.py)."""
        group = self.param_groups[group_index]
        p = group["params"][index]
        local = _distributed.local_tensor(p)
        _update.check_gradient(
            lambda: self._describe(group, index), local, _distributed.local_grad(grad, p), self.state.get(p, {})
        )

    def skip_for_nonfinite(self, gradients: list[tuple[int, int, Tensor]], groups: Sequence[Any] = ()) -> bool:
        """The non-finite policy over this step's gradients: True means skip (counted), raises under "raise"."""
        named = [
            (lambda gi=gi, i=i: self.describe_param(gi, i), _distributed.local_tensor(g)) for gi, i, g in gradients
        ]
        params = [self.param_groups[gi]["params"][i] for gi, i, _ in gradients]
        skip = _policy.nonfinite_decision(self.nonfinite, named, params, groups)
        if skip:
            self.skipped_steps += 1
        return skip

    def preflight(self, fresh: list[tuple[int, int]]) -> None:
        """Fail early, with the figures, when the state about to be created cannot fit where it goes.

        The state of a host or streamed group goes to host memory (the host pre-flight), that of a resident
        group (``update_on="device"``) to its device (the device pre-flight, optim/placement.py); a state
        whose group changed placement since is moved to its new home, checked likewise. Then the state of
        every parameter in ``fresh`` is created, all or none, before any group is updated: a step whose
        allocation fails raises MemoryError and changes nothing.
        """
        # Every step asks this of every parameter: one pass, a host group's one home computed once (placement.py's
        # shared_home), the homes kept only where a state must be created or moved.
        homes: dict[tuple[int, int], tuple[torch.device, host_state.Pin]] = {}
        moves: list[tuple[int, int]] = []
        wanted = set(fresh)
        for gi, g in enumerate(self.param_groups):
            params = g["params"]
            if not params:
                continue
            shared = _placement.shared_home(_placement.group_placement(g, gi), pin_default=self._pin_memory)
            for i, p in enumerate(params):
                local = _distributed.local_tensor(p)
                home = shared if shared is not None else self._home(gi, local)
                state = self.state.get(p)
                if state and _placement.misplaced(state, local, *home):
                    moves.append((gi, i))
                    homes[(gi, i)] = home
                elif (gi, i) in wanted:
                    homes[(gi, i)] = home
        if not fresh and not moves:
            return
        host_fresh = [(gi, i) for gi, i in fresh if homes[(gi, i)][0].type == "cpu"]
        if host_fresh:
            _preflight.check_host_memory([(self.param_groups[gi], i) for gi, i in host_fresh],
                                         pin_memory=any(homes[w][1] is True for w in host_fresh),
                                         ranks=(self.node.ranks, self.node.ranks_source))  # exactly sized: no rounding
        device_bytes: dict[torch.device, int] = {}
        for gi, i in fresh:
            if homes[(gi, i)][0].type != "cpu":
                local = _distributed.local_tensor(self.param_groups[gi]["params"][i])
                bill = bills.tensor_state_bytes(local.numel(), host_state.dtype_name(local.dtype), on_host=False,
                                                amsgrad=self.param_groups[gi]["amsgrad"])
                device_bytes[homes[(gi, i)][0]] = device_bytes.get(homes[(gi, i)][0], 0) + bill.moments + bill.master
        host_bytes = 0
        for gi, i in moves:
            p = self.param_groups[gi]["params"][i]
            nbytes = _placement.moved_bytes(self.state[p], _distributed.local_tensor(p))
            device = homes[(gi, i)][0]
            if device.type == "cpu":
                host_bytes += nbytes
            else:
                device_bytes[device] = device_bytes.get(device, 0) + nbytes
        for device, nbytes in device_bytes.items():
            _placement.check_device_memory(device, nbytes, "optimizer state of update_on='device' groups")
        if host_bytes:
            self.check_host_buffers(host_bytes, "optimizer state moved back to host memory")
        for gi, i in moves:
            p = self.param_groups[gi]["params"][i]
            _placement.place_state_(self.state[p], _distributed.local_tensor(p), *homes[(gi, i)])
        if fresh:
            self._allocate_state(fresh, homes)

    def _home(self, group_index: int, local: Tensor) -> tuple[torch.device, host_state.Pin]:
        """(device, pinned) where the state of ``local`` (a parameter of group ``group_index``) lives."""
        placement = _placement.group_placement(self.param_groups[group_index], group_index)
        locker = None if self._pipeline is None else self._pipeline.engine.page_locker(local.device)
        return _placement.home_of(placement, local, pin_default=self._pin_memory, locker=locker)

    def _allocate_state(self, fresh: list[tuple[int, int]],
                        homes: dict[tuple[int, int], tuple[torch.device, host_state.Pin]]) -> None:
        created: dict[Tensor, dict[str, Tensor]] = {}
        for gi, i in fresh:
            group = self.param_groups[gi]
            p = group["params"][i]
            device, pin = homes[(gi, i)]
            try:
                with _node.allocating_on(self.node.numa if device.type == "cpu" else None) as made:
                    created[p] = _placement.new_state_at(_distributed.local_tensor(p), amsgrad=group["amsgrad"],
                                                         device=device, pin=pin)
                    made.extend(t for t in created[p].values() if isinstance(t, Tensor))
            except (RuntimeError, MemoryError) as exc:
                created.clear()  # what was allocated so far goes back
                if not isinstance(exc, MemoryError) and "allocate" not in str(exc) and "out of memory" not in str(exc):
                    raise
                where = "host" if device.type == "cpu" else str(device)
                raise MemoryError(
                    f"OffloadAdamW could not allocate the {where} state of {self.describe_param(gi, i)} "
                    f"({type(exc).__name__}: {exc}); no state or parameter was changed. Free host memory, raise the "
                    "address-space limit (ulimit -v) or shard the optimizer over more processes."
                ) from exc
        for p, state in created.items():
            self.state[p].update(state)

    def state_operands(self, group_index: int, params: list[Tensor]) -> tuple[StepHyper, list[StateOperands]]:
        """The hyperparameters of group ``group_index`` and each parameter's state as the device-side update of a
        streamed or resident group takes it (optim/placement.py); the pre-flight created the state."""
        group = self.param_groups[group_index]
        hp = _update.step_hyper(group)
        if isinstance(group["lr"], Tensor) and group["lr"].device.type != "cpu":
            hp = dataclasses.replace(hp, lr=group["lr"])  # torch's fused AdamW reads a device lr on its device
        operands = []
        for p in params:
            local = _distributed.local_tensor(p)
            operands.append(_placement.state_operands(group, local, self.state[p], pin=self._home(group_index, local)[1]))
        return hp, operands

    def check_device_buffers(self, nbytes: int, device: torch.device, label: str) -> None:
        """Fail early, with the figures, when the pipeline's device buffers (``label``) cannot fit on ``device``
        (the CPU as device: in host memory)."""
        if device.type == "cuda":
            _placement.check_device_memory(device, nbytes, f"{label} buffers")
        else:
            self.check_host_buffers(nbytes, label)

    def device_buffer_bytes(self) -> int:
        """Device bytes this optimizer holds, as allocated: the ring buffers of streamed groups (and the widening buffer
        of resident ones) and the state of ``update_on="device"`` groups (its moments and masters; the step counts stay
        in host memory). On the CPU as device these bytes are host memory (``host_state_bytes`` counts the state too)."""
        total = 0 if self._pipeline is None else self._pipeline.placements.device_buffer_bytes()
        for gi, group in enumerate(self.param_groups):
            if _placement.group_placement(group, gi) == "device":
                for p in group["params"]:
                    total += sum(v.numel() * v.element_size() for k, v in self.state.get(p, {}).items()
                                 if k != "step" and isinstance(v, Tensor))
        return total

    def check_host_buffers(self, nbytes: int, label: str) -> None:
        """Fail early, with the figures, when the pipeline's host buffers (``label``) cannot fit in host memory."""
        if os.environ.get(_preflight.ENV_SWITCH, "1").strip().lower() in ("0", "off", "false", "no"):
            return
        memory = _preflight.host_memory(ranks=(self.node.ranks, self.node.ranks_source))
        if memory.sources and nbytes > memory.available:
            where = ", ".join(f"{name}: {value:,} bytes" for name, value in memory.sources.items())
            raise MemoryError(
                f"OffloadAdamW's transfer pipeline would allocate {nbytes:,} bytes of host {label} buffers but only "
                f"{memory.available:,} bytes of host memory are available ({where}). Nothing was allocated. "
                "Shard the model over more processes, or use transfer_pipeline=False"
            )

    def update_group(
        self, group_index: int, updates: list[tuple[Tensor, Tensor, Tensor | None]], grad_scale: Tensor | None = None,
        current: Sequence[bool] | None = None,
    ) -> None:
        """One update of each (parameter, host gradient, staging) in group ``group_index``.

        ``staging`` is a host tensor that receives round(master) for a parameter that lives on a
        device, or None; a low-precision host parameter receives round(master) itself, and a
        parameter that is its own master is updated in place. A low-precision host parameter's
        edits since the last update are taken over first (docs/contract.md#edits-between-steps);
        ``current[k]`` True says that update k's staging buffer holds its device parameter's
        current value, whose edits are taken over likewise.
        """
        group = self.param_groups[group_index]
        work = []
        state = self.state
        for k, (p, grad, given_staging) in enumerate(updates):
            local = _distributed.local_tensor(p)
            staging = given_staging
            is_current = current is not None and bool(current[k]) and staging is not None
            if staging is None and not host_state.is_own_master(local) and host_state.on_host(local):
                staging, is_current = local.data, True
            work.append(_update.TensorUpdate(local, state[p], grad, staging, is_current))
        _update.update_group(
            group,
            work,
            impl=self.kernel_impl(group),
            pin_memory=self._pin_memory,
            grad_scale=grad_scale,
            threads=self.host_threads,
            cpus=None if self.node.numa is None else self.node.numa.cpus,
        )

    # -------------------------------------------------------------------- step

    # torch.compile(opt.step) runs the step eager: host state, pinned buffers and streams are no graph's business.
    @_disable_dynamo  # imports torch._dynamo at the first step, not at import (torch's optimizers do the same)
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW update of every parameter that has a gradient (docs/contract.md#what-each-input-does)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if _distributed.inside_dcp_state_init():
            # DCP's get/set_optimizer_state_dict call step() with zero grads and lr 0 only to allocate state: not an update.
            self._create_missing_state()
            return loss
        # One sequence for both paths (optim/step.py): the pipeline's transport, or p.grad where it lies.
        transport = self._pipeline.transport if self._pipeline is not None else _step.PlainTransport(self)
        _step.run(self, transport, getattr(self, "grad_scale", None), getattr(self, "found_inf", None),
                  hasattr(self, "found_inf"))
        return loss

    def _create_missing_state(self) -> None:
        """The state of every parameter with a gradient and none yet; preflight() checks and creates it."""
        self.preflight(
            [
                (gi, i)
                for gi, g in enumerate(self.param_groups)
                for i, p in enumerate(g["params"])
                if p.grad is not None and not self.state.get(p)
            ]
        )

    # -------------------------------------------------------------- state_dict

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict; refused between a backward that already updated parameters and step().

        Its state tensors are the optimizer's own (as torch's: no copy of the state is made), but the
        per-parameter dicts holding them are the state_dict's: replacing an entry there changes the
        state_dict only, so that a refused ``load_state_dict`` of it leaves the optimizer as it was.
        """
        pipeline = getattr(self, "_pipeline", None)  # a subclass may skip this class's constructor
        if pipeline is not None:
            pipeline.refuse_mid_step("save its state")
        for p, state in self.state.items():  # the saved masters hold the parameters' edits since the last update
            if isinstance(p, Tensor):
                host_state.follow_parameter_edits_(state, _distributed.local_tensor(p))
        out = super().state_dict()
        # torch packs the optimizer's own per-parameter dicts: an entry replaced in the returned
        # state_dict would land in the live state, before any load could check it.
        if isinstance(out, dict) and isinstance(out.get("state"), dict):
            out = dict(out)
            out["state"] = {k: dict(v) if isinstance(v, dict) else v for k, v in out["state"].items()}
        if isinstance(out, dict) and isinstance(out.get("param_groups"), list):
            # Where this process runs a group's update is not state: the saved state is the same whatever the placement.
            out["param_groups"] = [_saved_group(g) if isinstance(g, dict) else g for g in out["param_groups"]]
        return out

    def _place_loaded(self, groups: list[dict[str, Any]], states: dict[Tensor, dict[str, Any]]) -> None:
        """Loaded states go where their group's placement (this optimizer's own) keeps them, before the commit."""
        device_bytes: dict[torch.device, int] = {}
        homes = {}
        for gi, group in enumerate(groups):
            for p in group["params"]:
                local = _distributed.local_tensor(p)
                if p in states and _placement.group_placement(group, gi) == "device" and local.device.type == "cuda":
                    homes[p] = local.device
                    device_bytes[local.device] = device_bytes.get(local.device, 0) + _placement.moved_bytes(states[p], local)
        for device, nbytes in device_bytes.items():
            _placement.check_device_memory(device, nbytes, "loaded optimizer state of update_on='device' groups")
        for p, device in homes.items():
            _placement.place_state_(states[p], _distributed.local_tensor(p), device, False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of OffloadAdamW or torch.optim.AdamW, all or nothing (optim/loading.py).

        Saved states are matched to parameters by name when both sides carry
        ``param_names``, else by position. Every mismatch is collected into one
        :class:`StateDictMismatch`, and then nothing is changed. A saved master is
        written back to its parameter (rounded to the parameter's dtype), so that
        the model and the optimizer agree after a resume.
        """
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.schedule.before_load()  # also the way back from a backward that raised after updates ran
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        with _node.allocating_on(self.node.numa) as made:
            new_groups, new_state = _loading.prepare_load(self, state_dict, pin=self._pin_memory)
            made.extend(t for state in new_state.values() for t in state.values()
                        if isinstance(t, Tensor) and t.device.type == "cpu")
        self._place_loaded(new_groups, new_state)
        # Commit: nothing above touched the optimizer or the parameters.
        self.param_groups = new_groups
        self.state = new_state
        _loading.write_masters_back(self.state)
        if pipeline is not None:
            pipeline.schedule.loaded()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
