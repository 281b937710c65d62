"""OffloadAdamW: torch.optim.AdamW with its state in host memory, in float32.

Contract:

* Same constructor, validation messages, defaults, parameter-group keys and
  ``state_dict`` layout as ``torch.optim.AdamW`` (PyTorch 2.8 to 2.13).
* Per parameter tensor the state is ``step`` (a float32 0-dim tensor, an exact
  count), ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq``), in host
  memory (pinned when CUDA is available), float32 whatever the parameter's
  dtype (float64 for float64 parameters). A parameter that is not a float32 (or
  float64) tensor in host memory gets a ``master_param`` in host memory: the
  source of truth, of which the parameter receives the round-to-nearest copy
  after every update. A float32 host parameter is its own master.
* The update math is :mod:`offload_adamw.kernel`; this class owns the groups,
  where state lives, and the order of work, nothing of the arithmetic.
* ``load_state_dict`` matches saved states to parameters by name when both
  sides carry ``param_names`` (else by position, as torch does), checks every
  shape, collects every mismatch into one error that names each parameter, and
  changes nothing unless the whole load succeeds. Loaded states stay float32 in
  host memory even for bf16 parameters (torch's own load would cast them down).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from . import distributed as _distributed
from . import kernel
from . import offload as _offload
from . import preflight as _preflight

__all__ = ["OffloadAdamW", "StateDictMismatch"]

#: keys of torch.optim.AdamW's parameter groups, in torch's order.
TORCH_GROUP_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
MASTER_KEY = "master_param"
NONFINITE_POLICIES = ("propagate", "skip", "raise")


class StateDictMismatch(ValueError):
    """A state_dict that does not fit this optimizer; ``problems`` lists every culprit."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n  - ".join(self.problems)
        super().__init__(f"cannot load optimizer state_dict ({len(self.problems)} problem(s)); nothing was changed:\n  - {lines}")


def _to_scalar(x: Any) -> Any:
    return x.item() if isinstance(x, Tensor) and x.numel() == 1 else x


def _state_dtype(param: Tensor) -> torch.dtype:
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _is_own_master(param: Tensor) -> bool:
    """A float32/float64 parameter in host memory needs no separate master copy."""
    return param.device.type == "cpu" and param.dtype in (torch.float32, torch.float64)


def check_hyperparameter_ranges(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """torch.optim.Adam's range checks, in its order and words; written ``not lo <= x`` so NaN fails too."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


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

    * ``pin_memory`` (default: whether CUDA is available) places the host state
      in page-locked memory so that transfers can run asynchronously.
    * ``nonfinite``: what a step does when a gradient holds inf or NaN.
      ``"propagate"`` (default, as torch.optim.AdamW) applies the update and the
      non-finite values spread into the state; ``"skip"`` skips the whole step
      for every tensor (no state changes, ``skipped_steps`` counts it), like
      GradScaler's found_inf; ``"raise"`` raises FloatingPointError naming every
      offending parameter, before any state changes. ``skip`` and ``raise`` cost
      one extra read of the gradients.
    * ``offload_gradients`` (default False): free each device gradient right
      after backward's hook has started its copy to host memory; accumulation
      over micro-batches then happens in host memory. ``p.grad`` stays None: use
      ``gradient(p)``, ``clip_grad_norm_`` and :class:`OffloadGradScaler`.
    * ``transfer_pipeline`` (default: on when a parameter lives on an
      accelerator, or with ``offload_gradients``; never for DTensor parameters):
      gradients go to exactly-sized pinned host buffers during backward, the step
      runs bucket by bucket (``bucket_bytes`` of gradient each) and parameters
      return non-blocking (offload.py). ``True`` with CPU parameters runs the
      same pipeline with the CPU as device. With the pipeline the state is not
      pinned unless ``pin_memory=True``: the pipeline's buffers carry the transfers.
    * ``compiled_kernel`` (default False): update large mixed-precision tensors
      (bf16/fp16 parameters or gradients, float32 masters) in one loop compiled by
      torch.compile (kernel_compiled.py), 1.1 to 1.5x faster than the default
      blocked kernel here (the benchmark in the README). The same bits: each
      compiled variant is checked against torch's fused op before its first use.
      Needs a C++ compiler; the first step compiles (a few seconds per variant,
      cached on disk by torch); where anything fails the default kernel runs,
      after one warning.
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
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        pin_memory: Optional[bool] = None,
        nonfinite: str = "propagate",
        offload_gradients: bool = False,
        transfer_pipeline: Optional[bool] = None,
        bucket_bytes: int = 32 << 20,
        compiled_kernel: bool = False,
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
            raise ValueError(
                "OffloadAdamW does not support capturable=True: its state lives in host memory, "
                "outside any CUDA graph"
            )
        if differentiable:
            raise ValueError("OffloadAdamW does not support differentiable=True: its step runs under no_grad")

        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.compiled_kernel = bool(compiled_kernel)
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
        super().__init__(params, defaults)
        # DTensor (FSDP2) parameters: state_dict() shows their states as DTensors (distributed.py).
        self.register_state_dict_post_hook(_distributed.wrap_state_dict_post_hook)
        self._setup_pipeline(offload_gradients, transfer_pipeline, bucket_bytes, pin_memory)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for index, p in enumerate(group["params"]):
            if torch.is_complex(p):
                raise ValueError(
                    f"OffloadAdamW does not support complex parameters: {self._describe(group, index)} "
                    f"is {p.dtype}; optimize torch.view_as_real(param) instead"
                )
            if not p.is_floating_point():
                raise ValueError(f"OffloadAdamW needs floating-point parameters: {self._describe(group, index)} is {p.dtype}")

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

    # ------------------------------------------------------------------- state

    def _host_empty(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=self._pin_memory)

    def _host_copy(self, src: Tensor, dtype: torch.dtype) -> Tensor:
        out = torch.empty(src.shape, dtype=dtype, device="cpu", pin_memory=self._pin_memory)
        out.copy_(src.detach())
        return out

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        dtype = _state_dtype(p)
        state: dict[str, Tensor] = {"step": torch.zeros((), dtype=torch.float32)}
        state["exp_avg"] = self._host_empty(p.shape, dtype)
        state["exp_avg_sq"] = self._host_empty(p.shape, dtype)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = self._host_empty(p.shape, dtype)
        if not _is_own_master(p):
            state[MASTER_KEY] = self._host_copy(p, dtype)
        return state

    def master_param(self, p: Tensor) -> Tensor:
        """The float32 (float64) source of truth of ``p``: ``p`` itself or its host master."""
        state = self.state.get(p)
        if state and MASTER_KEY in state:
            return state[MASTER_KEY]
        if _is_own_master(p):
            return p
        return p.detach().to("cpu", _state_dtype(p))

    def host_state_bytes(self) -> int:
        """Bytes of optimizer state allocated in host memory (moments, masters, step counts)."""
        total = 0
        for state in self.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and value.device.type == "cpu":
                    total += value.numel() * value.element_size()
        return total

    # ------------------------------------------------------- transfer pipeline

    def _setup_pipeline(self, offload_gradients: bool, transfer_pipeline: Optional[bool], bucket_bytes: int, pin_memory: Optional[bool]) -> None:
        """The device path (offload.py): hooks, exactly-sized pinned buffers, streams, bucketed step."""
        params = [p for g in self.param_groups for p in g["params"]]
        sharded = any(_distributed.is_dtensor(p) for p in params)
        if transfer_pipeline is None:
            transfer_pipeline = offload_gradients or any(p.device.type != "cpu" for p in params)
            transfer_pipeline = transfer_pipeline and not sharded
        if offload_gradients and not transfer_pipeline:
            raise ValueError("offload_gradients=True needs the transfer pipeline (transfer_pipeline=False was given)")
        if transfer_pipeline and sharded:
            raise ValueError("the transfer pipeline does not handle DTensor (FSDP2) parameters; FSDP2 owns their gradients")
        self._pipeline: Optional[_offload.GradientPipeline] = None
        if not transfer_pipeline:
            return
        if pin_memory is None:
            self._pin_memory = False  # the pipeline's own exact pinned buffers carry every transfer
        self._pipeline = _offload.GradientPipeline(
            self, _offload.PipelineConfig(offload_gradients=offload_gradients, bucket_bytes=bucket_bytes)
        )
        # GradScaler hands grad_scale / found_inf to step() instead of unscaling p.grad itself.
        self._step_supports_amp_scaling = True

    @property
    def offload_gradients(self) -> bool:
        """Whether device gradients are freed after their copy to the host (the host buffer is then the gradient)."""
        return self._pipeline is not None and self._pipeline.offload_gradients

    def gradient(self, p: Tensor) -> Optional[Tensor]:
        """The current gradient of ``p`` wherever it lives (the host buffer when device gradients are freed)."""
        return p.grad if self._pipeline is None else self._pipeline.gradient(p)

    def pinned_bytes(self) -> int:
        """Page-locked host bytes held for transfers (the pipeline's exactly-sized buffers, plus pinned state)."""
        total = 0 if self._pipeline is None else self._pipeline.pinned_bytes()
        for state in self.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and value.device.type == "cpu" and value.is_pinned():
                    total += value.numel() * value.element_size()
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's zero_grad, for device gradients and for gradients held in host memory."""
        if getattr(self, "_pipeline", None) is not None:
            self._pipeline.zero_grad(set_to_none)
        super().zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> Tensor:
        """torch.nn.utils.clip_grad_norm_ over this optimizer's gradients, wherever they live (clipping.py)."""
        from .clipping import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach)

    # -------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One AdamW update of every parameter that has a gradient (CONTRACT.md section 3)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # DCP's get/set_optimizer_state_dict call step() with zero grads and lr 0 only to allocate state: not an update.
        state_only = _distributed.inside_dcp_state_init()
        # Fail early, with the figures, if the state about to be allocated cannot fit in host memory (preflight.py).
        fresh = [(g, i) for g in self.param_groups for i, p in enumerate(g["params"]) if p.grad is not None and not self.state.get(p)]
        if fresh:
            _preflight.check_host_memory(fresh, pin_memory=self._pin_memory)
        if self._pipeline is not None and not state_only:  # device path: offload.py owns the order of work
            self._pipeline.step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None), hasattr(self, "found_inf"))
            return loss

        if self.nonfinite != "propagate":
            culprits = self._nonfinite_gradients()
            if culprits and self.nonfinite == "raise":
                raise FloatingPointError(
                    f"non-finite gradient in {len(culprits)} parameter(s): {', '.join(culprits)}; no state was changed"
                )
            if culprits:
                self.skipped_steps += 1
                return loss

        # Check every gradient of every group before anything changes: an error names its
        # parameter and leaves all state (and every other group) as it was.
        work = [(group, self._gradients_to_apply(group)) for group in self.param_groups]

        for group, entries in work:
            masters: list[Tensor] = []
            grads: list[Tensor] = []
            exp_avgs: list[Tensor] = []
            exp_avg_sqs: list[Tensor] = []
            max_exp_avg_sqs: list[Tensor] = []
            steps: list[Tensor] = []
            host_outputs: list[Optional[Tensor]] = []
            device_params: list[tuple[Tensor, Tensor]] = []

            for p, grad in entries:
                state = self.state[p]
                # From here on p and grad are this rank's shards (themselves unless DTensors).
                p, grad = _distributed.local_tensor(p), _distributed.local_grad(grad, p)
                if len(state) == 0:
                    state.update(self._init_state(p, group))
                if state_only:
                    continue
                master = state.get(MASTER_KEY, p)
                masters.append(master)
                grads.append(grad if grad.device.type == "cpu" else grad.to("cpu"))
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if group["amsgrad"]:
                    if "max_exp_avg_sq" not in state:  # amsgrad switched on after state existed
                        state["max_exp_avg_sq"] = self._host_empty(p.shape, master.dtype)
                    max_exp_avg_sqs.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
                if master is p:
                    host_outputs.append(None)
                elif p.device.type == "cpu":
                    host_outputs.append(p.data)  # the bf16/fp16 parameter receives round(master)
                else:
                    host_outputs.append(None)
                    device_params.append((p, master))

            if not masters:
                continue
            kernel.adamw_update_(
                masters,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                steps,
                self.step_hyper(group),
                model_params=host_outputs,
                impl=self.kernel_impl(group),
            )
            for p, master in device_params:
                p.copy_(master)
        return loss

    def _gradients_to_apply(self, group: dict[str, Any]) -> list[tuple[Tensor, Tensor]]:
        """(parameter, gradient) for every parameter of ``group`` with a gradient, checked, nothing changed."""
        entries = []
        for index, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    f"OffloadAdamW does not support sparse gradients ({self._describe(group, index)}); "
                    "use torch.optim.SparseAdam for sparse embeddings"
                )
            if grad.shape != p.shape:
                raise RuntimeError(
                    f"gradient of {self._describe(group, index)} has shape {tuple(grad.shape)}, "
                    f"the parameter has {tuple(p.shape)}"
                )
            if not grad.is_floating_point():
                raise RuntimeError(f"gradient of {self._describe(group, index)} has dtype {grad.dtype}")
            self._check_state_shape(group, index)
            entries.append((p, grad))
        return entries

    def _check_state_shape(self, group: dict[str, Any], index: int) -> None:
        """Refuse a parameter whose shape changed after its state was allocated (naming it)."""
        p = group["params"][index]
        state = self.state.get(p)
        if not state:
            return
        local_shape = _distributed.local_tensor(p).shape
        # A float32 host parameter is its own master: its moments tell the shape the state has.
        state_shape = state["exp_avg"].shape
        if state_shape != local_shape or state.get(MASTER_KEY, state["exp_avg"]).shape != local_shape:
            raise RuntimeError(
                f"{self._describe(group, index)} changed shape under the optimizer: "
                f"state has {tuple(state_shape)}, the parameter is {tuple(local_shape)}"
            )

    @staticmethod
    def step_hyper(group: dict[str, Any]) -> kernel.StepHyper:
        """The kernel's hyperparameters for one group at this step (the scheduler may have changed lr, betas)."""
        beta1, beta2 = group["betas"]
        return kernel.StepHyper(
            lr=group["lr"],
            beta1=_to_scalar(beta1),
            beta2=_to_scalar(beta2),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            amsgrad=group["amsgrad"],
            maximize=group["maximize"],
        )

    def kernel_impl(self, group: dict[str, Any]) -> str:
        """fused=False picks the readable for-loop kernel; else the fused one, compiled where asked."""
        if group.get("fused") is False:
            return "for_loop"
        return "compiled" if self.compiled_kernel else "fused"

    def _nonfinite_gradients(self) -> list[str]:
        culprits = []
        for group in self.param_groups:
            for index, p in enumerate(group["params"]):
                grad = None if p.grad is None else _distributed.local_tensor(p.grad)
                if grad is not None and not grad.is_sparse and not bool(torch.isfinite(grad).all()):
                    culprits.append(self._describe(group, index))
        # Shards: every rank must take the same decision, also when the bad values are on another rank.
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if _distributed.any_rank(bool(culprits), params) and not culprits:
            culprits.append("a gradient shard held by another rank")
        return culprits

    # -------------------------------------------------------------- state_dict

    def _match_params(self, saved_groups: list[dict[str, Any]], problems: list[str]) -> dict[Any, tuple[Tensor, int, int]]:
        """Map each saved parameter id to (parameter, group index, index in group)."""
        mapping: dict[Any, tuple[Tensor, int, int]] = {}
        if len(saved_groups) != len(self.param_groups):
            problems.append(
                f"the state_dict has {len(saved_groups)} parameter group(s), the optimizer has {len(self.param_groups)}"
            )
            return mapping
        by_name = all("param_names" in g for g in saved_groups) and all("param_names" in g for g in self.param_groups)
        if by_name:
            saved_where: dict[str, tuple[int, Any]] = {}
            for gi, g in enumerate(saved_groups):
                for name, pid in zip(g["param_names"], g["params"]):
                    saved_where[name] = (gi, pid)
            own_names: set[str] = set()
            for gi, group in enumerate(self.param_groups):
                for index, (name, p) in enumerate(zip(group["param_names"], group["params"])):
                    own_names.add(name)
                    if name not in saved_where:
                        problems.append(f"parameter {name!r} (group {gi}) is missing from the state_dict")
                        continue
                    saved_gi, pid = saved_where[name]
                    if saved_gi != gi:
                        problems.append(f"parameter {name!r} is in group {saved_gi} of the state_dict but in group {gi} here")
                        continue
                    mapping[pid] = (p, gi, index)
            for name in saved_where:
                if name not in own_names:
                    problems.append(f"unexpected parameter {name!r} in the state_dict (not in this optimizer)")
            return mapping
        for gi, (g, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(g["params"]) != len(group["params"]):
                problems.append(
                    f"group {gi}: the state_dict has {len(g['params'])} parameter(s), the optimizer has {len(group['params'])}"
                )
                continue
            for index, (pid, p) in enumerate(zip(g["params"], group["params"])):
                mapping[pid] = (p, gi, index)
        return mapping

    def _convert_state(self, p: Tensor, group: dict[str, Any], where: str, saved: dict[str, Any], problems: list[str]) -> dict[str, Any]:
        """Saved per-parameter state -> host float32 state for ``p`` (no side effects on p)."""
        out: dict[str, Any] = {}
        dtype = _state_dtype(p)
        for key, value in saved.items():
            if key == "step":
                value = _distributed.local_tensor(value) if isinstance(value, Tensor) else value
                step = value.detach().float().cpu().reshape(()) if isinstance(value, Tensor) else torch.tensor(float(value))
                if not (step >= 0 and step == step.round()):
                    problems.append(f"{where}: step must be a non-negative whole number, got {step.item()}")
                out["step"] = step.clone()
                continue
            if not isinstance(value, Tensor):
                out[key] = copy.deepcopy(value)
                continue
            if tuple(value.shape) != tuple(p.shape):
                problems.append(f"{where}: {key} has shape {tuple(value.shape)}, the parameter has {tuple(p.shape)}")
                continue
            value = _distributed.local_shard_of(value, p)  # this rank's piece of the (global) saved state
            if key in MOMENT_KEYS or key == MASTER_KEY:
                if not value.is_floating_point():
                    problems.append(f"{where}: {key} has dtype {value.dtype}")
                    continue
                out[key] = self._host_copy(value, dtype)
            else:
                out[key] = value.detach().clone()
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if saved and key not in saved:
                problems.append(f"{where}: state has no {key!r}")
        if group["amsgrad"] and saved and "max_exp_avg_sq" not in saved:
            problems.append(f"{where}: amsgrad is on but the state has no 'max_exp_avg_sq'")
        if saved and MASTER_KEY not in out and not _is_own_master(p):
            # A state_dict from torch.optim.AdamW has no master: the parameter's value is the best there is.
            out[MASTER_KEY] = self._host_copy(_distributed.local_tensor(p), dtype)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of OffloadAdamW or torch.optim.AdamW, all or nothing.

        Saved states are matched to parameters by name when both sides carry
        ``param_names``, else by position. Every mismatch (missing, unexpected,
        wrong group, wrong shape) is collected into one :class:`StateDictMismatch`,
        and then nothing is changed. Moments and masters land in host memory in
        float32 (float64 for float64 parameters). A saved master is written back
        to its parameter (rounded to the parameter's dtype), so that the model
        and the optimizer agree after a resume.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        problems: list[str] = []
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise StateDictMismatch(["not an optimizer state_dict: expected the keys 'state' and 'param_groups'"])
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        mapping = self._match_params(saved_groups, problems)

        new_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for pid, saved in saved_state.items():
            if pid not in mapping:
                if not any(pid in g["params"] for g in saved_groups):
                    problems.append(f"state entry {pid!r} belongs to no parameter group of the state_dict")
                continue  # a missing or unexpected name is already reported
            p, gi, index = mapping[pid]
            where = self._describe(self.param_groups[gi], index)
            new_state[p] = self._convert_state(p, self.param_groups[gi], where, saved, problems)

        new_groups = []
        if len(saved_groups) == len(self.param_groups):
            for saved_group, group in zip(saved_groups, self.param_groups):
                merged = {k: v for k, v in group.items()}
                merged.update({k: copy.deepcopy(v) for k, v in saved_group.items() if k not in ("params", "param_names")})
                merged["params"] = group["params"]
                if "param_names" in group:
                    merged["param_names"] = group["param_names"]
                if merged.get("capturable") or merged.get("differentiable"):
                    problems.append("the state_dict asks for capturable or differentiable, which OffloadAdamW does not support")
                merged["capturable"] = False
                merged["differentiable"] = False
                merged["decoupled_weight_decay"] = True
                new_groups.append(merged)
        if problems:
            raise StateDictMismatch(problems)

        # Commit: nothing above touched the optimizer or the parameters.
        self.param_groups = new_groups
        self.state = new_state
        with torch.no_grad():
            for p, state in self.state.items():
                if MASTER_KEY not in state:
                    continue
                if _is_own_master(p):
                    _distributed.local_tensor(p).copy_(state.pop(MASTER_KEY))  # a host float32 parameter is its own master
                else:
                    _distributed.local_tensor(p).copy_(state[MASTER_KEY])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
