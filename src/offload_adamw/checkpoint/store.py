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

  It is built in a hidden sibling directory, every file and the directory are
  fsynced, then it is renamed onto ``path`` in one step. Replacing an existing
  checkpoint (``overwrite=True``) is one atomic exchange where the OS has
  ``renameat2(RENAME_EXCHANGE)`` (Linux). A crash at any point leaves either
  the previous checkpoint or the new one at ``path``, never a mix; a failed
  save (full disk, file-size limit) raises :class:`CheckpointError` and leaves
  no trace.
* ``load(path, model, optimizer, scheduler=None, strict=True)`` verifies the
  commit marker and every checksum before reading a tensor, parses only
  safetensors and JSON (so it never runs code from the file), and matches
  everything by name. Every missing, unexpected, wrong-shape or wrong-dtype
  entry and every parameter-group mismatch is collected into one
  :class:`CheckpointMismatch` naming each culprit, and then nothing has been
  changed: model, optimizer, scheduler and RNG are as before. ``strict=False``
  loads what matches, leaves the rest as it is, and returns the
  :class:`LoadReport`. The optimizer part goes through the optimizer's own
  ``load_state_dict`` (for OffloadAdamW: all or nothing, name-matched).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import random
import secrets
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import load_file, save_file

from offload_adamw.contract.rules import MASTER_KEY
from torch import Tensor

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "LoadReport",
    "latest",
    "load",
    "save",
    "verify",
]

FORMAT = "offload-adamw-checkpoint"
VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
AUX_FILE = "aux.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
COMMIT_FILE = "COMMIT"
DATA_FILES = (MODEL_FILE, OPTIMIZER_FILE, AUX_FILE, META_FILE)
_KEY_SEP = "::"
_TMP_TAG = ".tmp-"
_PREV_TAG = ".prev-"

PathLike = Union[str, os.PathLike]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint is incomplete or damaged (no commit marker, a checksum or size mismatch)."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A checkpoint that does not fit the model/optimizer/scheduler; ``report`` names every culprit."""

    def __init__(self, report: "LoadReport"):
        self.report = report
        lines = "\n  - ".join(report.problems)
        super().__init__(
            f"cannot load checkpoint {report.path} ({len(report.problems)} problem(s)); "
            f"model, optimizer and scheduler were not changed:\n  - {lines}"
        )


@dataclass
class LoadReport:
    """What ``load`` found and did. Entry names are fully qualified model state names."""

    path: str
    """The checkpoint directory."""
    step: Optional[int] = None
    """The training step recorded at save time."""
    extra: Any = None
    """The ``extra`` object given to ``save``."""
    loaded: list[str] = field(default_factory=list)
    """Model entries restored from the checkpoint."""
    missing: list[str] = field(default_factory=list)
    """Model entries with no counterpart in the checkpoint."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint entries with no counterpart in the model."""
    wrong_shape: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    """name -> (shape in the checkpoint, shape in the model)."""
    wrong_dtype: dict[str, tuple[str, str]] = field(default_factory=dict)
    """name -> (dtype in the checkpoint, dtype in the model)."""
    group_mismatch: list[str] = field(default_factory=list)
    """Parameters optimized in another group (or not at all) on one side."""
    problems: list[str] = field(default_factory=list)
    """One sentence per problem, naming its culprit; empty when everything matched."""
    optimizer_restored: bool = False
    """Whether the optimizer's groups and states were replaced."""
    scheduler_restored: bool = False
    """Whether the scheduler's state was replaced."""
    rng_restored: bool = False
    """Whether the RNG states were restored."""

    @property
    def ok(self) -> bool:
        return not self.problems


# --------------------------------------------------------------- JSON codec
# Tensors go to a safetensors file and JSON keeps a reference; tuples, dicts
# with non-string keys and numpy arrays are tagged so that they come back as
# the same types. Nothing else is accepted: no pickling, ever.


def _encode(obj: Any, tensors: dict[str, Tensor], where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Tensor):
        tensors[where] = obj.detach()
        return {"__tensor__": where}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{where}/{k}") for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors, f"{where}/k{i}"), _encode(v, tensors, f"{where}/v{i}")] for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if type(obj).__module__ == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            tensors[where] = torch.from_numpy(obj.astype(np.int64) if obj.dtype.kind in "ui" else obj.copy())
            return {"__ndarray__": where, "dtype": str(obj.dtype)}
        if isinstance(obj, np.generic):
            return obj.item()
    raise CheckpointError(
        f"cannot save {where!r}: a {type(obj).__name__} is neither a tensor nor a JSON value "
        "(checkpoints never pickle)"
    )


def _decode(obj: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    if "__dtype__" in obj:
        return getattr(torch, obj["__dtype__"])
    if "__ndarray__" in obj:
        import numpy as np

        return tensors[obj["__ndarray__"]].numpy().astype(np.dtype(obj["dtype"]))
    return {k: _decode(v, tensors) for k, v in obj.items()}


# ------------------------------------------------------------------ files
# Module-level functions so that the fault tests can stop a process between any two of them.


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _host_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous host tensors with no two sharing memory (safetensors refuses shared storage)."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def _write_tensors(path: Path, tensors: dict[str, Tensor]) -> None:
    save_file(_host_tensors(tensors), str(path), metadata={"format": FORMAT})
    _fsync_path(path)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, allow_nan=True).encode()


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically; False where the OS or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _publish(tmp: Path, final: Path) -> Optional[Path]:
    """Move the finished ``tmp`` onto ``final``; return the directory that now holds the old one."""
    if not final.exists():
        os.rename(tmp, final)
        return None
    if _exchange(tmp, final):
        return tmp  # after the swap the temporary name holds the previous checkpoint
    # No atomic exchange here: for a moment ``final`` is absent and the previous
    # checkpoint sits at the .prev- name, which the next save does not delete.
    previous = final.with_name(f".{final.name}{_PREV_TAG}{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(final, previous)
    os.rename(tmp, final)
    return previous


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(parent: Path) -> None:
    """Delete what killed saves left in ``parent``: temporaries of processes that no longer run.

    A ``.NAME.tmp-PID-*`` directory is never the only complete copy of anything
    (after an exchange it holds the replaced checkpoint), so it goes once its
    writer is dead. A ``.NAME.prev-PID-*`` directory (no atomic exchange) may
    be, so it goes only once ``NAME`` is complete again.
    """
    for entry in parent.iterdir():
        name = entry.name
        if not name.startswith("."):
            continue
        for tag in (_TMP_TAG, _PREV_TAG):
            target, found, rest = name[1:].rpartition(tag)
            if not found:
                continue
            try:
                pid = int(rest.split("-", 1)[0])
            except ValueError:
                break
            if tag == _PREV_TAG and not (parent / target / COMMIT_FILE).is_file():
                break
            if pid != os.getpid() and not _pid_alive(pid):
                shutil.rmtree(entry, ignore_errors=True)
            break


# ------------------------------------------------------------------- save


def _model_entries(model: torch.nn.Module) -> tuple[dict[str, Tensor], dict[str, str], dict[str, Tensor]]:
    """(canonical name -> tensor, alias -> canonical name, every name -> tensor) of the model's state."""
    everything = model.state_dict(keep_vars=True)
    canonical: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, value in everything.items():
        if not isinstance(value, Tensor):
            raise CheckpointError(f"model state {name!r} is a {type(value).__name__}, not a tensor; it cannot be saved without pickling")
        if id(value) in first_name:
            aliases[name] = first_name[id(value)]  # a tied weight: stored once
            continue
        first_name[id(value)] = name
        canonical[name] = value
    return canonical, aliases, everything


def _rng_states(aux: dict[str, Tensor]) -> dict[str, Any]:
    states: dict[str, Any] = {
        "torch": _encode(torch.get_rng_state(), aux, "rng/torch"),
        "python": _encode(random.getstate(), aux, "rng/python"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = _encode(torch.cuda.get_rng_state_all(), aux, "rng/cuda")
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = _encode(numpy.random.get_state(), aux, "rng/numpy")
    return states


def save(
    path: PathLike,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    scheduler: Any = None,
    extra: Any = None,
    *,
    step: Optional[int] = None,
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
                        key: _encode(value, optimizer_tensors, f"{name}{_KEY_SEP}{key}")
                        for key, value in state.items()
                        if key != MASTER_KEY  # the master is the model entry
                    }
            hyper = {k: _encode(v, aux, f"optimizer/{gi}/{k}") for k, v in group.items() if k not in ("params", "param_names")}
            groups.append({"param_names": names, "hyper": hyper})
    entries = {}
    for name, value in canonical.items():
        stored = optimizer.master_value(value) if has_masters and id(value) in optimized else value
        model_tensors[name] = stored
        entries[name] = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape), "stored_dtype": str(stored.dtype).removeprefix("torch.")}
    if step is None:
        counts = [int(s["step"]) for s in (optimizer.state.values() if optimizer is not None else ()) if isinstance(s.get("step"), (Tensor, int, float))]
        step = max(counts, default=0)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(step),
        "torch": torch.__version__,
        "model": entries,
        "aliases": aliases,
        "optimizer": None if optimizer is None else {"class": type(optimizer).__name__, "groups": groups, "states": states},
        "scheduler": None if scheduler is None else {"class": type(scheduler).__name__, "state": _encode(scheduler.state_dict(), aux, "scheduler")},
        "rng": _rng_states(aux) if rng else None,
        "extra": _encode(extra, aux, "extra"),
    }
    meta_bytes = _dumps(meta)

    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(final.parent)
    tmp = final.with_name(f".{final.name}{_TMP_TAG}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.mkdir()
        _write_tensors(tmp / MODEL_FILE, model_tensors)
        _write_tensors(tmp / OPTIMIZER_FILE, optimizer_tensors)
        _write_tensors(tmp / AUX_FILE, aux)
        _write_bytes(tmp / META_FILE, meta_bytes)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in DATA_FILES},
        }
        manifest_bytes = _dumps(manifest)
        _write_bytes(tmp / MANIFEST_FILE, manifest_bytes)
        _write_bytes(tmp / COMMIT_FILE, _dumps({"format": FORMAT, "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}))
        _fsync_path(tmp, directory=True)
        if final.exists() and not overwrite:
            raise CheckpointError(f"{final} appeared while saving; pass overwrite=True to replace it")
        previous = _publish(tmp, final)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(
            f"could not write checkpoint {final}: {exc}; nothing was published and any previous checkpoint there is intact"
        ) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_path(final.parent, directory=True)  # make the rename itself durable
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
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorrupt(f"{commit}: unreadable commit marker ({exc})") from exc
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointCorrupt(f"{root}: {MANIFEST_FILE} is missing")
    found = _sha256(manifest_path)
    if found != expected_manifest:
        raise CheckpointCorrupt(f"{manifest_path}: sha256 {found} does not match the commit marker ({expected_manifest})")
    try:
        manifest = json.loads(manifest_path.read_bytes())
        manifest["files"].items()
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{manifest_path}: malformed manifest ({exc!r})") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointCorrupt(f"{root}: format {manifest.get('format')!r} version {manifest.get('version')!r}, expected {FORMAT!r} version {VERSION}")
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
        elif _sha256(file) != entry["sha256"]:
            damaged.append(f"{name}: sha256 mismatch (the file changed after it was written)")
    if damaged:
        raise CheckpointCorrupt(f"refusing to load {root}: " + "; ".join(damaged))
    meta = json.loads((root / META_FILE).read_bytes())
    if meta.get("format") != FORMAT:
        raise CheckpointCorrupt(f"{root / META_FILE}: not an {FORMAT} metadata file")
    return meta


def latest(root: PathLike, *, verify_files: bool = True) -> Optional[Path]:
    """The committed checkpoint directory under ``root`` with the highest step, or None.

    With ``verify_files`` a damaged checkpoint is passed over for the next newest one.
    """
    candidates = []
    base = Path(root)
    if not base.is_dir():
        return None
    for entry in base.iterdir():
        if entry.name.startswith(".") or not (entry / COMMIT_FILE).is_file():
            continue
        try:
            step = int(json.loads((entry / META_FILE).read_bytes())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            step = -1
        candidates.append((step, entry.name, entry))
    for _, _, entry in sorted(candidates, reverse=True):
        if not verify_files:
            return entry
        try:
            verify(entry)
        except CheckpointError:
            continue
        return entry
    return None


def _read(root: Path, name: str) -> dict[str, Tensor]:
    try:
        return load_file(str(root / name))
    except Exception as exc:  # checksums passed, so this is a writer bug or a foreign file
        raise CheckpointCorrupt(f"{root / name}: not a readable safetensors file ({exc})") from exc


def load(
    path: PathLike,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    scheduler: Any = None,
    strict: bool = True,
    *,
    rng: bool = True,
) -> LoadReport:
    """Restore a checkpoint written by :func:`save`, matched by name, all or nothing.

    ``optimizer=None`` or ``scheduler=None`` leaves that part out. With
    ``strict`` any problem raises :class:`CheckpointMismatch` and nothing is
    changed; without it, what matches is loaded, the rest stays as it was, and
    the report lists the problems. A damaged checkpoint raises
    :class:`CheckpointCorrupt` in both modes. ``rng`` restores the RNG states.
    """
    root = Path(path)
    meta = verify(root)
    model_saved = _read(root, MODEL_FILE)
    optimizer_saved = _read(root, OPTIMIZER_FILE)
    aux = _read(root, AUX_FILE)
    try:
        extra = _decode(meta["extra"], aux)
        saved_entries: dict[str, Any] = meta["model"]
        saved_opt = meta["optimizer"]
        saved_sched = meta["scheduler"]
        rng_state = _decode(meta["rng"], aux) if rng and meta.get("rng") else None
    except (KeyError, TypeError) as exc:
        raise CheckpointCorrupt(f"{root / META_FILE}: malformed metadata ({exc!r})") from exc
    report = LoadReport(path=str(root), step=meta.get("step"), extra=extra)
    problems = report.problems

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
        saved_shape = tuple(info["shape"])
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
                    name = name_of.get(id(p))
                    if name is None:
                        problems.append(f"parameter {index} of optimizer group {gi} (shape {tuple(p.shape)}) is not in model.state_dict()")
                        continue
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
                    problems.append(f"group mismatch {name!r}: optimized in group {saved_gi} of the checkpoint, not by this optimizer")
    sched_state = None
    if scheduler is not None:
        if saved_sched is None:
            problems.append("the checkpoint has no scheduler state (it was saved with scheduler=None)")
        elif saved_sched["class"] != type(scheduler).__name__:
            problems.append(f"scheduler: the checkpoint holds a {saved_sched['class']}, this is a {type(scheduler).__name__}")
        else:
            sched_state = _decode(saved_sched["state"], aux)
            own_keys, saved_keys = set(scheduler.state_dict()), set(sched_state)
            if own_keys != saved_keys:
                problems.append(
                    f"scheduler {type(scheduler).__name__}: keys {sorted(saved_keys - own_keys)} only in the checkpoint, "
                    f"{sorted(own_keys - saved_keys)} only here"
                )
                sched_state = None
    if problems and strict:
        raise CheckpointMismatch(report)

    # --- commit. The optimizer goes first: its load_state_dict is the only step
    # left that can refuse, and it changes nothing when it does.
    if optimizer is not None and saved_opt is not None:
        optimizer_state_dict = _optimizer_state_dict(
            optimizer, saved_opt, name_of, loadable, matched, model_saved, optimizer_saved, aux
        )
        try:
            optimizer.load_state_dict(optimizer_state_dict)
        except ValueError as exc:  # StateDictMismatch, or torch's own checks
            problems.extend(getattr(exc, "problems", [str(exc)]))
            raise CheckpointMismatch(report) from exc
        report.optimizer_restored = True
    with torch.no_grad():
        for name, target in matched.items():
            target.copy_(model_saved[name])  # a bf16 parameter gets round-to-nearest of its master
    report.loaded = sorted(matched)
    if sched_state is not None:
        scheduler.load_state_dict(sched_state)
        report.scheduler_restored = True
    if rng_state is not None:
        _restore_rng(rng_state, report)
    return report


def _optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    saved_opt: dict[str, Any],
    name_of: dict[int, str],
    loadable: set[str],
    matched: dict[str, Tensor],
    model_saved: dict[str, Tensor],
    optimizer_saved: dict[str, Tensor],
    aux: dict[str, Tensor],
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
            hyper = _decode(saved_groups[gi]["hyper"], aux)
        else:
            hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        ids = []
        for p in group["params"]:
            name = name_of.get(id(p))
            if name in loadable:
                saved = saved_opt["states"].get(name)
                entry = None if saved is None else dict(_decode(saved, optimizer_saved))
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
