"""Loading a state_dict into OffloadAdamW: matched by name, checked whole, committed all at once.

Contract (docs/contract.md#resume):

* Saved states are matched to parameters by name when both sides carry ``param_names`` (else by
  position, as torch does). An optimizer built without names takes the saved ones, as torch's load
  does, so that its next ``state_dict`` carries them. Names are compared in canonical form, the wrappers' prefixes removed as
  torch.distributed.checkpoint removes them (:func:`canonical_name`), so that a state moves between a
  model and the same model wrapped by DDP, torch.compile, activation checkpointing or FSDP. Every
  mismatch (missing, unexpected, wrong group, wrong shape, a state without its moments) is collected
  into one :class:`StateDictMismatch` that names each parameter.
* :func:`prepare_load` computes the new groups and states without touching the optimizer or the
  parameters; the optimizer commits them only when nothing was found wrong.
* Moments and masters land in host memory in float32 (float64 for float64 parameters), also for
  bf16 parameters (torch's own load would cast them down), laid out like their parameter whatever
  the saved layout (elements are matched by index: a contiguous save of a channels_last state loads
  right). A state_dict of torch.optim.AdamW has no
  master: the parameter's value is the best there is, and becomes the master.
* States no run can reach are refused, naming the parameter: an ``exp_avg`` with inf or NaN, an
  ``exp_avg_sq``/``max_exp_avg_sq`` with a negative, infinite or NaN value, a ``step`` that is
  negative, fractional, non-finite or beyond 2**24 (the largest count a float32 step holds
  exactly), a moment that is not a floating tensor; so are hyperparameters the constructor refuses
  and parameters on the meta device (nothing can be loaded into them). A malformed state_dict (wrong
  types anywhere) is a StateDictMismatch too, never a bare TypeError or KeyError.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from typing import Any, Protocol

import torch
from torch import Tensor

from offload_adamw.contract.rules import MASTER_KEY, MOMENT_KEYS, PLACEMENT_KEY, check_hyperparameter_ranges
from offload_adamw.distributed import local_shard_of, local_tensor
from offload_adamw.optim import state as host_state

__all__ = ["StateDictMismatch", "canonical_name", "prepare_load"]

#: Module names that wrappers insert into parameter names: torch.compile, activation checkpointing, FSDP.
_WRAPPER_COMPONENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """``name`` without wrapper prefixes: DDP's leading ``module.`` and every wrapper component.

    ``module._orig_mod.layers.0._checkpoint_wrapped_module.weight`` -> ``layers.0.weight``. A leading
    ``module.`` is removed only at the root, where DDP puts it (a submodule may be called "module").
    """
    parts = name.split(".")
    while parts and parts[0] in ("module", *_WRAPPER_COMPONENTS) and len(parts) > 1:
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_COMPONENTS)


def _canonical(names: list[str]) -> dict[str, str]:
    """name -> canonical name, or the identity where two names would become one (then names match exactly)."""
    mapped = {n: canonical_name(n) for n in names}
    if len(set(mapped.values())) != len(mapped):
        return {n: n for n in names}
    return mapped


class StateDictMismatch(ValueError):
    """A state_dict that does not fit this optimizer; ``problems`` lists every culprit."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n  - ".join(self.problems)
        super().__init__(f"cannot load optimizer state_dict ({len(self.problems)} problem(s)); nothing was changed:\n  - {lines}")


class LoadTarget(Protocol):
    """What loading needs of the optimizer."""

    param_groups: list[dict[str, Any]]

    def describe_param(self, group_index: int, index: int) -> str: ...


def _match_params(
    target: LoadTarget, saved_groups: list[dict[str, Any]], problems: list[str]
) -> dict[Any, tuple[Tensor, int, int]]:
    """Map each saved parameter id to (parameter, group index, index in group)."""
    own_groups = target.param_groups
    mapping: dict[Any, tuple[Tensor, int, int]] = {}
    if len(saved_groups) != len(own_groups):
        problems.append(f"the state_dict has {len(saved_groups)} parameter group(s), the optimizer has {len(own_groups)}")
        return mapping
    by_name = all("param_names" in g for g in saved_groups) and all("param_names" in g for g in own_groups)
    if by_name:
        saved_canon = _canonical([n for g in saved_groups for n in g["param_names"]])
        own_canon = _canonical([n for g in own_groups for n in g["param_names"]])
        saved_where: dict[str, tuple[int, Any]] = {}
        saved_label: dict[str, str] = {}
        for gi, g in enumerate(saved_groups):
            for name, pid in zip(g["param_names"], g["params"]):
                saved_where[saved_canon[name]] = (gi, pid)
                saved_label[saved_canon[name]] = name
        own_names: set[str] = set()
        for gi, group in enumerate(own_groups):
            for index, (own_name, p) in enumerate(zip(group["param_names"], group["params"])):
                name = own_canon[own_name]
                own_names.add(name)
                if name not in saved_where:
                    problems.append(f"parameter {own_name!r} (group {gi}) is missing from the state_dict")
                    continue
                saved_gi, pid = saved_where[name]
                if saved_gi != gi:
                    problems.append(f"parameter {own_name!r} is in group {saved_gi} of the state_dict but in group {gi} here")
                    continue
                mapping[pid] = (p, gi, index)
        for name in saved_where:
            if name not in own_names:
                problems.append(f"unexpected parameter {saved_label[name]!r} in the state_dict (not in this optimizer)")
        return mapping
    for gi, (g, group) in enumerate(zip(saved_groups, own_groups)):
        if len(g["params"]) != len(group["params"]):
            problems.append(
                f"group {gi}: the state_dict has {len(g['params'])} parameter(s), the optimizer has {len(group['params'])}"
            )
            continue
        for index, (pid, p) in enumerate(zip(g["params"], group["params"])):
            mapping[pid] = (p, gi, index)
    return mapping


#: the largest step count a float32 step tensor holds exactly (every whole number up to it is representable).
MAX_STEP = 2**24


def _step_count(value: Any, where: str, problems: list[str]) -> Tensor | None:
    """A saved step as the float32 0-dim tensor the state holds, or None with the problem recorded."""
    if isinstance(value, Tensor):
        value = local_tensor(value)
        if value.numel() != 1 or value.is_meta or value.is_complex():
            shape = tuple(value.shape)
            problems.append(f"{where}: step must be one number, got a tensor of shape {shape} ({value.dtype}, {value.device})")
            return None
        count = float(value.detach().cpu().double().reshape(()))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        count = float(value)
    else:
        problems.append(f"{where}: step must be a number, got {type(value).__name__} {value!r}")
        return None
    if not (math.isfinite(count) and count >= 0 and count == round(count)):
        problems.append(f"{where}: step must be a non-negative whole number, got {count}")
        return None
    if not count <= MAX_STEP:
        problems.append(
            f"{where}: step {int(count)} is beyond 2**24 = {MAX_STEP}, the largest count a float32 step holds exactly"
        )
        return None
    return torch.tensor(count, dtype=torch.float32)


def _impossible_values(key: str, value: Tensor) -> str | None:
    """Why a moment's values cannot come from any run, or None."""
    if key == "exp_avg" and not bool(torch.isfinite(value).all()):
        return "exp_avg holds inf or NaN"
    if key in ("exp_avg_sq", "max_exp_avg_sq") and not bool((torch.isfinite(value) & (value >= 0)).all()):
        return f"{key} holds a negative, infinite or NaN value (a mean of squares is finite and >= 0)"
    return None


def _convert_state(
    p: Tensor, group: dict[str, Any], where: str, saved: dict[str, Any], problems: list[str], pin: bool
) -> dict[str, Any]:
    """Saved per-parameter state -> host float32 state for ``p`` (no side effects on p)."""
    out: dict[str, Any] = {}
    dtype = host_state.state_dtype(p)
    for key, value in saved.items():
        if key == "step":
            step = _step_count(value, where, problems)
            if step is not None:
                out["step"] = step
            continue
        if key in MOMENT_KEYS or key == MASTER_KEY:
            if not isinstance(value, Tensor):
                problems.append(f"{where}: {key} must be a tensor, got {type(value).__name__}")
                continue
            if value.is_meta:
                problems.append(f"{where}: {key} is on the meta device (it holds no data)")
                continue
        if not isinstance(value, Tensor):
            out[key] = copy.deepcopy(value)
            continue
        if tuple(value.shape) != tuple(p.shape):
            problems.append(f"{where}: {key} has shape {tuple(value.shape)}, the parameter has {tuple(p.shape)}")
            continue
        shard = local_shard_of(value, p)  # this rank's piece of the (global) saved state
        if key in MOMENT_KEYS or key == MASTER_KEY:
            if not (shard.is_floating_point() or shard.is_complex()) or shard.is_complex() != p.is_complex():
                problems.append(f"{where}: {key} has dtype {shard.dtype}")
                continue
            impossible = _impossible_values(key, torch.view_as_real(shard) if shard.is_complex() else shard)
            if impossible is not None:
                problems.append(f"{where}: {impossible}; no run of AdamW reaches this state")
                continue
            out[key] = host_state.host_copy(shard, dtype, pin=pin, like=local_tensor(p))
        else:
            out[key] = shard.detach().clone()
    for key in ("step", "exp_avg", "exp_avg_sq"):
        if saved and key not in saved:
            problems.append(f"{where}: state has no {key!r}")
    if group.get("amsgrad") and saved and "max_exp_avg_sq" not in saved:
        problems.append(f"{where}: amsgrad is on but the state has no 'max_exp_avg_sq'")
    if saved and MASTER_KEY not in out and not host_state.is_own_master(local_tensor(p)):
        out[MASTER_KEY] = host_state.host_copy(local_tensor(p), dtype, pin=pin)
    return out


def prepare_load(
    target: LoadTarget, state_dict: Any, *, pin: bool
) -> tuple[list[dict[str, Any]], defaultdict[Tensor, dict[str, Any]]]:
    """The new param_groups and state for ``target``, or StateDictMismatch listing every problem."""
    problems: list[str] = []
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise StateDictMismatch(["not an optimizer state_dict: expected the keys 'state' and 'param_groups'"])
    saved_groups = state_dict["param_groups"]
    saved_state = state_dict["state"]
    _check_layout(saved_groups, saved_state)
    for gi, group in enumerate(target.param_groups):
        for index, p in enumerate(group["params"]):
            if local_tensor(p).is_meta:
                problems.append(
                    f"{target.describe_param(gi, index)} is on the meta device (it holds no data), nothing can be loaded "
                    "into it: materialize the model (module.to_empty(device=...)) before loading"
                )
    if problems:
        raise StateDictMismatch(problems)
    try:
        mapping = _match_params(target, saved_groups, problems)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise StateDictMismatch([f"malformed param_groups: {type(exc).__name__}: {exc}"]) from exc

    new_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    for pid, saved in saved_state.items():
        if pid not in mapping:
            if not any(pid in g["params"] for g in saved_groups):
                problems.append(f"state entry {pid!r} belongs to no parameter group of the state_dict")
            continue  # a missing or unexpected name is already reported
        p, gi, index = mapping[pid]
        where = target.describe_param(gi, index)
        try:
            new_state[p] = _convert_state(p, target.param_groups[gi], where, saved, problems, pin)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
            problems.append(f"{where}: malformed state ({type(exc).__name__}: {exc})")

    new_groups = []
    if len(saved_groups) == len(target.param_groups):
        for gi, (saved_group, group) in enumerate(zip(saved_groups, target.param_groups)):
            hyper_problem = _check_hyper(saved_group)
            if hyper_problem is not None:
                problems.append(f"param_groups[{gi}]: {hyper_problem}")
            merged = dict(group)
            # The placement is this optimizer's own (a resume may change it), never the saved one's.
            local_keys = ("params", "param_names", PLACEMENT_KEY)
            merged.update({k: copy.deepcopy(v) for k, v in saved_group.items() if k not in local_keys})
            merged["params"] = group["params"]
            if "param_names" in group:
                merged["param_names"] = group["param_names"]  # matched by name: this order is the params' order
            elif "param_names" in saved_group:
                # As torch's load: an optimizer built without names takes the saved ones (matched by
                # position), so that its next state_dict still carries them.
                merged["param_names"] = list(saved_group["param_names"])
            if merged.get("capturable") or merged.get("differentiable"):
                problems.append("the state_dict asks for capturable or differentiable, which OffloadAdamW does not support")
            merged["capturable"] = False
            merged["differentiable"] = False
            merged["decoupled_weight_decay"] = True
            new_groups.append(merged)
    if problems:
        raise StateDictMismatch(problems)
    return new_groups, new_state


def _check_layout(saved_groups: Any, saved_state: Any) -> None:
    """The shape of a state_dict, before anything indexes it: StateDictMismatch naming what is malformed."""
    problems = []
    if not isinstance(saved_groups, (list, tuple)):
        problems.append(f"param_groups must be a list, got {type(saved_groups).__name__}")
    else:
        for gi, g in enumerate(saved_groups):
            if not isinstance(g, dict) or not isinstance(g.get("params"), (list, tuple)):
                problems.append(f"param_groups[{gi}] must be a dict with a list 'params'")
                continue
            names = g.get("param_names")
            named = isinstance(names, (list, tuple)) and len(names) == len(g["params"]) and all(isinstance(n, str) for n in names)
            if names is not None and not named:
                problems.append(f"param_groups[{gi}]['param_names'] must be a list of names, one per entry of 'params'")
            try:
                hash(tuple(g["params"]))
            except TypeError:
                problems.append(f"param_groups[{gi}]['params'] must hold parameter ids (hashable)")
    if not isinstance(saved_state, dict):
        problems.append(f"state must be a dict, got {type(saved_state).__name__}")
    else:
        for pid, entry in saved_state.items():
            if not isinstance(entry, dict):
                problems.append(f"state entry {pid!r} must be a dict, got {type(entry).__name__}")
    if problems:
        raise StateDictMismatch(problems)


def _check_hyper(saved_group: dict[str, Any]) -> str | None:
    """Why the constructor would refuse a saved group's hyperparameters, or None (torch's words, via contract/rules.py)."""
    try:
        lr, betas = saved_group.get("lr", 0.0), saved_group.get("betas", (0.0, 0.0))
        eps, weight_decay = saved_group.get("eps", 0.0), saved_group.get("weight_decay", 0.0)
        if isinstance(lr, Tensor) and lr.numel() != 1:
            return "Tensor lr must be 1-element"
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            return f"betas must be a pair, got {betas!r}"
        for name in ("amsgrad", "maximize"):
            if name in saved_group and not isinstance(saved_group[name], bool):
                return f"{name} must be True or False, got {saved_group[name]!r}"
        check_hyperparameter_ranges(lr, betas, eps, weight_decay)
    except ValueError as exc:
        return str(exc)
    except (TypeError, RuntimeError) as exc:  # not numbers at all
        return f"malformed hyperparameters ({type(exc).__name__}: {exc})"
    return None


def write_masters_back(state: dict[Tensor, dict[str, Any]]) -> None:
    """After a committed load: each parameter receives its master (rounded to its dtype).

    A float32 host parameter is its own master, so a saved master is copied into it and dropped.
    """
    with torch.no_grad():
        for p, s in state.items():
            if MASTER_KEY not in s:
                continue
            local = local_tensor(p)
            if host_state.is_own_master(local):
                local.copy_(s.pop(MASTER_KEY))
            else:
                local.copy_(s[MASTER_KEY])

