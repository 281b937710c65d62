"""N processes that save to the same paths with ``overwrite=False``, for tests/test_checkpoint_concurrent_saves.py.

    python _concurrent_save_worker.py ROOT N_WORKERS N_PATHS [widen] [sharded]

Imports torch once, then forks N_WORKERS processes (real processes, each with its own descriptors and
PID, as saves from separate training jobs are). Worker I saves, for each path ``ROOT/c-K`` (K = 0 ..
N_PATHS-1) in order, a checkpoint that holds ``I + 1`` everywhere a load reads (model, optimizer state,
recorded step, ``extra["id"]``) with ``overwrite=False``. With ``widen``, every worker stops just before
it publishes (at ``publication.publish``, after every check a save makes before it) until all workers
have reached that point for that path: the window between "nothing is there" and "publish" is then open
in every worker at once, every time. Prints one JSON list: per worker, per path, "ok" or the error's
type and message. ``OFFLOAD_ADAMW_CHECKPOINT_EXCHANGE=0`` in the environment turns renameat2 off (the
portable fallback). With ``sharded``, each worker's model is under ``fully_shard`` on a 1-rank gloo group of
its own, so that its saves write the sharded layout (DCP).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from _overwrite_worker import WIDTH, build, fill
from offload_adamw import checkpoint
from offload_adamw.checkpoint import publication

BARRIER_S = 60.0  # how long a worker waits for the others at the publish point before it goes on alone


def widen(root: Path, index: int, workers: int) -> None:
    """Wrap ``publication.publish`` so that every worker publishes path K only once all have reached it."""
    original = publication.publish

    def publish(tmp, final, *args, **kwargs):
        name = Path(final).name
        (root / f"arrived-{name}-{index}").touch()
        deadline = time.monotonic() + BARRIER_S
        while time.monotonic() < deadline:
            if all((root / f"arrived-{name}-{i}").exists() for i in range(workers)):
                break
            time.sleep(0.002)
        return original(tmp, final, *args, **kwargs)

    publication.publish = publish


def worker(root: Path, index: int, workers: int, paths: int, widened: bool, sharded: bool = False) -> list[str]:
    model, optimizer = build(sharded=sharded)
    value = index + 1
    fill(model, optimizer, value)
    if widened:
        widen(root, index, workers)
    outcomes: list[str] = []
    for k in range(paths):
        extra = {"id": value, "t": torch.full((WIDTH,), float(value))}
        try:
            checkpoint.save(root / f"c-{k}", model, optimizer, extra=extra, step=value, overwrite=False, rng=False)
            outcomes.append("ok")
        except Exception as exc:  # every failure is reported, the kind included: the test judges it
            outcomes.append(f"{type(exc).__name__}: {exc}")
    return outcomes


def main(root: Path, workers: int, paths: int, widened: bool, sharded: bool = False) -> int:
    torch.set_num_threads(1)  # before the forks: no thread pool to inherit half-started
    results = root / "results"
    results.mkdir()
    pids = []
    for index in range(workers):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                outcomes = worker(root, index, workers, paths, widened, sharded)
                (results / f"{index}.json").write_text(json.dumps(outcomes))
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    if any(statuses):
        print(f"worker exit statuses: {statuses}", file=sys.stderr)
        return 1
    print(json.dumps([json.loads((results / f"{i}.json").read_text()) for i in range(workers)]))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "widen" in sys.argv[4:], "sharded" in sys.argv[4:]))
