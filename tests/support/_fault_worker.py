"""Training processes for the fault tests: train, checkpoint, die on cue, resume.

Also imported by the in-process checkpoint tests for its small model (``build``,
``train``). As a script it is one process that imports torch once and then
forks a child per training run: each child is a real process, killed with a
real SIGKILL, so that dozens of kill points fit in seconds.

Every run counts *events*: the start of a step, the end of backward, before
and after each kernel call (during the step), and before and after each file
write, fsync, rename/exchange and directory removal of a save. A child told
``kill_at=k`` sends itself SIGKILL at its k-th event; when that event is the end
of a file write, the file is first cut to half its length (a torn write). The
parent can also kill a child from outside after a random delay.

    python _fault_worker.py kills ROOT MODE N_KILLS N_DOUBLE N_TIMER SEED
        MODE "overwrite": one checkpoint directory replaced atomically at every save;
        MODE "fallback": the same without the atomic exchange (the two-rename path of file systems without it);
        MODE "series": one directory per save, the older ones pruned, resume from the newest valid.
        Prints one JSON object: the reference run's events and every faulted run.
    python _fault_worker.py diskfull ROOT LIMIT_BYTES
        Saves a good checkpoint, then saves again under RLIMIT_FSIZE=LIMIT_BYTES; prints JSON.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from offload_adamw import OffloadAdamW, checkpoint
from offload_adamw.checkpoint import codec as checkpoint_codec
from offload_adamw.checkpoint import publication as checkpoint_publication
from offload_adamw.checkpoint import sharded as checkpoint_sharded
from offload_adamw.optim import update as update_path

STEPS = 6
SAVE_EVERY = 2
CHILD_TIMEOUT_S = 60.0


class Net(torch.nn.Module):
    """float32 input layer (its own master), bfloat16 output layer (float32 master), dropout (uses the RNG)."""

    def __init__(self, hidden: int = 12, out_dtype: torch.dtype = torch.bfloat16, extra: bool = False):
        super().__init__()
        self.inp = torch.nn.Linear(6, hidden)
        self.out = torch.nn.Linear(hidden, 3).to(out_dtype)
        self.drop = torch.nn.Dropout(0.2)
        self.extra = torch.nn.Linear(3, 3) if extra else None

    def forward(self, x):
        h = self.drop(F.gelu(self.inp(x)))
        y = self.out(h.to(self.out.weight.dtype)).float()
        return self.extra(y) if self.extra is not None else y


def groups(model: torch.nn.Module, *, swap: bool = False) -> list[dict]:
    """Matrices with weight decay; vectors without, with amsgrad. ``swap`` puts inp.bias with the matrices."""
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if p.ndim > 1 or (swap and n == "inp.bias")]
    vecs = [(n, p) for n, p in named if not (p.ndim > 1 or (swap and n == "inp.bias"))]
    return [{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0, "amsgrad": True}]


def build(seed: int = 0, **net_options):
    torch.manual_seed(seed)
    random.seed(seed)  # Python reseeds its global RNG in every forked child: fix it as a training script would
    model = Net(**net_options)
    optimizer = OffloadAdamW(groups(model), lr=1e-2, pin_memory=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps: int) -> None:
    """``steps`` steps on batches drawn from the global RNG (so a resume must restore it)."""
    for _ in range(steps):
        _event("step: begin")
        x, y = torch.randn(5, 6), torch.randn(5, 3)
        ((model(x) - y) ** 2).mean().backward()
        _event("step: after backward")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------ events

_COUNT = 0
_KILL_AT: int | None = None
_LABELS: list[str] = []


def _event(label: str, torn: Path | None = None) -> None:
    global _COUNT
    _COUNT += 1
    if _KILL_AT is None:
        _LABELS.append(label)
        return
    if _COUNT == _KILL_AT:
        if torn is not None and torn.is_file():
            os.truncate(torn, torn.stat().st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)


def _instrument() -> None:
    """Wrap the save's file operations and the update kernel with events (in this process only)."""

    def wrap(owner, name, label, torn_arg=False):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            _event(f"{label} {name}: before")
            result = original(*args, **kwargs)
            _event(f"{label} {name}: after", torn=Path(args[0]) if torn_arg else None)
            return result

        setattr(owner, name, wrapped)

    wrap(checkpoint_sharded, "_write_shard", "save:", torn_arg=True)  # the shard: model and optimizer tensors
    wrap(checkpoint_codec, "write_tensors", "save:", torn_arg=True)  # the rank's own tensors (RNG, extra)
    wrap(checkpoint_publication, "write_bytes", "save:", torn_arg=True)
    for name in ("fsync_path", "publish", "exchange"):
        wrap(checkpoint_publication, name, "save:")
    wrap(os, "rename", "save:")
    wrap(shutil, "rmtree", "save:")
    wrap(update_path, "adamw_update_", "step:")


# -------------------------------------------------------------------- runs


def _resume_source(root: Path, mode: str) -> Path | None:
    if mode in ("overwrite", "fallback"):
        return checkpoint.resolve(root / "ckpt")
    return checkpoint.latest(root / "series")


def run(root: Path, mode: str) -> None:
    """Train to STEPS from the last complete checkpoint under ``root``, saving every SAVE_EVERY steps."""
    global _KILL_AT
    if mode == "fallback":
        os.environ[checkpoint_publication.ENV_EXCHANGE] = "0"
    model, optimizer, scheduler = build()
    start = 0
    source = _resume_source(root, mode)
    if source is not None:
        start = checkpoint.load(source, model, optimizer, scheduler).step
    with open(root / "resumes.jsonl", "a") as log:
        log.write(json.dumps({"pid": os.getpid(), "from_step": start, "order": time.monotonic_ns()}) + "\n")
    for step in range(start, STEPS):
        train(model, optimizer, scheduler, 1)
        done = step + 1
        if done % SAVE_EVERY:
            continue
        if mode in ("overwrite", "fallback"):
            checkpoint.save(root / "ckpt", model, optimizer, scheduler, step=done, overwrite=True)
        else:
            checkpoint.save(root / "series" / f"step-{done:04d}", model, optimizer, scheduler, step=done)
            for old in sorted((root / "series").glob("step-*"))[:-2]:
                shutil.rmtree(old)
        with open(root / "published.jsonl", "a") as log:  # after the save returned: a resume must start here or later
            log.write(json.dumps({"pid": os.getpid(), "step": done, "order": time.monotonic_ns()}) + "\n")
    _KILL_AT = -1  # the end state is written outside the fault window
    checkpoint.save(root / "final", model, optimizer, scheduler, step=STEPS, overwrite=True)
    # The model's own low-precision values, not only the masters in the checkpoint.
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "final_model.safetensors"))


def _fork(root: Path, mode: str, kill_at: int | None, timer_s: float | None = None) -> dict:
    """Run one training child; return how it ended."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            global _KILL_AT, _COUNT
            _COUNT, _KILL_AT = 0, kill_at
            torch.set_num_threads(1)
            run(root, mode)
        except BaseException as exc:  # report, never fall back into the parent's loop
            sys.stderr.write(f"child {os.getpid()} failed: {exc!r}\n")
            code = 3
        finally:
            os._exit(code)
    started = time.monotonic()
    timer_fired = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        elapsed = time.monotonic() - started
        if timer_s is not None and not timer_fired and elapsed >= timer_s:
            os.kill(pid, signal.SIGKILL)
            timer_fired = True
        if elapsed > CHILD_TIMEOUT_S:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"kill_at": kill_at, "ended": "timeout"}
        time.sleep(0.002)
    if os.WIFSIGNALED(status):
        return {"kill_at": kill_at, "timer_s": timer_s, "ended": "signal", "signal": os.WTERMSIG(status)}
    return {"kill_at": kill_at, "timer_s": timer_s, "ended": "exit", "code": os.WEXITSTATUS(status)}


def _warm_up(root: Path) -> None:
    """Run every code path once here, single-threaded, so that forked children start warm.

    With one thread no OpenMP pool exists yet, which keeps fork safe.
    """
    global _KILL_AT
    _KILL_AT = -1
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 1)
    checkpoint.load(checkpoint.save(root / "warm-up", model, optimizer, scheduler), model, optimizer, scheduler)
    shutil.rmtree(root / "warm-up")
    _KILL_AT = None


def _draw(rng: random.Random, population: list[int], k: int) -> list[int]:
    """k distinct kill points where there are enough, else k drawn with repetition (each run is its own)."""
    return rng.sample(population, k) if k <= len(population) else rng.choices(population, k=k)


def kills(root: Path, mode: str, n_kills: int, n_double: int, n_timer: int, seed: int) -> dict:
    rng = random.Random(seed)
    _warm_up(root)
    ref_dir = root / "reference"
    ref_dir.mkdir(parents=True)
    # The reference child records its event labels (with no kill point) to a file.
    pid = os.fork()
    if pid == 0:
        try:
            torch.set_num_threads(1)
            began = time.monotonic()
            run(ref_dir, mode)
            (ref_dir / "events.json").write_text(json.dumps({"labels": _LABELS, "seconds": time.monotonic() - began}))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    ref = json.loads((ref_dir / "events.json").read_text())
    labels = ref["labels"]
    save_events = [i + 1 for i, label in enumerate(labels) if label.startswith("save:")]
    step_events = [i + 1 for i, label in enumerate(labels) if label.startswith("step:")]
    half = n_kills // 2
    points = sorted(_draw(rng, save_events, half) + _draw(rng, step_events, n_kills - half))
    plans = [[k] for k in points]
    if mode == "fallback":  # every point of every publish without the exchange: around each rename and removal
        plans += [
            [i + 1] for i, label in enumerate(labels) if label.startswith(("save: rename", "save: rmtree", "save: publish"))
        ]
    plans += [[rng.choice(step_events + save_events), rng.randint(3, 40)] for _ in range(n_double)]
    runs = []
    for index, plan in enumerate(plans):
        work = root / f"run-{index:02d}"
        work.mkdir()
        ends = [_fork(work, mode, k) for k in plan]
        ends.append(_fork(work, mode, None))
        runs.append({"dir": str(work), "plan": plan, "first_label": labels[plan[0] - 1], "ends": ends})
    for index in range(n_timer):
        work = root / f"timer-{index:02d}"
        work.mkdir()
        delay = rng.uniform(0.0, ref["seconds"])
        ends = [_fork(work, mode, None, timer_s=delay), _fork(work, mode, None)]
        runs.append({"dir": str(work), "plan": [], "timer_s": delay, "ends": ends})
    return {"reference": str(ref_dir), "events": len(labels), "reference_seconds": ref["seconds"], "runs": runs}


def diskfull(root: Path, limit: int) -> dict:
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 2)
    good = checkpoint.save(root / "good", model, optimizer, scheduler, step=2)
    manifest_before = (good / checkpoint.MANIFEST_FILE).read_bytes()
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train(model, optimizer, scheduler, 2)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of killing
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    errors = {}
    for name, target, overwrite in (("new", root / "next", False), ("overwrite", good, True)):
        try:
            checkpoint.save(target, model, optimizer, scheduler, step=4, overwrite=overwrite)
            errors[name] = None
        except checkpoint.CheckpointError as exc:
            errors[name] = {"type": type(exc).__name__, "message": str(exc), "cause": repr(exc.__cause__)}
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    fresh, fresh_opt, fresh_sched = build(seed=1)
    checkpoint.load(good, fresh, fresh_opt, fresh_sched)
    restored = all(torch.equal(v, snapshot[k]) for k, v in fresh.state_dict().items())
    return {
        "errors": errors,
        "entries": sorted(p.name for p in root.iterdir()),
        "manifest_unchanged": (good / checkpoint.MANIFEST_FILE).read_bytes() == manifest_before,
        "restored_equal": restored,
    }


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    command, root = argv[0], Path(argv[1])
    if command == "kills":
        _instrument()
        mode, n_kills, n_double, n_timer, seed = argv[2], *map(int, argv[3:7])
        result = kills(root, mode, n_kills, n_double, n_timer, seed)
    elif command == "diskfull":
        result = diskfull(root, int(argv[2]))
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
