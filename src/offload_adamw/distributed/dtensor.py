"""OffloadAdamW under torch.distributed: DTensor (FSDP2, tensor parallel) parameters and DCP.

Contract:

* The optimizer keys its state by the parameter (the DTensor), but every state
  tensor it allocates is a plain host tensor shaped like the parameter's LOCAL
  shard (:func:`local_tensor`): a rank holds state only for what it owns, so
  with FSDP2 the host bytes per rank are 1/world of the total.
* ``state_dict()`` never contains a plain local tensor for a DTensor parameter:
  :func:`wrap_state_dict_post_hook` turns every shaped state of a DTensor
  parameter into a DTensor with the parameter's mesh, placements, global shape
  and stride, and refuses (naming the parameter and key) a shaped state that is
  not a local shard. That is what ``torch.distributed.checkpoint`` needs to
  save global tensors and to reshard on load; a plain local tensor would be
  saved as if it were the whole tensor and corrupt the checkpoint silently.
* Loading takes this rank's shard of a saved state (:func:`local_shard_of`):
  a DTensor with the parameter's placements gives its local tensor, another
  layout is redistributed first (a collective: every rank loads together), and
  a plain tensor with the parameter's global shape is sliced locally.
* ``torch.distributed.checkpoint.state_dict`` creates missing optimizer state
  by calling ``step()`` with zero gradients and lr 0 (``_init_optim_state``).
  For torch.optim.AdamW that counts as an update (step becomes 1, shifting the
  bias correction of every later step). OffloadAdamW recognises that call
  (:func:`inside_dcp_state_init`) and only allocates the state: step stays 0.
* No communication layer of our own: the only collectives here are the
  redistribution of a differently-placed DTensor on load and one all-reduce of
  a flag (:func:`any_rank`) so that every rank takes the same skip decision.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:  # the checker's view only: at run time torch.distributed.tensor stays unimported
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs

__all__ = [
    "is_dtensor",
    "local_tensor",
    "local_grad",
    "as_dtensor_like",
    "local_shard_of",
    "wrap_state_dict_post_hook",
    "inside_dcp_state_init",
    "any_rank",
]


def _dtensor_module() -> Any:
    """torch.distributed.tensor if something imported it, else None.

    A DTensor cannot exist before that module is imported, so there is no need to
    import it here (it costs about half a second at start-up)."""
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(t: Any) -> TypeIs[DTensor]:
    if type(t) is Tensor or type(t) is torch.nn.Parameter:  # the common case, asked several times per tensor and step
        return False
    module = _dtensor_module()
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor), sharing its storage."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():  # under no_grad to_local() returns the local tensor itself, not an autograd view
        return t.to_local()


def local_grad(grad: Tensor, param: Tensor) -> Tensor:
    """This rank's shard of ``grad``, laid out like ``param``'s shard (redistributed if its placements differ)."""
    if is_dtensor(grad) and is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local_tensor(grad)


def as_dtensor_like(local: Tensor, param: DTensor) -> Tensor:
    """``local`` (a shard shaped like ``param``'s local tensor) as a DTensor laid out like ``param``."""
    return _dtensor_module().DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def local_shard_of(value: Tensor, param: Tensor) -> Tensor:
    """This rank's piece of a saved state ``value`` (global shape) for the DTensor ``param``.

    The caller has checked that ``value`` has ``param``'s global shape. For a
    parameter that is not a DTensor, a DTensor ``value`` is gathered whole.
    """
    if not is_dtensor(param):
        return value.full_tensor() if is_dtensor(value) else value
    if is_dtensor(value):
        if value.device_mesh != param.device_mesh or tuple(value.placements) != tuple(param.placements):
            value = value.redistribute(param.device_mesh, param.placements)
        return local_tensor(value)
    # A plain tensor holding the whole (global) value: slice our shard locally, no communication.
    return local_tensor(
        _dtensor_module().distribute_tensor(
            value.to(local_tensor(param).device), param.device_mesh, param.placements, src_data_rank=None
        )
    )


def _params_by_id(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[Any, Tensor]:
    """The packed ids of ``state_dict`` (as torch.optim.Optimizer.state_dict() numbers them) -> parameters."""
    params: dict[Any, Tensor] = {}
    for packed, group in zip(state_dict["param_groups"], optimizer.param_groups):
        for pid, p in zip(packed["params"], group["params"]):
            params.setdefault(pid, p)
    return params


def wrap_state_dict_post_hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Optimizer state_dict post-hook: the states of DTensor parameters as DTensors.

    Builds new per-parameter dicts (the packed ones are the optimizer's own
    state dicts, which must keep their local tensors).
    """
    params = _params_by_id(optimizer, state_dict)
    if not any(is_dtensor(p) for p in params.values()):
        return state_dict
    names = {}
    for group in optimizer.param_groups:
        for p, name in zip(group["params"], group.get("param_names", ())):
            names[id(p)] = name
    new_state = {}
    for pid, saved in state_dict["state"].items():
        p = params.get(pid)
        if p is None or not is_dtensor(p):
            new_state[pid] = saved
            continue
        local_shape = local_tensor(p).shape
        wrapped = {}
        for key, value in saved.items():
            if not isinstance(value, Tensor) or is_dtensor(value) or key == "step":
                wrapped[key] = value
            elif value.shape == local_shape:
                wrapped[key] = as_dtensor_like(value, p)
            else:
                who = names.get(id(p), f"parameter {pid}")
                raise RuntimeError(
                    f"optimizer state {key!r} of {who} has shape {tuple(value.shape)}, which is neither this rank's "
                    f"shard {tuple(local_shape)} nor a scalar: refusing to put a plain local tensor into a distributed "
                    "state_dict"
                )
        new_state[pid] = wrapped
    out = dict(state_dict)
    out["state"] = new_state
    return out


def inside_dcp_state_init(max_depth: int = 8) -> bool:
    """Whether the current ``step()`` call comes from DCP's ``_init_optim_state`` (a state-only call).

    Compares code objects (not names) of the few frames above the caller; the
    step() wrappers of torch.optim add two or three frames.
    """
    module = sys.modules.get("torch.distributed.checkpoint.state_dict")
    init = getattr(module, "_init_optim_state", None) if module is not None else None
    if init is None:
        return False
    target = init.__code__
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code is target:
            return True
        frame = frame.f_back
    return False


def _meshes(params: Iterable[Tensor]) -> list[DeviceMesh]:
    meshes: list[DeviceMesh] = []
    for p in params:
        if is_dtensor(p) and not any(p.device_mesh is m for m in meshes):
            meshes.append(p.device_mesh)
    return meshes


def flag_device(device_type: str, home: torch.device | None) -> torch.device:
    """Where the flag of :func:`any_rank` lives for a collective over ``device_type`` (``"cuda"`` for NCCL): the
    rank's own device ``home`` (its parameters' or gradients') where it is of that type. Not the calling thread's
    current device, which on a thread that never set one is 0: on rank k that would create a context on GPU 0 and
    hand NCCL a tensor of another GPU than its communicator's."""
    if home is not None and home.type == device_type:
        return home
    return torch.device(device_type)  # no device of that type known: the current one, as before


def any_rank(flag: bool, params: Iterable[Tensor], groups: Iterable[Any] = (), device: torch.device | None = None) -> bool:
    """``flag`` OR-reduced over every rank of the meshes of the DTensor ``params`` and of the process ``groups``
    (``flag`` when there are none), the flag on ``device`` (else the first of ``params``' local devices that is not
    the host's) where the collective runs on a device (:func:`flag_device`).

    Each rank sees only its shards' gradients (and, beside a DDP model, its own gradients of the parameters
    outside it); a decision such as skipping the step for a non-finite gradient must be the same on every rank.
    """
    params = list(params)
    meshes = _meshes(params)
    groups = list(groups)
    if not meshes and not groups:
        return flag
    home = device if device is not None else next(
        (d for d in (local_tensor(p).device for p in params) if d.type not in ("cpu", "meta")), None)
    result = flag
    for group in groups:
        where = flag_device("cuda", home) if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu")
        local = torch.tensor([1.0 if result else 0.0], device=where)
        torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX, group=group)
        result = bool(local.item() > 0)
    for mesh in meshes:
        local = torch.tensor([1.0 if result else 0.0], device=flag_device(mesh.device_type, home))
        for dim in range(mesh.ndim):
            torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group(dim))
        result = bool(local.item() > 0)
    return result
