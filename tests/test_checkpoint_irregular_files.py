"""Something other than a regular file where a checkpoint has a file is refused by name, never opened.

A FIFO, a directory or a symbolic link in place of each of the six files a checkpoint holds: ``verify``
and ``load`` raise CheckpointCorrupt naming the file and what it is, and ``latest`` passes over that
checkpoint with a warning saying the same, for the older one. Opening a FIFO for reading blocks until a
writer comes, so every call here runs in a thread with a time limit: past it, the FIFO is opened for
writing (which releases the blocked reader) and the test fails instead of hanging.

Also: a save whose path lies under a file names that file (nothing is written).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import _checkpoint_files as files
from _fault_worker import build, train
from offload_adamw import checkpoint
from offload_adamw.checkpoint import CheckpointCorrupt, CheckpointError

FILES = files.ONE_PROCESS_FILES
KINDS = {"fifo": "FIFO", "directory": "directory", "symlink": "symbolic link"}
LIMIT_S = 10.0  # a call that takes longer is blocked (they take milliseconds)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    """Two intact checkpoints, of steps 2 and 4."""
    root = tmp_path_factory.mktemp("good")
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 2)
    first = checkpoint.save(root / "step-2", model, optimizer, scheduler, step=2)
    train(model, optimizer, scheduler, 2)
    return first, checkpoint.save(root / "step-4", model, optimizer, scheduler, step=4)


def put_in_place(path: Path, kind: str, aside: Path) -> None:
    """Replace the file ``path`` with a FIFO, a directory, or a symbolic link to the same bytes moved ``aside``."""
    if kind == "symlink":
        aside.mkdir(exist_ok=True)
        moved = shutil.move(str(path), str(aside / path.name))
        os.symlink(moved, path)
        return
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()


def bounded(call: Callable[[], Any], fifo: Path | None) -> Any:
    """``call()`` in a thread, given LIMIT_S; a call blocked past it on ``fifo`` is released, and the test fails."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    if thread.is_alive():
        released = time.monotonic()
        while thread.is_alive() and fifo is not None and time.monotonic() - released < 30:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer that closes: the reader gets EOF
            except OSError:
                pass
            thread.join(0.05)
        pytest.fail(f"blocked for {LIMIT_S:g} s (opened {fifo})")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def assert_names(message: str, name: str, kind: str) -> None:
    assert name in message and KINDS[kind] in message and "not a regular file" in message, message


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", FILES)
def test_a_non_regular_file_is_refused_by_name_never_opened(tmp_path, good, name, kind):
    older = shutil.copytree(good[0], tmp_path / "root" / "step-2")
    bad = shutil.copytree(good[1], tmp_path / "root" / "step-4")
    put_in_place(bad / name, kind, tmp_path / "aside")
    fifo = bad / name if kind == "fifo" else None

    with pytest.raises(CheckpointCorrupt) as verified:
        bounded(lambda: checkpoint.verify(bad), fifo)
    assert_names(str(verified.value), name, kind)

    model, optimizer, scheduler = build(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointCorrupt) as loaded:
        bounded(lambda: checkpoint.load(bad, model, optimizer, scheduler), fifo)
    assert_names(str(loaded.value), name, kind)
    assert all((model.state_dict()[k] == v).all() for k, v in before.items())  # nothing changed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = bounded(lambda: checkpoint.latest(tmp_path / "root"), fifo)
    assert found == older
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and str(bad) in said[0], said
    assert_names(said[0], name, kind)


def test_a_checkpoint_path_that_is_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "c")
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        bounded(lambda: checkpoint.verify(tmp_path / "c"), tmp_path / "c")
    model, optimizer, scheduler = build()
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        bounded(lambda: checkpoint.load(tmp_path / "c", model, optimizer, scheduler), tmp_path / "c")
    assert bounded(lambda: checkpoint.latest(tmp_path), tmp_path / "c") is None


@pytest.mark.parametrize("under", ["afile/sub", "afile/deeper/sub"])
def test_a_save_under_a_file_names_the_file(tmp_path, under):
    (tmp_path / "afile").write_text("not a directory")
    model, optimizer, scheduler = build()
    with pytest.raises(CheckpointError) as refused:
        checkpoint.save(tmp_path / under, model, optimizer, scheduler)
    message = str(refused.value)
    assert f"{tmp_path / 'afile'} is a file, not a directory" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_text() == "not a directory"
