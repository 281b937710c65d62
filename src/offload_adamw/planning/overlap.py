"""How long a training step takes when the host update runs after backward, or hidden behind it.

Contract: pure computation on plain numbers (no torch). A step is forward, backward, and for each of
``groups`` parameter groups (FSDP units or buckets) three stages that run one group at a time each:
the gradient's copy to the host, the host update, and the copy of the updated parameters back. The
groups' gradients become ready at evenly spaced moments of backward (backward produces them in
order); each stage serves groups in that order, and a stage starts a group when the group's previous
stage has finished and the stage itself is free (a flow shop). The next step's forward waits for the
last copy back.

* ``serial``: nothing of the optimizer starts before backward ends (today's ``step()`` after backward).
* ``overlapped`` without clipping: each group's copy starts when its gradient is ready.
* ``overlapped`` with clipping: the copies start as gradients arrive, but no host update can start
  before the global gradient norm is known, which is when the last group's partial norm is: the end
  of backward. What is hidden then is the copies, not the updates.

Updates that run on the device (``update_on="stream"`` or ``"device"``) form a second lane beside the
host's: ``device_groups`` groups, one stage each (a streamed group's chunks go up, are updated and
come back through the ring, so the group takes as long as its slowest link), their gradients ready
at evenly spaced moments of backward, gated like the host updates by clipping. The two lanes run at
once; both use host memory (the host update, the streams' DMA), so the optimizer cannot end before
``host_memory_s`` after the moment updates may start (forward's end; with clipping backward's end).
Without a device lane and with ``host_memory_s`` at most the host update, the times are those of the
host lane alone.

The model ignores the contention of the copies with backward's own traffic and assumes one host
worker (the host update of one group uses the whole memory bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepTimeModel", "StepTimes", "step_times", "training_step_model"]


@dataclass(frozen=True, kw_only=True)
class StepTimeModel:
    """The parts of one training step, in seconds."""

    forward_s: float
    """Forward pass (compute)."""
    backward_s: float
    """Backward pass (compute), during which the groups' gradients become ready."""
    host_update_s: float
    """The host update of all groups together (memory-bandwidth bound)."""
    d2h_s: float
    """Copying every gradient to the host."""
    h2d_s: float
    """Copying every updated parameter back."""
    groups: int = 1
    """Parameter groups (FSDP units or buckets) that flow through the stages one by one."""
    clipping: bool = False
    """Whether the update needs the global gradient norm first."""
    device_update_s: float = 0.0
    """The updates of the groups placed on the device (streamed or resident), one group at a time."""
    device_groups: int = 1
    """Groups in the device lane."""
    host_memory_s: float = 0.0
    """Host-memory time of all the optimizer's work after updates may start, both lanes together."""

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "host_update_s", "d2h_s", "h2d_s", "device_update_s", "host_memory_s"):
            value = getattr(self, name)
            if not 0.0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        for name in ("groups", "device_groups"):
            if not 1 <= getattr(self, name):
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class StepTimes:
    """Step time with the optimizer after backward, and hidden behind it."""

    serial_s: float
    overlapped_s: float
    backward_end_s: float
    """When backward ends (forward + backward)."""

    @property
    def hidden_fraction(self) -> float:
        """The part of the serial optimizer time that overlap hides (0 when there is none to hide)."""
        optimizer = self.serial_s - self.backward_end_s
        return 0.0 if optimizer <= 0 else (self.serial_s - self.overlapped_s) / optimizer


def _flow_shop(ready: list[float], stage_times: list[float], gates: list[float]) -> float:
    """Finish time of the last group through stages of equal per-group durations; ``gates[k]``: stage k starts no earlier."""
    free = list(gates)
    finish = 0.0
    for start in ready:
        t = start
        for k, duration in enumerate(stage_times):
            t = max(t, free[k]) + duration
            free[k] = t
        finish = t
    return finish


def step_times(model: StepTimeModel) -> StepTimes:
    """Serial and overlapped step time of ``model`` (see the module contract)."""
    g = model.groups
    backward_end = model.forward_s + model.backward_s
    per_group = [model.d2h_s / g, model.host_update_s / g, model.h2d_s / g]
    host_lane = model.d2h_s + model.host_update_s + model.h2d_s
    serial = backward_end + max(host_lane, model.device_update_s, model.host_memory_s)
    ready = [model.forward_s + model.backward_s * (i + 1) / g for i in range(g)]
    update_gate = backward_end if model.clipping else 0.0
    overlapped = _flow_shop(ready, per_group, [0.0, update_gate, 0.0])
    if model.device_update_s > 0:
        k = model.device_groups
        device_ready = [model.forward_s + model.backward_s * (i + 1) / k for i in range(k)]
        overlapped = max(overlapped, _flow_shop(device_ready, [model.device_update_s / k], [update_gate]))
    start = backward_end if model.clipping else model.forward_s
    overlapped = max(overlapped, start + model.host_memory_s)
    return StepTimes(serial_s=serial, overlapped_s=max(overlapped, backward_end), backward_end_s=backward_end)


def training_step_model(
    *,
    num_parameters: float,
    tokens_per_gpu: float,
    gpu_flops_per_s: float,
    model_flops_utilization: float,
    activation_checkpointing: bool,
    grad_accumulation: int,
    host_update_s: float,
    d2h_s: float,
    h2d_s: float,
    groups: int,
    clipping: bool,
    device_update_s: float = 0.0,
    device_groups: int = 1,
    host_memory_s: float = 0.0,
) -> StepTimeModel:
    """The step of a dense transformer: 2 FLOPs per parameter and token forward, 4 backward (plus 2 for
    the recomputed forward under full activation checkpointing), at ``model_flops_utilization`` of the
    GPU's peak. Only the last micro-batch's backward can hide the optimizer: the earlier micro-batches
    count as forward time. The optimizer's lanes and the host-memory floor are passed through.
    """
    if not 0.0 < model_flops_utilization <= 1.0:
        raise ValueError(f"model_flops_utilization must be in (0, 1], got {model_flops_utilization!r}")
    if not gpu_flops_per_s > 0:
        raise ValueError(f"gpu_flops_per_s must be positive, got {gpu_flops_per_s!r}")
    rate = gpu_flops_per_s * model_flops_utilization
    forward = 2.0 * num_parameters * tokens_per_gpu / rate
    backward = (6.0 if activation_checkpointing else 4.0) * num_parameters * tokens_per_gpu / rate
    return StepTimeModel(
        forward_s=forward * grad_accumulation + backward * (grad_accumulation - 1),
        backward_s=backward,
        host_update_s=host_update_s,
        d2h_s=d2h_s,
        h2d_s=h2d_s,
        groups=groups,
        clipping=clipping,
        device_update_s=device_update_s,
        device_groups=device_groups,
        host_memory_s=host_memory_s,
    )
