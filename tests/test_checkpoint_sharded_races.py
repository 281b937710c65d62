"""Sharded (layout 2, DCP) checkpoints raced: a load racing overwrites reads one whole checkpoint; saves racing to
create one path without ``overwrite``: exactly one wins.

As tests/test_checkpoint_races.py for layout 1: a writer process (tests/support/_sharded_overwrite_worker.py, a
1-rank FSDP2 model) replaces one checkpoint over and over with ``overwrite=True``; this process loads it into
the plain model meanwhile (a resharding load). Every save holds one value everywhere, so a load that mixed
two saves is seen, and none may be refused as corrupt: the directory and every file the manifest lists are
opened at once, and the shards are read through those descriptors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import test_checkpoint_concurrent_saves as concurrent
import test_checkpoint_races as races
from _overwrite_worker import build
from offload_adamw import checkpoint
from offload_adamw.checkpoint import CheckpointError
from test_checkpoint_races import MODES, values_of

fast_dir = races.fast_dir  # the same fixtures: tmpfs where there is one, one torch thread
one_thread = races.one_thread

WORKER = Path(__file__).resolve().parent / "support" / "_sharded_overwrite_worker.py"


@pytest.mark.slow  # about 6 s per mode: a writer process, torch imported twice, 100 loads
@pytest.mark.parametrize("mode", list(MODES))
def test_a_load_racing_an_overwrite_of_a_sharded_checkpoint_gets_one_whole_checkpoint(fast_dir, one_thread, mode):
    path, stop, ready = fast_dir / "c", fast_dir / "stop", fast_dir / "ready"
    env = {**os.environ, checkpoint.ENV_EXCHANGE: MODES[mode]}
    writer = subprocess.Popen([sys.executable, str(WORKER), str(path), str(stop), "1000000", str(ready)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    model, optimizer = build()
    seen: list[int] = []
    mixed: list[str] = []
    refused: list[str] = []
    try:
        waited = time.monotonic()
        while not ready.exists() and writer.poll() is None and time.monotonic() - waited < 120:
            time.sleep(0.01)
        assert ready.exists(), writer.communicate(timeout=60)[1][-3000:]
        started = time.monotonic()
        while len(seen) < 100 and time.monotonic() - started < 120:
            try:
                report = checkpoint.load(path, model, optimizer)
            except (CheckpointError, OSError) as exc:
                refused.append(f"{type(exc).__name__}: {exc}"[:300])
                seen.append(-1)
                continue
            values = values_of(report, model, optimizer)
            if len(values) != 1:
                mixed.append(f"step {report.step}: values {sorted(values)[:8]}")
            seen.append(report.step)
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err[-3000:]
    assert len(seen) == 100, (len(seen), refused[:2])
    assert len(set(seen)) >= 10, f"the writer hardly ran during the loads: {len(set(seen))} steps seen, {out} saves"
    assert not mixed and not refused, f"{len(mixed)} mixed ({mixed[:2]}), {len(refused)} refused ({refused[:2]})"


@pytest.mark.slow  # about 8 s: three forked writers, each with its own gloo group and FSDP2 model
def test_concurrent_sharded_saves_without_overwrite_one_wins_the_rest_are_refused(tmp_path):
    """As tests/test_checkpoint_concurrent_saves.py, with sharded saves: the publish window widened in 3 writers."""
    done = subprocess.run([sys.executable, str(concurrent.WORKER), str(tmp_path), str(concurrent.WORKERS),
                           str(concurrent.PATHS), "widen", "sharded"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout)
    concurrent.judge(tmp_path, outcomes, concurrent.PATHS)
    assert all(checkpoint.verify(tmp_path / f"c-{k}")["version"] == 2 for k in range(concurrent.PATHS))
