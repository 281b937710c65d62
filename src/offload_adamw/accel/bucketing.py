"""How the parameters of a step are cut into buckets: a pure function of their order, sizes and groups.

Contract: :func:`cut` takes the parameters in the order the latest backward produced their gradients
(those it did not reach last, in optimizer order), each with its gradient bytes and its group (an FSDP2
reduce-scatter or a DDP bucket: the parameters that land together, or None). Consecutive members of one
group form one bucket whatever its size; ungrouped parameters are cut once a bucket holds at least
``bucket_bytes``. Every parameter is in exactly one bucket, and the order is kept.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

__all__ = ["cut"]

K = TypeVar("K", bound=Hashable)


def cut(order: Sequence[tuple[K, int, int | None]], bucket_bytes: int) -> list[list[K]]:
    """The buckets of ``order`` (key, bytes, group) (see the module contract)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[K]] = []
    bucket: list[K] = []
    nbytes = 0
    previous: int | None = None
    for key, size, group in order:
        if bucket and (group is not None or previous is not None) and group != previous:
            buckets.append(bucket)
            bucket, nbytes = [], 0
        bucket.append(key)
        previous = group
        nbytes += size
        if group is None and nbytes >= bucket_bytes:
            buckets.append(bucket)
            bucket, nbytes = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets
