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
"""

from __future__ import annotations

import copy
import ctypes
import errno
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import socket
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias, cast

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from offload_adamw.contract.rules import MASTER_KEY

__all__ = [
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

FORMAT = "offload-adamw-checkpoint"
VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
AUX_FILE = "aux.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
COMMIT_FILE = "COMMIT"
DATA_FILES = (MODEL_FILE, OPTIMIZER_FILE, AUX_FILE, META_FILE)
ENV_EXCHANGE = "OFFLOAD_ADAMW_CHECKPOINT_EXCHANGE"
_KEY_SEP = "::"
_TMP_TAG = ".tmp-"
_SAFETENSORS_TEMPORARY = re.compile(r"\.tmp[A-Za-z0-9]{6}")
_PREV_TAG = ".prev-"

PathLike: TypeAlias = str | os.PathLike


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint is incomplete or damaged (no commit marker, a checksum or size mismatch)."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A checkpoint that does not fit the model/optimizer/scheduler; ``report`` names every culprit."""

    def __init__(self, report: LoadReport):
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
    """The checkpoint directory read (the kept previous one where :func:`resolve` found only that)."""
    step: int | None = None
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


def _part(key: str) -> str:
    """A dict key as one component of a tensor's storage name: "/" escaped, so that no two paths collide."""
    return key.replace("%", "%25").replace("/", "%2F")


def _encode(obj: Any, tensors: dict[str, Tensor], where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Tensor):
        if where in tensors:  # unreachable with escaped keys; a collision would silently drop a tensor
            raise CheckpointError(f"cannot save {where!r}: two values would be stored under the same name")
        tensors[where] = obj.detach()
        return {"__tensor__": where}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{where}/{_part(k)}") for k, v in obj.items()}
        return {
            "__items__": [
                [_encode(k, tensors, f"{where}/k{i}"), _encode(v, tensors, f"{where}/v{i}")]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if type(obj).__module__ == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            if where in tensors:
                raise CheckpointError(f"cannot save {where!r}: two values would be stored under the same name")
            tensors[where] = torch.from_numpy(obj.astype(np.int64) if obj.dtype.kind in "ui" else obj.copy())
            return {"__ndarray__": where, "dtype": str(obj.dtype)}
        if isinstance(obj, np.generic):
            return obj.item()
    raise CheckpointError(
        f"cannot save {where!r}: a {type(obj).__name__} is neither a tensor nor a JSON value "
        "(checkpoints never pickle)"
    )


def _decode(obj: Any, tensors: dict[str, Tensor], where: str) -> Any:
    """The value :func:`_encode` wrote; CheckpointCorrupt naming ``where`` (file: key path) for anything else."""
    try:
        return _decode_value(obj, tensors, where)
    except RecursionError:
        raise CheckpointCorrupt(f"{where}: nested too deeply to read") from None


def _bad(where: str, what: str) -> CheckpointCorrupt:
    return CheckpointCorrupt(f"{where}: {what} (malformed metadata)")


def _tensor_ref(key: Any, tensors: dict[str, Tensor], where: str) -> Tensor:
    if not isinstance(key, str) or key not in tensors:
        raise _bad(where, f"refers to a tensor {key!r} that the checkpoint does not hold")
    return tensors[key]


def _decode_value(obj: Any, tensors: dict[str, Tensor], where: str) -> Any:
    if isinstance(obj, list):
        return [_decode_value(v, tensors, f"{where}/{i}") for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return _tensor_ref(obj["__tensor__"], tensors, where)
    if "__tuple__" in obj:
        if not isinstance(obj["__tuple__"], list):
            raise _bad(where, f"a tuple must be a list, got {type(obj['__tuple__']).__name__}")
        return tuple(_decode_value(v, tensors, f"{where}/{i}") for i, v in enumerate(obj["__tuple__"]))
    if "__items__" in obj:
        items = obj["__items__"]
        if not isinstance(items, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
            raise _bad(where, "dict items must be a list of [key, value] pairs")
        out = {}
        for i, (k, v) in enumerate(items):
            key = _decode_value(k, tensors, f"{where}/k{i}")
            try:
                hash(key)
            except TypeError:
                raise _bad(where, f"dict key {i} is a {type(key).__name__}, which cannot be a key") from None
            out[key] = _decode_value(v, tensors, f"{where}/v{i}")
        return out
    if "__dtype__" in obj:
        name = obj["__dtype__"]
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise _bad(where, f"{name!r} is not a torch dtype")
        return dtype
    if "__ndarray__" in obj:
        import numpy as np

        tensor = _tensor_ref(obj["__ndarray__"], tensors, where)
        try:
            return tensor.numpy().astype(np.dtype(obj["dtype"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise _bad(where, f"not a numpy array ({exc})") from None
    return {k: _decode_value(v, tensors, f"{where}/{_part(k)}") for k, v in obj.items()}


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
    for key, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
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
    if not sys.platform.startswith("linux") or os.environ.get(ENV_EXCHANGE, "1").strip().lower() in ("0", "off", "false", "no"):
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


def _owner() -> str:
    """This machine, boot and PID namespace, hashed (16 hex digits): with the PID, who wrote a temporary.

    A PID says nothing about a process of another host or container sharing the directory (NFS, a
    bind mount); only temporaries of this very machine, boot and namespace are judged by their PID.
    """
    parts = [socket.gethostname()]
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(Path(source).read_text().strip() if source.endswith("boot_id") else str(os.stat(source).st_ino))
        except OSError:
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _temporary_name(final: Path, tag: str) -> Path:
    return final.with_name(f".{final.name}{tag}{_owner()}-{os.getpid()}-{secrets.token_hex(4)}")


_TEMPORARY = re.compile(r"^\.(?P<target>.+)\.(?P<kind>tmp|prev)-(?P<owner>[0-9a-f]{16})-(?P<pid>[0-9]+)-[0-9a-f]{8}$")


def _lock(directory: Path) -> int | None:
    """An exclusive lock on ``directory`` held by this process until :func:`_unlock` (None where unsupported)."""
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the lock


def _publish(tmp: Path, final: Path) -> Path | None:
    """Move the finished ``tmp`` onto ``final``; return the directory that now holds the old one."""
    if not final.exists():
        os.rename(tmp, final)
        return None
    if _exchange(tmp, final):
        return tmp  # after the swap the temporary name holds the previous checkpoint
    # No atomic exchange here: for a moment ``final`` is absent and the previous
    # checkpoint sits at the .prev- name. resolve(), latest() and load() find it
    # there, and no clean-up deletes it until ``final`` is complete again.
    previous = _temporary_name(final, _PREV_TAG)
    os.rename(final, previous)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(previous, final)  # put the previous checkpoint back where it was
        raise
    return previous


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours_and_abandoned(entry: Path, owner: str, pid: int) -> bool:
    """Whether ``entry`` was written by a save of a process of this machine that no longer runs."""
    if owner != _owner() or pid == os.getpid() or _pid_alive(pid):
        return False
    ours = {*DATA_FILES, MANIFEST_FILE, COMMIT_FILE}

    def written_by_a_save(name: str) -> bool:
        # safetensors writes each file through a temporary beside it (".tmp" and 6 characters, Rust's tempfile),
        # which a kill during that write leaves behind.
        return name in ours or _SAFETENSORS_TEMPORARY.fullmatch(name) is not None

    try:
        if entry.is_symlink() or not entry.is_dir():
            return False
        if not all(written_by_a_save(child.name) and child.is_file() and not child.is_symlink() for child in entry.iterdir()):
            return False  # something a save never writes: not ours to delete
    except OSError:
        return False
    fd = _lock(entry)  # a writer holds this lock while it fills its temporary
    if fd is None:
        return False
    _unlock(fd)
    return True


def _remove_stale(parent: Path) -> None:
    """Delete what killed saves of this machine left in ``parent``, and nothing else.

    A name ``.NAME.tmp-OWNER-PID-TOKEN`` / ``.NAME.prev-OWNER-PID-TOKEN`` is
    judged only where OWNER is this machine, boot and PID namespace, its PID no
    longer runs, no process holds the directory's lock, and it holds nothing but
    checkpoint files. A ``.tmp-`` directory is then never the only complete copy
    of anything (after an exchange it holds the replaced checkpoint); a
    ``.prev-`` directory (no atomic exchange) may be, so it goes only once
    ``NAME`` is complete again.
    """
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        if match is None:
            continue
        if match["kind"] == "prev" and not (parent / match["target"] / COMMIT_FILE).is_file():
            continue
        if _ours_and_abandoned(entry, match["owner"], int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True)


def _previous_copies(final: Path) -> list[Path]:
    """The ``.prev-`` directories of ``final`` (a save without atomic exchange that was interrupted)."""
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return []
    out = []
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        if match is not None and match["kind"] == "prev" and match["target"] == final.name:
            out.append(entry)
    return out


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
    for entry in _previous_copies(final):
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
                        key: _encode(value, optimizer_tensors, f"{name}{_KEY_SEP}{key}")
                        for key, value in state.items()
                        if key != MASTER_KEY  # the master is the model entry
                    }
            hyper = {k: _encode(v, aux, f"optimizer/{gi}/{k}") for k, v in group.items() if k not in ("params", "param_names")}
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
        else {"class": type(scheduler).__name__, "state": _encode(scheduler.state_dict(), aux, "scheduler")},
        "rng": _rng_states(aux) if rng else None,
        "extra": _encode(extra, aux, "extra"),
    }
    meta_bytes = _dumps(meta)

    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(final.parent)
    tmp = _temporary_name(final, _TMP_TAG)
    lock = None
    try:
        tmp.mkdir()
        lock = _lock(tmp)
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
        _unlock(lock)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(
            f"could not write checkpoint {final}: {exc}; nothing was published and any previous checkpoint there is intact"
        ) from exc
    except BaseException:
        _unlock(lock)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _unlock(lock)
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
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{commit}: unreadable commit marker ({exc})") from exc
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointCorrupt(f"{root}: {MANIFEST_FILE} is missing")
    found = _sha256(manifest_path)
    if found != expected_manifest:
        raise CheckpointCorrupt(f"{manifest_path}: sha256 {found} does not match the commit marker ({expected_manifest})")
    try:
        manifest = json.loads(manifest_path.read_bytes())
        files = manifest["files"]
        for name in DATA_FILES:
            entry = files.get(name)
            if entry is not None and not (
                isinstance(entry, dict) and _is_count(entry.get("bytes")) and isinstance(entry.get("sha256"), str)
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
        elif _sha256(file) != entry["sha256"]:
            damaged.append(f"{name}: sha256 mismatch (the file changed after it was written)")
    if damaged:
        raise CheckpointCorrupt(f"refusing to load {root}: " + "; ".join(damaged))
    try:
        meta = json.loads((root / META_FILE).read_bytes())
    except RecursionError:
        raise CheckpointCorrupt(f"{root / META_FILE}: nested too deeply to read (malformed metadata)") from None
    except ValueError as exc:
        raise CheckpointCorrupt(f"{root / META_FILE}: not JSON ({exc})") from exc
    _check_meta(root / META_FILE, meta)
    return meta


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_dtype_name(x: Any) -> bool:
    return isinstance(x, str) and isinstance(getattr(torch, x, None), torch.dtype)


def _check_meta(file: Path, meta: Any) -> None:
    """The layout :func:`save` writes, checked before anything reads it: CheckpointCorrupt naming the key."""

    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise CheckpointCorrupt(f"{file}: {key} {what} (malformed metadata)")

    need(isinstance(meta, dict), "the top level", "must be an object")
    need(meta.get("format") == FORMAT, "'format'", f"must be {FORMAT!r}, got {meta.get('format')!r}")
    need(meta.get("version") == VERSION, "'version'", f"must be {VERSION}, got {meta.get('version')!r}")
    for key in ("step", "model", "aliases", "optimizer", "scheduler", "rng", "extra"):
        need(key in meta, repr(key), "is missing")
    need(_is_count(meta["step"]), "'step'", f"must be a non-negative integer, got {meta['step']!r}")
    need(isinstance(meta["model"], dict), "'model'", "must be an object")
    for name, info in meta["model"].items():
        where = f"model[{name!r}]"
        need(isinstance(info, dict), where, "must be an object")
        need(_is_dtype_name(info.get("dtype")), f"{where}['dtype']", f"must name a torch dtype, got {info.get('dtype')!r}")
        need(
            _is_dtype_name(info.get("stored_dtype", info.get("dtype"))),
            f"{where}['stored_dtype']",
            f"must name a torch dtype, got {info.get('stored_dtype')!r}",
        )
        shape = info.get("shape")
        sizes = isinstance(shape, list) and all(_is_count(d) for d in shape)
        need(sizes, f"{where}['shape']", f"must be a list of sizes, got {shape!r}")
    aliases = meta["aliases"]
    need(isinstance(aliases, dict) and all(isinstance(v, str) for v in aliases.values()), "'aliases'", "must map names to names")
    opt = meta["optimizer"]
    if opt is not None:
        need(isinstance(opt, dict), "'optimizer'", "must be an object or null")
        need(isinstance(opt.get("class"), str), "optimizer['class']", "must be a string")
        need(isinstance(opt.get("groups"), list), "optimizer['groups']", "must be a list")
        for gi, group in enumerate(opt["groups"]):
            where = f"optimizer['groups'][{gi}]"
            need(isinstance(group, dict), where, "must be an object")
            names = group.get("param_names")
            named = isinstance(names, list) and all(isinstance(n, str) for n in names)
            need(named, f"{where}['param_names']", "must be a list of names")
            need(isinstance(group.get("hyper"), dict), f"{where}['hyper']", "must be an object")
        need(isinstance(opt.get("states"), dict), "optimizer['states']", "must be an object")
        for name, state in opt["states"].items():
            need(isinstance(state, dict), f"optimizer['states'][{name!r}]", "must be an object")
    sched = meta["scheduler"]
    if sched is not None:
        well_formed = isinstance(sched, dict) and isinstance(sched.get("class"), str) and "state" in sched
        need(well_formed, "'scheduler'", "must be {'class': str, 'state': ...} or null")
    need(meta["rng"] is None or isinstance(meta["rng"], dict), "'rng'", "must be an object or null")


def _recorded_step(entry: Path) -> int:
    """The step a checkpoint's metadata records, for ordering; -1 where it cannot be read."""
    try:
        step = json.loads((entry / META_FILE).read_bytes())["step"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
        return -1
    return step if _is_count(step) else -1


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
            match = _TEMPORARY.match(entry.name)
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


def _read(root: Path, name: str) -> dict[str, Tensor]:
    try:
        return load_file(str(root / name))
    except Exception as exc:  # checksums passed, so this is a writer bug or a foreign file
        raise CheckpointCorrupt(f"{root / name}: not a readable safetensors file ({exc})") from exc


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
    model_saved = _read(root, MODEL_FILE)
    optimizer_saved = _read(root, OPTIMIZER_FILE)
    aux = _read(root, AUX_FILE)
    extra = _decode(meta["extra"], aux, f"{meta_file}: extra")
    saved_entries: dict[str, Any] = meta["model"]
    saved_opt = meta["optimizer"]
    saved_sched = meta["scheduler"]
    rng_state = None
    if rng and meta["rng"] is not None:
        rng_state = _decode(meta["rng"], aux, f"{meta_file}: rng")
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
            sched_state = _decode(saved_sched["state"], aux, f"{meta_file}: scheduler/state")
            if not isinstance(sched_state, dict):
                raise _bad(f"{meta_file}: scheduler/state", f"must be an object, got {type(sched_state).__name__}")
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
            hyper = _decode(saved_groups[gi]["hyper"], aux, f"{meta_file}: optimizer/groups/{gi}/hyper")
        else:
            hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        ids = []
        for p in group["params"]:
            name = name_of.get(id(p))
            if name in loadable:
                saved = saved_opt["states"].get(name)
                where = f"{meta_file}: optimizer/states/{_part(name)}"
                entry = None if saved is None else dict(_decode(saved, optimizer_saved, where))
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
