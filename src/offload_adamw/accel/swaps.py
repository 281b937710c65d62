"""Parameter swaps, seen before the first forward that uses the new parameters.

Contract:

* accelerate and the HF Trainer build the optimizer over a model's parameters, shard the model (FSDP2) and
  put the shards into the optimizer's ``param_groups`` in place of the originals; any edit of
  ``param_groups`` (an assignment, ``append``, ``add_param_group``) may do the same. Nothing in
  ``param_groups`` tells anyone when it changes, so the pipeline looks: at every ``refresh()`` (each step,
  ``zero_grad()``, a read of the gradients) and, through :func:`look_before_next_forward`, once at the
  first module forward after its construction, after every backward and after every step. A parameter put into ``param_groups``
  since then gets its hooks before the backward that uses it, and a parameter that left is released
  (accel/slots.py) before that backward too.
* :func:`changed` answers whether the parameters or their places ``(group, index)`` differ from those the
  pipeline has (an update during backward reads its group's hyperparameters by place), by identity: the
  pipeline holds its parameters, so an ``id`` cannot have been reused by a new tensor.
* FSDP1's ``FlatParameter`` (``FullyShardedDataParallel(use_orig_params=False)``) is refused by name when it
  enters: its gradient arrives in backward with the unsharded size, so no host buffer laid out for the shard
  can take it. With ``use_orig_params=True`` the optimizer holds the original parameters and the pipeline
  takes their (sharded) gradients at the step.
* One global forward pre-hook serves every pipeline (registered with the first); it holds the pipelines
  weakly, costs a set lookup per module forward while no pipeline waits, and looks at nothing while a
  graph is compiled, inside backward (activation checkpointing's recomputation) or in inference mode
  (host buffers laid out there could not be written outside it): the next forward outside looks. A pipeline stops
  being looked at when it closes, which it does when its optimizer goes (accel/pipeline.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["changed", "look_before_next_forward", "refuse_flat_parameters", "stop_looking"]


class Watched(Protocol):
    def refresh(self, *, if_changed: bool = False) -> None:
        """Take a change of ``param_groups`` in (``if_changed``: compare them with the parameters held first)."""
        ...


_WAITING: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOK: Any = None


def look_before_next_forward(pipeline: Watched) -> None:
    """Have ``pipeline.refresh(if_changed=True)`` called at the next module forward (once)."""
    global _HOOK
    _WAITING.add(pipeline)
    if _HOOK is None:
        _HOOK = torch.nn.modules.module.register_module_forward_pre_hook(_before_forward)


def stop_looking(pipeline: Watched) -> None:
    """``pipeline`` was closed: no look at its (gone) optimizer."""
    _WAITING.discard(pipeline)


def changed(groups: Sequence[dict[str, Any]], held: Mapping[Tensor, tuple[int, int]]) -> bool:
    """Whether the parameters of ``groups`` (the optimizer's ``param_groups``) and their places are not exactly ``held``."""
    count = 0
    for gi, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            if held.get(p) != (gi, i):
                return True
            count += 1
    return count != len(held)


def refuse_flat_parameters(params: Iterable[Tensor], describe: Callable[[Tensor], str]) -> None:
    """Raise, naming the first one, when ``params`` hold an FSDP1 FlatParameter (see the module contract)."""
    flat = next((p for p in params if getattr(p, "_is_flat_param", False)), None)
    if flat is not None:
        raise ValueError(
            f"{describe(flat)} is an FSDP1 FlatParameter (FullyShardedDataParallel(use_orig_params=False)): its gradient "
            "arrives in backward with the unsharded size, which OffloadAdamW's transfer pipeline cannot take. Wrap the "
            "model with use_orig_params=True (fsdp_config={'use_orig_params': True} in the HF Trainer), use FSDP2 "
            "(fully_shard), or transfer_pipeline=False (the plain step takes FlatParameters as torch's AdamW does)"
        )


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    if not _WAITING or torch.compiler.is_compiling() or torch._C._current_autograd_node() is not None:
        return
    if torch.is_inference_mode_enabled():
        return  # buffers allocated now would be inference tensors, which backward's copies cannot write: wait
    waiting = list(_WAITING)
    _WAITING.clear()
    for pipeline in waiting:
        pipeline.refresh(if_changed=True)
