"""A load that races a save replacing the same checkpoint reads the old checkpoint or the new one, whole.

A writer process (tests/support/_overwrite_worker.py) replaces one checkpoint directory over and over
(``overwrite=True``), with the atomic exchange and with the two-rename fallback, its model plain or under
FSDP2 (a 1-rank gloo group: DTensors, DCP's sharded planning; the load into the plain model reshards);
this process loads it meanwhile, hundreds of times. Every save holds one value everywhere (model, optimizer moments and
step counts, recorded step, ``extra``), so every load must come back with one value everywhere (no
mix of two saves) and none may be refused as corrupt (nothing was damaged). The two interleavings
that matter are also made to happen every time: the directory replaced after the load opened it,
and while it was opening it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from _overwrite_worker import WIDTH, build, fill
from offload_adamw import checkpoint
from offload_adamw.checkpoint import CheckpointError, publication

WORKER = Path(__file__).resolve().parent / "support" / "_overwrite_worker.py"
MODES = {"exchange": "1", "fallback": "0"}


@pytest.fixture
def one_thread():
    """One torch thread in this process too: the writer and the loads share two cores without spinning."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fast_dir(tmp_path):
    """tmpfs where there is one (fsync is free there, so the writer saves many times a second)."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="offload-adamw-races-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def values_of(report, model, optimizer) -> set[float]:
    """Every value a load restored, as a set: one element for a whole checkpoint."""
    values = {float(report.step), float(report.extra["id"])}
    values.update(report.extra["t"].unique().tolist())
    for p in model.parameters():
        values.update(p.detach().unique().tolist())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            values.update(optimizer.state[p][key].unique().tolist())
    return values


def race(root: Path, mode: str, loads: int, limit_s: float, writer_kind: str = "plain") -> dict:
    """Load ``root / "c"`` ``loads`` times (for at most ``limit_s``) while a writer replaces it; what was seen."""
    path, stop, ready = root / "c", root / "stop", root / "ready"
    env = {**os.environ, checkpoint.ENV_EXCHANGE: MODES[mode]}
    kind = ["sharded"] if writer_kind == "sharded" else []
    subprocess.run([sys.executable, str(WORKER), str(path), str(stop), "1", *kind], env=env, check=True, timeout=120)
    writer = subprocess.Popen([sys.executable, str(WORKER), str(path), str(stop), "1000000", str(ready), *kind],
                              env=env, stdout=subprocess.PIPE, text=True)
    model, optimizer = build()
    waited = time.monotonic()
    while not ready.exists() and writer.poll() is None and time.monotonic() - waited < 120:
        time.sleep(0.01)  # the writer imports torch first: the loads race its saves only from here on
    seen: list[int] = []
    mixed: list[str] = []
    refused: list[str] = []
    try:
        started = time.monotonic()
        while len(seen) < loads and time.monotonic() - started < limit_s:
            try:
                report = checkpoint.load(path, model, optimizer)
            except (CheckpointError, OSError) as exc:  # OSError: a file gone between two reads
                refused.append(f"{type(exc).__name__}: {exc}"[:300])
                seen.append(-1)
                continue
            values = values_of(report, model, optimizer)
            if len(values) != 1:
                mixed.append(f"step {report.step}, extra {report.extra['id']}: values {sorted(values)[:8]}")
            seen.append(report.step)
    finally:
        stop.touch()
        saves = int(writer.communicate(timeout=60)[0])
    assert writer.returncode == 0
    return {"loads": len(seen), "saves": saves, "distinct": len(set(seen)), "mixed": mixed, "refused": refused}


#: writer -> (loads, the fewest distinct checkpoints they must have seen): a sharded save takes longer
WRITERS = {"plain": (300, 20), "sharded": (100, 10)}


@pytest.mark.parametrize("writer", [w if w == "plain" else pytest.param(w, marks=pytest.mark.slow) for w in WRITERS])
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m == "fallback" else m for m in MODES])
def test_a_load_racing_an_overwrite_gets_one_whole_checkpoint(fast_dir, one_thread, mode, writer):
    loads, distinct = WRITERS[writer]
    seen = race(fast_dir, mode, loads=loads, limit_s=240, writer_kind=writer)
    assert seen["loads"] == loads, seen
    assert seen["distinct"] >= distinct, f"the writer hardly ran during the loads: {seen}"  # a race really took place
    assert not seen["mixed"] and not seen["refused"], (
        f"of {seen['loads']} loads, {len(seen['mixed'])} mixed two checkpoints ({seen['mixed'][:2]}) "
        f"and {len(seen['refused'])} were refused ({seen['refused'][:2]})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_soak_3000_loads_racing_overwrites(fast_dir, one_thread, mode):
    seen = race(fast_dir, mode, loads=3000, limit_s=1800)
    assert seen["loads"] == 3000 and not seen["mixed"] and not seen["refused"], seen


# ------------------------------------------------- the same interleavings, made to happen every time


def _save(path: Path, model, optimizer, value: int) -> None:
    fill(model, optimizer, value)
    extra = {"id": value, "t": torch.full((WIDTH,), float(value))}
    checkpoint.save(path, model, optimizer, extra=extra, step=value, overwrite=True, rng=False)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_checkpoint_replaced_after_it_was_opened_is_read_as_it_was(tmp_path, monkeypatch, mode):
    """The save replacing (and deleting) the directory runs between the load's opening and its checksums."""
    monkeypatch.setenv(checkpoint.ENV_EXCHANGE, MODES[mode])
    path = tmp_path / "c"
    writer_model, writer_opt = build()
    _save(path, writer_model, writer_opt, 1)
    check_files = publication.check_files

    def replace_first(snapshot, entries, names):
        monkeypatch.setattr(publication, "check_files", check_files)
        _save(path, writer_model, writer_opt, 2)
        return check_files(snapshot, entries, names)

    monkeypatch.setattr(publication, "check_files", replace_first)
    model, optimizer = build()
    report = checkpoint.load(path, model, optimizer)
    assert values_of(report, model, optimizer) == {1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # the replaced one is gone from the disk all the same
    report = checkpoint.load(path, model, optimizer)
    assert values_of(report, model, optimizer) == {2.0}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_checkpoint_replaced_while_it_is_opened_is_opened_again(tmp_path, monkeypatch, mode):
    """The save runs after the load opened the directory, before it opened a file: it opens the new one."""
    monkeypatch.setenv(checkpoint.ENV_EXCHANGE, MODES[mode])
    path = tmp_path / "c"
    writer_model, writer_opt = build()
    _save(path, writer_model, writer_opt, 1)
    open_file = publication.Snapshot._open

    def replace_first(self, name):
        monkeypatch.setattr(publication.Snapshot, "_open", open_file)
        _save(path, writer_model, writer_opt, 2)  # the directory opened is deleted now, every file with it
        return open_file(self, name)

    monkeypatch.setattr(publication.Snapshot, "_open", replace_first)
    model, optimizer = build()
    report = checkpoint.load(path, model, optimizer)
    assert values_of(report, model, optimizer) == {2.0}
