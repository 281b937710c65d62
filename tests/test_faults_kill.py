"""Training killed with SIGKILL at many points, then resumed, ends bitwise equal to an uninterrupted run.

Modes: one directory replaced at every save, with the atomic exchange
("overwrite") and with the two-rename fallback of file systems without it
("fallback", where every point of every publish is killed too); one directory
per save ("series"). No resume ever starts before a save that had returned:
the previous checkpoint or the new one is there at every moment.

One worker process per mode (tests/support/_fault_worker.py) forks a real child per
training run. Kill points are drawn (seeded) from the events of an
uninterrupted reference run, half during saves (before/after every file
write, fsync, rename, exchange, removal; torn files included) and half during
steps (before/after backward and each kernel call); some runs are killed twice,
and some are killed from outside after a random delay. Each run then resumes
from its last complete checkpoint and finishes; its final checkpoint and model
must equal the reference bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import _checkpoint_files as files
from configs import assert_bitwise_equal
from offload_adamw import checkpoint

WORKER = Path(__file__).resolve().parent / "support" / "_fault_worker.py"
KILLS = {"overwrite": 14, "fallback": 14, "series": 10}  # kill points per mode (38 in all), plus double and timer kills
DOUBLE, TIMER = 2, 3


@pytest.fixture
def fast_dir(tmp_path):
    """A directory in tmpfs where there is one: a SIGKILL keeps the page cache, so fsync's cost buys nothing here."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="offload-adamw-faults-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)



def assert_same_end_state(run_dir: Path, ref_dir: Path) -> None:
    ref, got = ref_dir / "final", run_dir / "final"
    meta_ref, meta_got = checkpoint.verify(ref), checkpoint.verify(got)
    assert meta_got == meta_ref, f"{run_dir}: metadata (groups, scheduler, RNG, step) differs"
    for name in files.ONE_PROCESS_FILES:
        if name.endswith(".safetensors"):  # the shard (model, optimizer) and the rank's own (RNG, scheduler, extra)
            a, b = load_file(str(got / name)), load_file(str(ref / name))
            assert a.keys() == b.keys(), (run_dir, name)
            for key in b:
                assert_bitwise_equal(a[key], b[key], f"{run_dir}: {name} {key} differs from the uninterrupted run")
        elif name.startswith("rank-"):
            assert json.loads((got / name).read_text()) == json.loads((ref / name).read_text()), (run_dir, name)
    a, b = load_file(str(run_dir / "final_model.safetensors")), load_file(str(ref_dir / "final_model.safetensors"))
    for key in b:
        assert_bitwise_equal(a[key], b[key], f"{run_dir}: model value {key} differs")


def published_before_each_start(run_dir: Path) -> list[tuple[int, int]]:
    """(last step whose save had returned before a start, the step that start resumed from), per start."""
    published = (
        [json.loads(line) for line in (run_dir / "published.jsonl").read_text().splitlines()]
        if (run_dir / "published.jsonl").exists()
        else []
    )
    starts = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    out = []
    for start in starts:
        earlier = [p["step"] for p in published if p["order"] < start["order"]]
        out.append((max(earlier, default=0), start["from_step"]))
    return out


def run_worker(root: Path, mode: str, n_kills: int, n_double: int, n_timer: int, seed: int, timeout: float) -> dict:
    result = subprocess.run(
        [sys.executable, str(WORKER), "kills", str(root), mode, str(n_kills), str(n_double), str(n_timer), str(seed)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def check_runs(report: dict, mode: str, n_kills: int, n_double: int) -> dict:
    """Every run ended bitwise equal to the reference, resumed no earlier than its last returned save; the figures."""
    ref_dir = Path(report["reference"])
    runs = report["runs"]
    planned = [r for r in runs if r["plan"]]
    killed_first = [
        r
        for r in planned
        if r["ends"][0] == {"kill_at": r["plan"][0], "timer_s": None, "ended": "signal", "signal": signal.SIGKILL}
    ]
    every_publish_point = sum(r["first_label"].startswith(("save: rename", "save: rmtree", "save: publish")) for r in planned)
    assert len(killed_first) == len(planned), [r["ends"][0] for r in planned]
    assert len(planned) >= n_kills + n_double
    if mode == "fallback":
        assert every_publish_point >= 2 * 8  # two replacing saves, each: publish, two renames, a removal, before and after
    labels = [r["first_label"] for r in planned]
    assert sum(label.startswith("save:") for label in labels) >= n_kills // 2
    assert sum(label.startswith("step:") for label in labels) >= n_kills // 2
    kills = resumes = 0
    for r in runs:
        run_dir = Path(r["dir"])
        *faulted, last = r["ends"]
        assert last["ended"] == "exit" and last["code"] == 0, (run_dir, r["ends"])
        for end in faulted:
            assert end["ended"] in ("signal", "exit"), (run_dir, end)  # a late timer or second kill may miss
            assert end["ended"] == "exit" or end["signal"] == signal.SIGKILL
            kills += end["ended"] == "signal"
        assert_same_end_state(run_dir, ref_dir)
        # The previous checkpoint or the new one, never neither: no start goes back before a save that had returned.
        starts = published_before_each_start(run_dir)
        for saved, resumed_from in starts:
            assert resumed_from >= saved, (run_dir, r["ends"], saved, resumed_from)
        resumes += sum(resumed_from > 0 for _, resumed_from in starts)
        # Killed saves leave no temporary directories behind once a later save has run.
        leftovers = [p.name for p in run_dir.rglob(".*")]
        assert not leftovers, (run_dir, leftovers)
    assert kills >= n_kills + n_double

    # Resumes really came from checkpoints (not only from scratch), including after a kill inside a save.
    resumed = []
    for r in planned:
        starts = [json.loads(line)["from_step"] for line in (Path(r["dir"]) / "resumes.jsonl").read_text().splitlines()]
        resumed.append(starts[-1])
    assert any(step > 0 for step in resumed)
    assert any(r["first_label"].startswith("save:") and s > 0 for r, s in zip(planned, resumed))
    return {"runs": len(runs), "kills": kills, "resumes_from_a_checkpoint": resumes, "bitwise_equal_runs": len(runs)}


@pytest.mark.parametrize("mode", ["overwrite", pytest.param("fallback", marks=pytest.mark.slow),
                                  pytest.param("series", marks=pytest.mark.slow)])
def test_sigkill_anywhere_then_resume_is_bitwise_equal(fast_dir, mode):
    report = run_worker(fast_dir / mode, mode, KILLS[mode], DOUBLE, TIMER, 7, timeout=240)
    check_runs(report, mode, KILLS[mode], DOUBLE)


SOAK = {"overwrite": 70, "fallback": 70, "series": 60}  # 200 random kill points, plus double and timer kills


@pytest.mark.slow
def test_soak_200_random_sigkills_resume_bitwise(fast_dir):
    """200 random SIGKILLs (half in saves, half in steps) over the three modes; figures printed (-s) and returned."""
    started = time.monotonic()
    totals: dict[str, int] = {}
    for index, (mode, n) in enumerate(SOAK.items()):
        report = run_worker(fast_dir / mode, mode, n, 5, 5, 1000 + index, timeout=1800)
        for key, value in check_runs(report, mode, n, 5).items():
            totals[key] = totals.get(key, 0) + value
    totals["seconds"] = round(time.monotonic() - started, 1)
    print("soak:", json.dumps(totals))
