"""The optimizer's side of the transfer pipeline: what it is handed at construction, and each bucket's work done.

Contract:

* :func:`pipeline_for` builds an optimizer's pipeline (accel/pipeline.py) and hands it :func:`wiring`: data and
  narrow callables (its ``param_groups`` as they are now, a parameter's name, the gradient check of a read outside
  ``step()``, whether a parameter has state, the model's parameter order, the host- and device-memory checks, the
  settings the gate decides by (:class:`Settings`), optim/policy.py, and :class:`BackwardBuckets`), never the
  optimizer. Every one of them reaches the optimizer through a weak reference: the optimizer owns the pipeline, and a
  dropped optimizer takes its hooks and buffers with it (a finaliser of the optimizer closes the pipeline), while a
  strong reference from the pipeline would keep it until the collector runs.

* :func:`serve` does one piece of a bucket's work: a :class:`~offload_adamw.accel.work.HostGroup` is updated by
  ``OffloadAdamW.update_group`` (optim/update.py's one host update, the same call the plain step makes); a
  :class:`~offload_adamw.accel.work.DeviceGroup` is given its group's hyperparameters and state operands
  (``OffloadAdamW.state_operands``, optim/placement.py), over which the transport runs the device kernel.
  The step's sequence (optim/step.py) and the updates during backward (:class:`BackwardBuckets`) both drive
  their buckets through it: the update of a bucket is written here once.
* :class:`BackwardBuckets` is what the pipeline is handed at construction for updates during backward (one
  callable; never the optimizer): each bucket's gradients checked (``check_gradient``) before anything changes,
  its device buffers reserved, the state of a parameter that has none created (the pre-flight), then its work
  served. It holds the optimizer weakly, as everything of :func:`wiring` does.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from offload_adamw.accel.pipeline import GradientPipeline, PipelineConfig, Wiring
from offload_adamw.accel.work import HostGroup, LandedBucket, Work
from offload_adamw.optim import policy as _policy

if TYPE_CHECKING:
    from offload_adamw.optim.optimizer import OffloadAdamW

__all__ = ["BackwardBuckets", "Settings", "pipeline_for", "serve", "wiring"]


def serve(opt: OffloadAdamW, work: Work) -> None:
    """One group's share of a bucket (see the module contract)."""
    if isinstance(work, HostGroup):
        opt.update_group(work.index, work.updates, work.scale, work.current)
    else:
        work.state = opt.state_operands(work.index, work.params)


class BackwardBuckets:
    """The bucket function of updates during backward, over a weakly held optimizer (see the module contract)."""

    def __init__(self, opt: OffloadAdamW) -> None:
        self._opt: OffloadAdamW = weakref.proxy(opt)

    def __call__(self, bucket: LandedBucket) -> None:
        opt = self._opt
        for (gi, i), _, grad in bucket.gradients:
            opt.check_gradient(gi, i, grad)
        bucket.prepare()
        opt.preflight([place for place, p, _ in bucket.gradients if not opt.state.get(p)])
        for work in bucket.updates:
            serve(opt, work)


class Settings:
    """``max_grad_norm`` and ``nonfinite`` as the optimizer has them now (the user may change them between steps)."""

    def __init__(self, opt: OffloadAdamW) -> None:
        self._opt = opt  # a weak proxy (wiring())

    @property
    def max_grad_norm(self) -> float | None:
        return self._opt.max_grad_norm

    @property
    def nonfinite(self) -> str:
        return self._opt.nonfinite


def wiring(opt: OffloadAdamW) -> Wiring:
    """What the pipeline of ``opt`` is handed (see the module contract): each callable reaches ``opt`` weakly."""
    ref: Any = weakref.proxy(opt)
    # Lambdas over the proxy, not bound methods (PLW0108): a bound method would hold the optimizer itself.
    return Wiring(
        groups=lambda: ref.param_groups,
        describe=lambda gi, i: ref.describe_param(gi, i),  # noqa: PLW0108
        gradient_check=lambda gi, i, grad: ref.check_gradient(gi, i, grad),  # noqa: PLW0108
        has_state=lambda p: bool(ref.state.get(p)),
        clip_order=lambda: ref.clip_parameters(),  # noqa: PLW0108
        host_memory=lambda nbytes, label: ref.check_host_buffers(nbytes, label),  # noqa: PLW0108
        device_memory=lambda nbytes, device, label: ref.check_device_buffers(nbytes, device, label),  # noqa: PLW0108
        settings=Settings(ref),
        policy=_policy,
        update_bucket=BackwardBuckets(opt),
    )


def pipeline_for(opt: OffloadAdamW, config: PipelineConfig) -> GradientPipeline:
    """``opt``'s transfer pipeline, closed when ``opt`` goes (see the module contract)."""
    pipeline = GradientPipeline(config, wiring(opt))
    weakref.finalize(opt, pipeline.close)
    return pipeline
