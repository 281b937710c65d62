"""The early-update scheduler (accel/overlap.py): each complete bucket once, behind its gate, errors surface."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_adamw.accel.overlap import BackwardUpdater


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6), gated=st.booleans(), data=st.data())
def test_each_complete_bucket_is_updated_once_and_the_rest_is_returned(sizes, gated, data) -> None:
    buckets = []
    key = 0
    for n in sizes:
        buckets.append(list(range(key, key + n)))
        key += n
    keys = list(range(key))
    landed = data.draw(st.lists(st.sampled_from(keys), max_size=2 * key))  # repeats and omissions allowed
    ran: list[int] = []
    updater = BackwardUpdater(buckets, lambda i: ran.append(i) or None, gated=gated)
    for k in landed:
        updater.landed(k)
    remaining, records = updater.finish()
    complete = {i for i, b in enumerate(buckets) if set(b) <= set(landed)}
    assert sorted(ran) == sorted(complete) and len(ran) == len(set(ran))
    assert set(remaining) == set(range(len(buckets))) - complete
    assert {r.bucket for r in records} == complete
    assert all(r.ready <= r.start <= r.end for r in records)


def test_a_gated_update_waits_for_the_gate() -> None:
    started = threading.Event()
    updater = BackwardUpdater([[0], [1]], lambda i: started.set() or None, gated=True)
    updater.landed(0)
    time.sleep(0.05)
    assert not started.is_set(), "an update ran before the gate opened"
    updater.open_gate()
    assert started.wait(5)
    remaining, _ = updater.finish()
    assert remaining == [1]


def test_an_ungated_update_runs_while_the_caller_goes_on() -> None:
    release = threading.Event()
    updater = BackwardUpdater([[0]], lambda i: release.wait(5) and None, gated=False)
    t0 = time.monotonic()
    updater.landed(0)
    assert time.monotonic() - t0 < 1.0, "landed() waited for the update"
    release.set()
    remaining, records = updater.finish()
    assert remaining == [] and len(records) == 1


def test_the_first_error_of_an_update_is_raised_by_finish() -> None:
    def update(i: int):
        raise RuntimeError(f"bucket {i} failed")

    updater = BackwardUpdater([[0], [1]], update, gated=False)
    updater.landed(0)
    with pytest.raises(RuntimeError, match="bucket 0 failed"):
        updater.finish()


def test_an_updater_of_no_buckets_does_nothing_and_starts_no_thread() -> None:
    ran: list[int] = []
    threads = threading.active_count()
    updater = BackwardUpdater([], lambda i: ran.append(i) or None, gated=False)
    updater.landed(0)
    assert not updater.enabled and threading.active_count() == threads
    assert updater.finish() == ([], []) and ran == []
