"""Crash-safe, name-keyed training checkpoints: safetensors and JSON, never pickle.

Contract:

* ``save(path, model, optimizer, scheduler=None, extra=None)`` writes a
  checkpoint *directory*::

      model.safetensors      the model's state by fully qualified name; a parameter
                             the optimizer keeps a master for is stored as that
                             float32 master (the source of truth), not its bf16 copy
      optimizer.safetensors  per-parameter optimizer state, keyed "<name>::<key>"
      aux.safetensors        every other tensor (RNG states, tensor hyperparameters,
                             scheduler and ``extra`` tensors)
      meta.json              the rest: parameter groups by name, hyperparameters,
                             scheduler state, step, RNG states, dtypes, ``extra``
      manifest.json          size and sha256 of each file above
      COMMIT                 written last: the sha256 of manifest.json

  It is built in a hidden sibling directory ``.NAME.tmp-OWNER-PID-TOKEN``
  (OWNER: this machine, boot and PID namespace, hashed), locked while it is
  written; every file and the directory are fsynced, then it is renamed onto
  ``path`` in one step. Replacing an existing checkpoint (``overwrite=True``)
  is one atomic exchange where the OS has ``renameat2(RENAME_EXCHANGE)``
  (Linux; ``OFFLOAD_ADAMW_CHECKPOINT_EXCHANGE=0`` turns it off). Elsewhere it
  is two renames, and between them the previous checkpoint waits at
  ``.NAME.prev-OWNER-PID-TOKEN``, where :func:`resolve`, :func:`latest` and
  :func:`load` find it. So a crash at any point leaves the previous checkpoint
  or the new one, never neither and never a mix; a failed save (full disk,
  file-size limit) raises :class:`CheckpointError` and leaves no trace.
* Each save first deletes what killed saves left in its directory, but only
  temporaries of this machine whose writer no longer runs, whose lock nobody
  holds and which hold nothing but checkpoint files (never another host's or
  container's save in progress, never a user's directory).
* ``load(path, model, optimizer, scheduler=None, strict=True)`` verifies the
  commit marker and every checksum before reading a tensor, parses only
  safetensors and JSON (so it never runs code from the file), checks the
  layout of meta.json and the stored tensors' own shapes and dtypes (anything
  malformed is :class:`CheckpointCorrupt` naming the file and key, never a bare
  TypeError or KeyError), and matches everything by name. Every missing, unexpected, wrong-shape or wrong-dtype
  entry and every parameter-group mismatch is collected into one
  :class:`CheckpointMismatch` naming each culprit, and then nothing has been
  changed: model, optimizer, scheduler and RNG are as before (everything is
  checked before the first of them is committed). ``strict=False``
  loads what matches, leaves the rest as it is, and returns the
  :class:`LoadReport`. The optimizer part goes through the optimizer's own
  ``load_state_dict`` (for OffloadAdamW: all or nothing, name-matched).

The pieces: :mod:`~offload_adamw.checkpoint.codec` (values as JSON and safetensors),
:mod:`~offload_adamw.checkpoint.publication` (fsync, exchange, locks, clean-up; no torch),
:mod:`~offload_adamw.checkpoint.layout` (file names) and :mod:`~offload_adamw.checkpoint.errors`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, TypeAlias, cast

import torch
from torch import Tensor

from offload_adamw.checkpoint import codec, publication
from offload_adamw.checkpoint.codec import check_meta, decode, encode, malformed, part
from offload_adamw.checkpoint.errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, LoadReport
from offload_adamw.checkpoint.layout import (
    AUX_FILE,
    COMMIT_FILE,
    DATA_FILES,
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    VERSION,
    dumps,
    is_count,
)
from offload_adamw.checkpoint.publication import ENV_EXCHANGE, TEMPORARY, TMP_TAG
from offload_adamw.contract.rules import MASTER_KEY

__all__ = [
    "AUX_FILE",
    "COMMIT_FILE",
    "DATA_FILES",
    "ENV_EXCHANGE",
    "FORMAT",
    "MANIFEST_FILE",
    "META_FILE",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "LoadReport",
    "latest",
    "load",
    "resolve",
    "save",
    "verify",
]

_KEY_SEP = "::"

PathLike: TypeAlias = str | os.PathLike

# The private names tests/test_faults_input.py reaches through this module.
_owner = publication.owner
_encode = encode
_decode = decode

def resolve(path: PathLike) -> Path | None:
    """The complete checkpoint that ``path`` stands for, or None.

    That is ``path`` itself when it holds a commit marker. Where a save without
    the atomic exchange was interrupted between its two renames, ``path`` is
    absent and the previous checkpoint sits at a hidden ``.NAME.prev-...``
    sibling: then that one (the newest that verifies, if several).
    """
    final = Path(path)
    if (final / COMMIT_FILE).is_file():
        return final
    best: tuple[int, str, Path] | None = None
    for entry in publication.previous_copies(final):
        try:
            meta = verify(entry)
        except CheckpointError:
            continue
        key = (meta["step"], entry.name, entry)
        if best is None or key > best:
            best = key
    return None if best is None else best[2]


# ------------------------------------------------------------------- save


def _model_entries(model: torch.nn.Module) -> tuple[dict[str, Tensor], dict[str, str], dict[str, Tensor]]:
    """(canonical name -> tensor, alias -> canonical name, every name -> tensor) of the model's state."""
    everything = model.state_dict(keep_vars=True)
    canonical: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, value in everything.items():
        if not isinstance(value, Tensor):
            raise CheckpointError(
                f"model state {name!r} is a {type(value).__name__}, not a tensor; it cannot be saved without pickling"
            )
        if id(value) in first_name:
            aliases[name] = first_name[id(value)]  # a tied weight: stored once
            continue
        first_name[id(value)] = name
        canonical[name] = value
    return canonical, aliases, everything


def _rng_states(aux: dict[str, Tensor]) -> dict[str, Any]:
    states: dict[str, Any] = {
        "torch": encode(torch.get_rng_state(), aux, "rng/torch"),
        "python": encode(random.getstate(), aux, "rng/python"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = encode(torch.cuda.get_rng_state_all(), aux, "rng/cuda")
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = encode(numpy.random.get_state(), aux, "rng/numpy")
    return states


def save(
    path: PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any = None,
    extra: Any = None,
    *,
    step: int | None = None,
    overwrite: bool = False,
    rng: bool = True,
) -> Path:
    """Write a checkpoint directory at ``path`` atomically; return its path.

    ``extra`` is any JSON value (tensors allowed inside). ``step`` defaults to
    the largest per-parameter update count of the optimizer. An existing
    ``path`` is replaced only with ``overwrite=True``. ``rng`` saves the torch,
    CUDA, Python and numpy RNG states. Raises :class:`CheckpointError` if
    something cannot be stored or written; then nothing was published.
    """
    final = Path(path).absolute()
    if final.exists() and not overwrite:
        raise CheckpointError(f"{final} exists; pass overwrite=True to replace it atomically")
    if final.exists():
        # overwrite=True replaces (and then deletes) only what a save could have written there.
        ours = {*DATA_FILES, MANIFEST_FILE, COMMIT_FILE}
        if not final.is_dir() or not {entry.name for entry in final.iterdir()} <= ours:
            raise CheckpointError(f"{final} is not a checkpoint directory; refusing to replace it")

    # Gather everything first: an unsaveable object fails before the disk is touched.
    canonical, aliases, _ = _model_entries(model)
    name_of = {id(t): name for name, t in canonical.items()}
    model_tensors: dict[str, Tensor] = {}
    optimizer_tensors: dict[str, Tensor] = {}
    aux: dict[str, Tensor] = {}
    has_masters = optimizer is not None and hasattr(optimizer, "master_value")
    optimized: set[int] = set()
    groups: list[dict[str, Any]] = []
    states: dict[str, Any] = {}
    if optimizer is not None:
        for gi, group in enumerate(optimizer.param_groups):
            names = []
            for index, p in enumerate(group["params"]):
                name = name_of.get(id(p))
                if name is None:
                    raise CheckpointError(
                        f"parameter {index} of optimizer group {gi} (shape {tuple(p.shape)}) is not in "
                        "model.state_dict(): every optimized tensor needs a name"
                    )
                names.append(name)
                optimized.add(id(p))
                state = optimizer.state.get(p)
                if state:
                    states[name] = {
                        key: encode(value, optimizer_tensors, f"{name}{_KEY_SEP}{key}")
                        for key, value in state.items()
                        if key != MASTER_KEY  # the master is the model entry
                    }
            hyper = {k: encode(v, aux, f"optimizer/{gi}/{k}") for k, v in group.items() if k not in ("params", "param_names")}
            groups.append({"param_names": names, "hyper": hyper})
    entries = {}
    for name, value in canonical.items():
        # has_masters: the optimizer defines master_value
        stored = cast(Any, optimizer).master_value(value) if has_masters and id(value) in optimized else value
        model_tensors[name] = stored
        entries[name] = {
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "stored_dtype": str(stored.dtype).removeprefix("torch."),
        }
    if step is None:
        counts = [
            int(s["step"])
            for s in (optimizer.state.values() if optimizer is not None else ())
            if isinstance(s.get("step"), (Tensor, int, float))
        ]
        step = max(counts, default=0)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(step),
        "torch": torch.__version__,
        "model": entries,
        "aliases": aliases,
        "optimizer": None if optimizer is None else {"class": type(optimizer).__name__, "groups": groups, "states": states},
        "scheduler": None
        if scheduler is None
        else {"class": type(scheduler).__name__, "state": encode(scheduler.state_dict(), aux, "scheduler")},
        "rng": _rng_states(aux) if rng else None,
        "extra": encode(extra, aux, "extra"),
    }
    meta_bytes = dumps(meta)

    final.parent.mkdir(parents=True, exist_ok=True)
    publication.remove_stale(final.parent)
    tmp = publication.temporary_name(final, TMP_TAG)
    lock = None
    try:
        tmp.mkdir()
        lock = publication.lock(tmp)
        codec.write_tensors(tmp / MODEL_FILE, model_tensors)
        codec.write_tensors(tmp / OPTIMIZER_FILE, optimizer_tensors)
        codec.write_tensors(tmp / AUX_FILE, aux)
        publication.write_bytes(tmp / META_FILE, meta_bytes)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "files": {
                name: {"bytes": (tmp / name).stat().st_size, "sha256": publication.file_sha256(tmp / name)}
                for name in DATA_FILES
            },
        }
        manifest_bytes = dumps(manifest)
        publication.write_bytes(tmp / MANIFEST_FILE, manifest_bytes)
        marker = {"format": FORMAT, "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
        publication.write_bytes(tmp / COMMIT_FILE, dumps(marker))
        publication.fsync_path(tmp, directory=True)
        if final.exists() and not overwrite:
            raise CheckpointError(f"{final} appeared while saving; pass overwrite=True to replace it")
        previous = publication.publish(tmp, final)
    except Exception as exc:
        publication.unlock(lock)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(
            f"could not write checkpoint {final}: {exc}; nothing was published and any previous checkpoint there is intact"
        ) from exc
    except BaseException:
        publication.unlock(lock)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publication.unlock(lock)
    publication.fsync_path(final.parent, directory=True)  # make the rename itself durable
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    return final


# ------------------------------------------------------------------- load


def verify(path: PathLike) -> dict[str, Any]:
    """Check the commit marker, the manifest and every file's size and sha256; return the metadata.

    Raises :class:`CheckpointCorrupt` naming every damaged file.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no checkpoint directory there")
    commit = root / COMMIT_FILE
    if not commit.is_file():
        raise CheckpointCorrupt(
            f"{root} is incomplete: it has no {COMMIT_FILE} marker (its save was interrupted); use an earlier checkpoint"
        )
    try:
        marker = json.loads(commit.read_bytes())
        expected_manifest = marker["manifest_sha256"]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{commit}: unreadable commit marker ({exc})") from exc
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointCorrupt(f"{root}: {MANIFEST_FILE} is missing")
    found = publication.file_sha256(manifest_path)
    if found != expected_manifest:
        raise CheckpointCorrupt(f"{manifest_path}: sha256 {found} does not match the commit marker ({expected_manifest})")
    try:
        manifest = json.loads(manifest_path.read_bytes())
        files = manifest["files"]
        for name in DATA_FILES:
            entry = files.get(name)
            if entry is not None and not (
                isinstance(entry, dict) and is_count(entry.get("bytes")) and isinstance(entry.get("sha256"), str)
            ):
                raise ValueError(f"the entry of {name} is not {{'bytes': int, 'sha256': str}}")
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{manifest_path}: malformed manifest ({exc!r})") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointCorrupt(
            f"{root}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
            f"expected {FORMAT!r} version {VERSION}"
        )
    damaged = []
    for name in DATA_FILES:
        entry = manifest["files"].get(name)
        file = root / name
        if entry is None:
            damaged.append(f"{name}: not in the manifest")
        elif not file.is_file():
            damaged.append(f"{name}: missing")
        elif file.stat().st_size != entry["bytes"]:
            damaged.append(f"{name}: {file.stat().st_size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)")
        elif publication.file_sha256(file) != entry["sha256"]:
            damaged.append(f"{name}: sha256 mismatch (the file changed after it was written)")
    if damaged:
        raise CheckpointCorrupt(f"refusing to load {root}: " + "; ".join(damaged))
    try:
        meta = json.loads((root / META_FILE).read_bytes())
    except RecursionError:
        raise CheckpointCorrupt(f"{root / META_FILE}: nested too deeply to read (malformed metadata)") from None
    except ValueError as exc:
        raise CheckpointCorrupt(f"{root / META_FILE}: not JSON ({exc})") from exc
    check_meta(root / META_FILE, meta)
    return meta


def _recorded_step(entry: Path) -> int:
    """The step a checkpoint's metadata records, for ordering; -1 where it cannot be read."""
    try:
        step = json.loads((entry / META_FILE).read_bytes())["step"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
        return -1
    return step if is_count(step) else -1


def latest(root: PathLike, *, verify_files: bool = True) -> Path | None:
    """The committed checkpoint directory under ``root`` with the highest step, or None.

    With ``verify_files`` a damaged or malformed checkpoint is passed over for
    the next newest one, with a RuntimeWarning saying why. Where a save without
    the atomic exchange was interrupted, the previous checkpoint it kept (see
    :func:`resolve`) is a candidate under its hidden name.
    """
    candidates = []
    base = Path(root)
    if not base.is_dir():
        return None
    for entry in base.iterdir():
        if entry.name.startswith("."):
            match = TEMPORARY.match(entry.name)
            if match is None or match["kind"] != "prev" or (base / match["target"] / COMMIT_FILE).is_file():
                continue
        if not (entry / COMMIT_FILE).is_file():
            continue
        candidates.append((_recorded_step(entry), entry.name, entry))
    for _, _, entry in sorted(candidates, reverse=True):
        if not verify_files:
            return entry
        try:
            verify(entry)
        except (CheckpointError, OSError) as exc:  # OSError: a file this process may not read
            warnings.warn(f"latest(): skipping {entry}: {exc}", RuntimeWarning, stacklevel=2)
            continue
        return entry
    return None


def load(
    path: PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any = None,
    strict: bool = True,
    *,
    rng: bool = True,
) -> LoadReport:
    """Restore a checkpoint written by :func:`save`, matched by name, all or nothing.

    ``optimizer=None`` or ``scheduler=None`` leaves that part out. With
    ``strict`` any problem raises :class:`CheckpointMismatch` and nothing is
    changed; without it, what matches is loaded, the rest stays as it was, and
    the report lists the problems. A damaged or malformed checkpoint raises
    :class:`CheckpointCorrupt` in both modes. ``rng`` restores the RNG states.

    Everything is read and checked first: the stored tensors' own shapes and
    dtypes (not only what meta.json says), the optimizer's state (by its own
    ``load_state_dict``), the scheduler's keys, the RNG states (on scratch
    generators). Then scheduler, optimizer, model and RNG are committed; a
    refusal on the way rolls back what came before it. A model tensor on the
    meta device (no storage) is a problem: nothing can be loaded into it.
    Where ``path`` is absent because a save without the atomic exchange was
    interrupted, the previous checkpoint it kept is loaded (:func:`resolve`);
    ``report.path`` says which directory was read.
    """
    requested = Path(path)
    root = resolve(requested) or requested
    meta = verify(root)
    meta_file = root / META_FILE
    model_saved = codec.read_tensors(root, MODEL_FILE)
    optimizer_saved = codec.read_tensors(root, OPTIMIZER_FILE)
    aux = codec.read_tensors(root, AUX_FILE)
    extra = decode(meta["extra"], aux, f"{meta_file}: extra")
    saved_entries: dict[str, Any] = meta["model"]
    saved_opt = meta["optimizer"]
    saved_sched = meta["scheduler"]
    rng_state = None
    if rng and meta["rng"] is not None:
        rng_state = decode(meta["rng"], aux, f"{meta_file}: rng")
        _check_rng(rng_state, meta_file)
    report = LoadReport(path=str(root), step=meta["step"], extra=extra)
    problems = report.problems

    # --- the stored tensors are what they are said to be
    for name, info in saved_entries.items():
        stored = model_saved.get(name)
        if stored is None:
            raise CheckpointCorrupt(f"{root / MODEL_FILE}: holds no tensor {name!r}, which {META_FILE} lists")
        declared = getattr(torch, info.get("stored_dtype", info["dtype"]))
        if list(stored.shape) != info["shape"] or stored.dtype != declared:
            raise CheckpointCorrupt(
                f"{root / MODEL_FILE}: {name!r} is {str(stored.dtype).removeprefix('torch.')} {tuple(stored.shape)}, "
                f"{META_FILE} says {str(declared).removeprefix('torch.')} {tuple(info['shape'])} (malformed metadata)"
            )
    for name in model_saved:
        if name not in saved_entries:
            raise CheckpointCorrupt(f"{root / MODEL_FILE}: holds {name!r}, which {META_FILE} does not list")

    # --- model entries, by name
    canonical, _, everything = _model_entries(model)
    matched: dict[str, Tensor] = {}
    present: set[int] = set()
    for name, info in saved_entries.items():
        target = everything.get(name)
        if target is None:
            report.unexpected.append(name)
            problems.append(f"unexpected {name!r}: in the checkpoint, not in the model")
            continue
        present.add(id(target))
        if target.is_meta:
            problems.append(
                f"meta device {name!r}: the model's tensor holds no storage, nothing can be loaded into it; "
                "materialize the model first (module.to_empty(device=...))"
            )
            continue
        if target.is_inference() or torch._debug_has_internal_overlap(target) == 1:
            # copy_ would raise half-way through the commit: refuse before anything changes
            problems.append(f"unwritable {name!r}: an inference-mode tensor or one whose elements share memory (expand)")
            continue
        saved_shape = tuple(model_saved[name].shape)  # the tensor's own shape, not the one meta.json declares
        if saved_shape != tuple(target.shape):
            report.wrong_shape[name] = (saved_shape, tuple(target.shape))
            problems.append(f"wrong shape {name!r}: {saved_shape} in the checkpoint, {tuple(target.shape)} in the model")
            continue
        own_dtype = str(target.dtype).removeprefix("torch.")
        if info["dtype"] != own_dtype:
            report.wrong_dtype[name] = (info["dtype"], own_dtype)
            problems.append(f"wrong dtype {name!r}: {info['dtype']} in the checkpoint, {own_dtype} in the model")
            continue
        matched[name] = target
    for name, target in canonical.items():
        if id(target) not in present:
            report.missing.append(name)
            problems.append(f"missing {name!r}: in the model, not in the checkpoint")

    # --- optimizer groups, by name
    name_of = {id(t): name for name, t in canonical.items()}
    loadable: set[str] = set()
    if optimizer is not None:
        if saved_opt is None:
            problems.append("the checkpoint has no optimizer state (it was saved with optimizer=None)")
        else:
            saved_groups = saved_opt["groups"]
            saved_group_of = {n: gi for gi, g in enumerate(saved_groups) for n in g["param_names"]}
            same_count = len(saved_groups) == len(optimizer.param_groups)
            if not same_count:
                problems.append(
                    f"the checkpoint has {len(saved_groups)} parameter group(s), the optimizer has {len(optimizer.param_groups)}"
                )
            optimized_here: set[str] = set()
            for gi, group in enumerate(optimizer.param_groups):
                for index, p in enumerate(group["params"]):
                    found = name_of.get(id(p))
                    if found is None:
                        problems.append(
                            f"parameter {index} of optimizer group {gi} (shape {tuple(p.shape)}) is not in model.state_dict()"
                        )
                        continue
                    name = found
                    optimized_here.add(name)
                    saved_gi = saved_group_of.get(name)
                    if name not in matched:
                        continue  # already reported as missing / wrong shape / wrong dtype
                    if saved_gi is None:
                        report.group_mismatch.append(name)
                        problems.append(f"group mismatch {name!r}: optimized in group {gi} here, not optimized in the checkpoint")
                    elif saved_gi != gi:
                        report.group_mismatch.append(name)
                        problems.append(f"group mismatch {name!r}: in group {saved_gi} of the checkpoint, group {gi} here")
                    elif same_count:
                        loadable.add(name)
            for name, saved_gi in saved_group_of.items():
                if name not in optimized_here and name in everything:
                    report.group_mismatch.append(name)
                    problems.append(
                        f"group mismatch {name!r}: optimized in group {saved_gi} of the checkpoint, not by this optimizer"
                    )
    sched_state = None
    if scheduler is not None:
        if saved_sched is None:
            problems.append("the checkpoint has no scheduler state (it was saved with scheduler=None)")
        elif saved_sched["class"] != type(scheduler).__name__:
            problems.append(f"scheduler: the checkpoint holds a {saved_sched['class']}, this is a {type(scheduler).__name__}")
        else:
            sched_state = decode(saved_sched["state"], aux, f"{meta_file}: scheduler/state")
            if not isinstance(sched_state, dict):
                raise malformed(f"{meta_file}: scheduler/state", f"must be an object, got {type(sched_state).__name__}")
            own_keys, saved_keys = set(scheduler.state_dict()), set(sched_state)
            if own_keys != saved_keys:
                problems.append(
                    f"scheduler {type(scheduler).__name__}: keys {sorted(saved_keys - own_keys)} only in the checkpoint, "
                    f"{sorted(own_keys - saved_keys)} only here"
                )
                sched_state = None
    if problems and strict:
        raise CheckpointMismatch(report)
    optimizer_state_dict = None
    if optimizer is not None and saved_opt is not None:
        optimizer_state_dict = _optimizer_state_dict(
            optimizer, saved_opt, name_of, loadable, matched, model_saved, optimizer_saved, aux, meta_file
        )

    # --- commit. Only the scheduler's and the optimizer's own load_state_dict can
    # still refuse: the scheduler goes first and is put back if the optimizer
    # refuses (which changes nothing of its own); model copies and RNG states were checked above.
    scheduler_before = copy.deepcopy(scheduler.state_dict()) if sched_state is not None else None
    if sched_state is not None:
        try:
            scheduler.load_state_dict(sched_state)
        except Exception as exc:
            scheduler.load_state_dict(scheduler_before)
            problems.append(f"scheduler {type(scheduler).__name__} refused its state: {type(exc).__name__}: {exc}")
            raise CheckpointMismatch(report) from exc
    if optimizer is not None and optimizer_state_dict is not None:  # the second implies the first
        try:
            optimizer.load_state_dict(optimizer_state_dict)
        except Exception as exc:  # StateDictMismatch, or torch's own checks
            if scheduler_before is not None:
                scheduler.load_state_dict(scheduler_before)
            problems.extend(getattr(exc, "problems", [f"{type(exc).__name__}: {exc}"]))
            raise CheckpointMismatch(report) from exc
        report.optimizer_restored = True
    report.scheduler_restored = sched_state is not None
    with torch.no_grad():
        for name, target in matched.items():
            target.copy_(model_saved[name])  # a bf16 parameter gets round-to-nearest of its master
    report.loaded = sorted(matched)
    if rng_state is not None:
        _restore_rng(rng_state, report)
    return report


def _check_rng(states: Any, file: Path) -> None:
    """Every saved RNG state is restorable: tried on scratch generators, so that the commit cannot fail."""
    if not isinstance(states, dict) or "torch" not in states or "python" not in states:
        raise CheckpointCorrupt(f"{file}: rng must hold the 'torch' and 'python' states (malformed metadata)")
    trials: dict[str, Any] = {
        "torch": lambda: torch.Generator().set_state(states["torch"]),
        "python": lambda: random.Random().setstate(states["python"]),
    }
    if "cuda" in states:
        trials["cuda"] = lambda: [torch.Generator().set_state(t) for t in states["cuda"]]  # same layout on the CPU: a byte tensor
    numpy = sys.modules.get("numpy")
    if "numpy" in states and numpy is not None:
        trials["numpy"] = lambda: numpy.random.RandomState().set_state(states["numpy"])
    for key, trial in trials.items():
        try:
            trial()
        except Exception as exc:
            raise CheckpointCorrupt(
                f"{file}: rng/{key} cannot be restored ({type(exc).__name__}: {exc}) (malformed metadata)"
            ) from exc


def _optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    saved_opt: dict[str, Any],
    name_of: dict[int, str],
    loadable: set[str],
    matched: dict[str, Tensor],
    model_saved: dict[str, Tensor],
    optimizer_saved: dict[str, Tensor],
    aux: dict[str, Tensor],
    meta_file: Path,
) -> dict[str, Any]:
    """A state_dict laid out in the optimizer's own current order, filled by name from the checkpoint.

    Parameters that do not match (strict=False only) keep their current state.
    Where a parameter's model value is loaded, its master is that value, so
    that model and optimizer agree.
    """
    saved_groups = saved_opt["groups"]
    same_count = len(saved_groups) == len(optimizer.param_groups)
    with_masters = hasattr(optimizer, "master_param")
    groups, state = [], {}
    pid = 0
    for gi, group in enumerate(optimizer.param_groups):
        if same_count:
            hyper = decode(saved_groups[gi]["hyper"], aux, f"{meta_file}: optimizer/groups/{gi}/hyper")
        else:
            hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        ids = []
        for p in group["params"]:
            name = name_of.get(id(p))
            if name in loadable:
                saved = saved_opt["states"].get(name)
                where = f"{meta_file}: optimizer/states/{part(name)}"
                entry = None if saved is None else dict(decode(saved, optimizer_saved, where))
            else:
                own = optimizer.state.get(p)
                entry = dict(own) if own else None
            if entry is not None:
                if with_masters and name in matched:
                    entry[MASTER_KEY] = model_saved[name]
                state[pid] = entry
            ids.append(pid)
            pid += 1
        out = dict(hyper)
        out["params"] = ids
        if "param_names" in group:
            out["param_names"] = list(group["param_names"])
        groups.append(out)
    return {"state": state, "param_groups": groups}


def _restore_rng(states: dict[str, Any], report: LoadReport) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in states and numpy is not None:
        numpy.random.set_state(states["numpy"])
    report.rng_restored = True
