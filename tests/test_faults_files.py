"""Damaged checkpoints are refused with an error naming the file; the previous one still loads.

Also: a save that runs out of space (a file-size rlimit in a real subprocess;
a real 48 KiB tmpfs where this user may mount one) fails cleanly and leaves
the last good checkpoint as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import _checkpoint_files as files
from _fault_worker import build, train
from _parity import assert_same_snapshot
from offload_adamw import checkpoint
from offload_adamw.checkpoint import CheckpointCorrupt, CheckpointError

WORKER = Path(__file__).resolve().parent / "support" / "_fault_worker.py"
FILES = files.ONE_PROCESS_FILES


def snapshot(model, optimizer, scheduler) -> dict:
    """Every tensor and value that a load could change, copied."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    sd = optimizer.state_dict()
    for pid, state in sd["state"].items():
        for key, value in state.items():
            out[f"opt/{pid}/{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    out["groups"] = repr(sd["param_groups"])
    out["scheduler"] = repr(scheduler.state_dict())
    out["rng"] = torch.get_rng_state().clone()
    return out


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Checkpoints after 2 and after 4 steps, and the model state each holds."""
    root = tmp_path_factory.mktemp("ckpts")
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 2)
    first = checkpoint.save(root / "step-2", model, optimizer, scheduler, step=2)
    first_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train(model, optimizer, scheduler, 2)
    second = checkpoint.save(root / "step-4", model, optimizer, scheduler, step=4)
    return first, first_state, second


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "bitflip":
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "delete":
        path.unlink()
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["truncate", "bitflip", "delete"])
@pytest.mark.parametrize("name", FILES)
def test_damaged_file_is_refused_and_previous_checkpoint_loads(tmp_path, two_checkpoints, name, how):
    first, first_state, second = two_checkpoints
    broken = tmp_path / "broken"
    shutil.copytree(second, broken)
    damage(broken / name, how)

    model, optimizer, scheduler = build(seed=5)
    train(model, optimizer, scheduler, 1)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(CheckpointCorrupt) as info:
        checkpoint.load(broken, model, optimizer, scheduler)
    message = str(info.value)
    # The culprit is named: the data file itself, or the manifest / commit marker that vouches for it.
    if name == checkpoint.COMMIT_FILE:
        assert ("COMMIT" in message and "incomplete" in message) or "commit marker" in message, message
    elif name == checkpoint.MANIFEST_FILE:
        assert checkpoint.MANIFEST_FILE in message, message
    else:
        assert name in message, message
    assert_same_snapshot(snapshot(model, optimizer, scheduler), before)
    assert checkpoint.latest(tmp_path) is None  # the only candidate there is damaged

    report = checkpoint.load(first, model, optimizer, scheduler)
    assert report.step == 2 and report.ok
    for key, value in model.state_dict().items():
        assert torch.equal(value, first_state[key]), key


def test_latest_passes_over_a_damaged_newest(tmp_path, two_checkpoints):
    first, _, second = two_checkpoints
    shutil.copytree(first, tmp_path / "a")
    shutil.copytree(second, tmp_path / "b")
    shutil.copytree(second, tmp_path / "c-incomplete")
    (tmp_path / "c-incomplete" / checkpoint.COMMIT_FILE).unlink()
    assert checkpoint.latest(tmp_path) == tmp_path / "b"
    damage(tmp_path / "b" / files.SHARD, "bitflip")
    assert checkpoint.latest(tmp_path) == tmp_path / "a"
    assert checkpoint.latest(tmp_path, verify_files=False) == tmp_path / "b"


def test_file_size_limit_during_save_fails_cleanly(tmp_path):
    """RLIMIT_FSIZE in a real process: the write fails with EFBIG part-way through the save."""
    limit = 600  # bytes: more than meta of nothing, less than the model file
    result = subprocess.run(
        [sys.executable, str(WORKER), "diskfull", str(tmp_path), str(limit)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    for name in ("new", "overwrite"):
        error = report["errors"][name]
        assert error is not None, f"{name}: the save under a {limit}-byte limit did not fail"
        assert error["type"] == "CheckpointError"
        assert "nothing was published" in error["message"]
        assert "File too large" in error["message"] or "EFBIG" in error["cause"] or "too large" in error["cause"], error
    assert report["entries"] == ["good"]  # no half-written "next", no temporaries
    assert report["manifest_unchanged"] and report["restored_equal"]
    checkpoint.verify(tmp_path / "good")


def test_full_tmpfs_during_save_fails_cleanly(tmp_path):
    """A real full filesystem (ENOSPC), where this user may mount a small tmpfs."""
    mount = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mount)], capture_output=True).returncode
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        model, optimizer, scheduler = build()
        train(model, optimizer, scheduler, 2)
        good = checkpoint.save(mount / "good", model, optimizer, scheduler, step=2)
        kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
        train(model, optimizer, scheduler, 2)
        failures = 0
        for i in range(20):  # fill up: each further checkpoint takes space until one no longer fits
            try:
                checkpoint.save(mount / f"more-{i}", model, optimizer, scheduler)
            except CheckpointError as exc:
                assert "No space left on device" in str(exc) or "ENOSPC" in repr(exc.__cause__), str(exc)
                failures += 1
                break
        assert failures == 1, "the 48 KiB tmpfs never filled up"
        assert not [p.name for p in mount.iterdir() if p.name.startswith(".")], "temporaries left behind"
        with pytest.raises(CheckpointError):
            checkpoint.save(good, model, optimizer, scheduler, overwrite=True)
        fresh, fresh_opt, fresh_sched = build(seed=3)
        checkpoint.load(good, fresh, fresh_opt, fresh_sched)
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, kept[key]), key
    finally:
        subprocess.run(["umount", str(mount)], check=False)
