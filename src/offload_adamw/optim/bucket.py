"""The optimizer's side of a bucket: what the transport hands out (accel/work.py), done with the optimizer's state.

Contract:

* :func:`serve` does one piece of a bucket's work: a :class:`~offload_adamw.accel.work.HostGroup` is updated by
  ``OffloadAdamW.update_group`` (optim/update.py's one host update, the same call the plain step makes); a
  :class:`~offload_adamw.accel.work.DeviceGroup` is given its group's hyperparameters and state operands
  (``OffloadAdamW.state_operands``, optim/placement.py), over which the transport runs the device kernel.
  The step's sequence (optim/step.py) and the updates during backward (:class:`BackwardBuckets`) both drive
  their buckets through it: the update of a bucket is written here once.
* :class:`BackwardBuckets` is what the pipeline is handed at construction for updates during backward (one
  callable; never the optimizer): each bucket's gradients checked (``check_gradient``) before anything changes,
  its device buffers reserved, the state of a parameter that has none created (the pre-flight), then its work
  served. It holds the optimizer weakly: the optimizer owns the pipeline, and a dropped optimizer takes its
  hooks and buffers with it (a strong reference from the pipeline would keep it until the collector runs).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from offload_adamw.accel.work import HostGroup, LandedBucket, Work

if TYPE_CHECKING:
    from offload_adamw.optim.optimizer import OffloadAdamW

__all__ = ["BackwardBuckets", "serve"]


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
