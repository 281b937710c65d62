"""What the transport hands out per bucket, and takes back: plain data, never a call into the optimizer.

Contract (the model is FSDP2's ``foreach_reduce``: tensors and streams in, tensors and events out):

* A bucket's update is a generator of the transport (accel/transport.py's ``StepTransport.update``, accel/
  placements.py's ``Placements.run``): it yields one piece of :data:`Work` per parameter group and placement, and
  the one who drives it (optim/bucket.py's ``serve``, the step's or the one handed to the pipeline for updates
  during backward) does that piece before the generator goes on. What comes after a yield (the parameters sent
  back, the kernels run over the state handed in, the records) is the transport's again; the host's order of work
  is the one of a plain loop: the copies of bucket k+1 are issued before bucket k is handed out.
* :class:`HostGroup`: a host group's share of a bucket, (parameter, complete host gradient, staging buffer) per
  parameter, to be updated by the optimizer's host update before the generator resumes. A device parameter's
  staging buffer receives round(master), which the transport sends back when it resumes; for a host parameter
  staging is None and the update writes the parameter itself. ``current[k]`` says that update k's staging buffer
  holds its device parameter's current value (read back after an edit), whose edits the update takes over.
* :class:`DeviceGroup`: a streamed or resident group's share of a bucket: its parameters, whose hyperparameters
  and state operands (optim/placement.py) the driver puts in :attr:`DeviceGroup.state`; the transport then runs
  torch's fused kernel over them on the device (kernels/fused_device.py).
* :class:`LandedBucket`: a bucket whose gradients all landed during backward, handed whole to the driver given
  at construction: the gradients to check, the device buffers to reserve (:attr:`LandedBucket.prepare`, after the
  check), and its work (:attr:`LandedBucket.updates`), which the driver serves like the step's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch import Tensor

from offload_adamw.kernels.adamw import StepHyper
from offload_adamw.kernels.fused_device import StateOperands

__all__ = ["DeviceGroup", "HostGroup", "LandedBucket", "Work"]

Place = tuple[int, int]


@dataclass
class HostGroup:
    """A host group's share of a bucket: to be updated on the host (see the module contract)."""

    index: int
    """The group's index in ``param_groups``."""
    updates: list[tuple[Tensor, Tensor, Tensor | None]]
    """(parameter, complete host gradient, staging buffer or None) of each parameter."""
    current: list[bool]
    scale: Tensor | None
    """GradScaler's scale that divides the gradients inside the update, or None."""


@dataclass
class DeviceGroup:
    """A streamed or resident group's share of a bucket: the driver gives its state (see the module contract)."""

    index: int
    params: list[Tensor]
    state: tuple[StepHyper, list[StateOperands]] | None = field(default=None)
    """The group's hyperparameters and each parameter's state operands, in ``params``' order: the driver's answer."""

    def given(self) -> tuple[StepHyper, list[StateOperands]]:
        """The state the driver put here (a driver that did not serve this work is a bug, not a silent skip)."""
        if self.state is None:
            raise RuntimeError(f"the state of param_groups[{self.index}] was not given before its device update")
        return self.state


Work = HostGroup | DeviceGroup


@dataclass
class LandedBucket:
    """A bucket updated during backward, as the pipeline hands it to its driver (see the module contract)."""

    gradients: list[tuple[Place, Tensor, Tensor]]
    """(place, parameter, landed gradient) of each parameter updated: to be checked before anything changes."""
    prepare: Callable[[], None]
    """Reserve the device buffers of the bucket's updates (after their memory check)."""
    updates: Iterator[Work]
