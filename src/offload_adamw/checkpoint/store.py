"""Crash-safe, name-keyed training checkpoints: safetensors and JSON, never pickle; one format for one
process, DDP and FSDP2.

Contract:

* ``save(path, model, optimizer, scheduler=None, extra=None)`` writes a checkpoint *directory* of
  layout 2 (:mod:`~offload_adamw.checkpoint.sharded`, on torch.distributed.checkpoint) for every run::

      shard-NNNNN-model-00001-of-00001.safetensors
                             per rank with tensors to write: the model's state and the optimizer's
                             per-parameter state (float32 masters of low-precision parameters
                             included) by parameter name, as DCP's get_model_state_dict /
                             get_optimizer_state_dict give them; a tied weight once
      rank-NNNNN.json/.safetensors
                             per rank: its RNG states; rank 0's also the scheduler and ``extra``
      meta.json              the nested state with tensor references, shapes, dtypes, aliases, step
      manifest.json          size and sha256 of each file above
      COMMIT                 written last: the sha256 of manifest.json

  Where a default process group runs, ``save`` is collective as ``dcp.save`` is: every rank calls it
  (DDP: each replicated tensor is written once; FSDP2: each rank its shards).
  It is built in a hidden sibling directory ``.NAME.tmp-OWNER-PID-TOKEN``
  (OWNER: this machine, boot and PID namespace, hashed), locked while it is
  written; every file and the directory are fsynced, then it is renamed onto
  ``path`` in one step. Without ``overwrite`` that step creates ``path`` only if
  nothing is there, atomically (``renameat2(RENAME_NOREPLACE)``, else a plain
  rename, which cannot replace a file or a non-empty directory): of several
  saves racing to create one path exactly one succeeds, the others raise
  :class:`CheckpointError` and publish nothing. Replacing an existing checkpoint
  (``overwrite=True``) is one atomic exchange where the OS has
  ``renameat2(RENAME_EXCHANGE)`` (Linux; ``OFFLOAD_ADAMW_CHECKPOINT_EXCHANGE=0``
  turns renameat2 off). Elsewhere it
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
  ``load_state_dict`` (for OffloadAdamW: all or nothing, name-matched). A load is collective where
  the model holds DTensors, else each process (each DDP rank) loads alone; it reshards into any layout.
* Layout 1 (``model.safetensors``, ``optimizer.safetensors``, ``aux.safetensors``, ``meta.json``:
  what earlier versions wrote in one process) is read, never written: ``load``, ``verify``, ``latest``
  and ``resolve`` read either layout by the version its manifest declares. A layout-1 checkpoint is not
  loaded into a DTensor model (refused, naming the first DTensor and the converter, before anything
  changes).

``load`` of layout 1 reads (:func:`_read_snapshot`: the files of one directory, opened once, behind a
verified seal, so that a load racing a save that replaces the checkpoint reads the old one or the new one,
whole) and verifies (:func:`_verify`: the checkpoint agrees with itself: stored tensors as declared, RNG
states restorable, ``extra`` decodable); then it is laid out as layout 2 in memory
(:func:`~offload_adamw.checkpoint.convert.as_layout2`) and matched and committed by layout 2's rules
(:func:`~offload_adamw.checkpoint.sharded.load_in_memory`): one set of rules for both layouts.

The pieces: :mod:`~offload_adamw.checkpoint.sharded` (layout 2: every save, its load),
:mod:`~offload_adamw.checkpoint.codec` (values as JSON and safetensors),
:mod:`~offload_adamw.checkpoint.publication` (fsync, exchange, locks, clean-up; no torch),
:mod:`~offload_adamw.checkpoint.layout` (file names) and :mod:`~offload_adamw.checkpoint.errors`.
"""

from __future__ import annotations

import json
import os
import random
import stat
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias, cast

import torch
from torch import Tensor

from offload_adamw._output import file_kind
from offload_adamw.checkpoint import codec, publication, sharded
from offload_adamw.checkpoint.codec import check_meta, decode, malformed
from offload_adamw.checkpoint.errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, LoadReport
from offload_adamw.checkpoint.layout import (
    AUX_FILE,
    CHECKPOINT_FILES,
    COMMIT_FILE,
    DATA_FILES,
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SHARDED_VERSION,
    is_count,
    written_by_a_save,
)
from offload_adamw.checkpoint.publication import ENV_EXCHANGE, TEMPORARY
from offload_adamw.distributed.dtensor import is_dtensor

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


PathLike: TypeAlias = str | os.PathLike


# ------------------------------------------------------------------ finding


def resolve(path: PathLike) -> Path | None:
    """The complete checkpoint that ``path`` stands for, or None.

    That is ``path`` itself when it holds a commit marker. Where a save without
    the atomic exchange was interrupted between its two renames, ``path`` is
    absent and the previous checkpoint sits at a hidden ``.NAME.prev-...``
    sibling: then that one (the newest that verifies, if several).
    """
    final = Path(path)
    if _has_commit(final):
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


def verify(path: PathLike) -> dict[str, Any]:
    """Check the commit marker, the manifest and every file's size and sha256; return the metadata.

    Raises :class:`CheckpointCorrupt` naming every damaged file.
    """
    with _open(Path(path), follow=False) as snapshot:
        if publication.manifest_version(snapshot) == SHARDED_VERSION:
            return sharded.verified_meta(snapshot)
        return _verified_meta(snapshot)


_OPEN_ATTEMPTS = 10


def _open(requested: Path, *, follow: bool) -> publication.Snapshot:
    """The checkpoint directory ``requested`` (with ``follow``: the one :func:`resolve` finds), opened once.

    A directory that a concurrent save replaced while it was being opened (so that some of its files
    were already deleted) is opened again, as it is then; opening takes microseconds, a save far longer.
    """
    attempts_left = _OPEN_ATTEMPTS
    while True:
        attempts_left -= 1
        root = (resolve(requested) or requested) if follow else requested
        try:
            snapshot = publication.Snapshot(root, CHECKPOINT_FILES)
        except (FileNotFoundError, NotADirectoryError):
            if attempts_left and follow and resolve(requested) is not None:
                continue  # a kept previous checkpoint, deleted once the new one was complete
            raise CheckpointError(f"{root}: no checkpoint directory there") from None
        missing = snapshot.missing
        if publication.manifest_version(snapshot) == SHARDED_VERSION:
            # layout 2 names its files in the manifest: opened now too, so that a save replacing the
            # directory from here on changes nothing of what is read (as for layout 1's fixed names)
            missing = sharded.open_listed(snapshot)
        if missing and attempts_left and snapshot.replaced():
            snapshot.close()
            continue
        return snapshot


def _verified_meta(snapshot: publication.Snapshot) -> dict[str, Any]:
    publication.check_seal(snapshot, DATA_FILES)
    return _parse_meta(snapshot.root / META_FILE, snapshot.read(META_FILE))


def _parse_meta(file: Path, data: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(data)
    except RecursionError:
        raise CheckpointCorrupt(f"{file}: nested too deeply to read (malformed metadata)") from None
    except ValueError as exc:
        raise CheckpointCorrupt(f"{file}: not JSON ({exc})") from exc
    check_meta(file, meta)
    return cast(dict[str, Any], meta)


def _has_commit(directory: Path) -> bool:
    """Whether anything is at ``directory``'s commit marker: a checkpoint to read (and to refuse by name if that
    is not a regular file), not the leftover of an interrupted save. Nothing is opened."""
    return os.path.lexists(directory / COMMIT_FILE)


def _recorded_step(entry: Path) -> int | str:
    """The step a checkpoint's metadata records, for ordering; else why it cannot be read (a sentence)."""
    try:
        step = json.loads(publication.read_regular(entry / META_FILE))["step"]
    except publication.NotRegularFile as exc:
        return f"{META_FILE} is {exc.kind}, not a regular file (a save writes only regular files; it was not opened)"
    except RecursionError:
        return f"{META_FILE} is nested too deeply to read (malformed metadata)"
    except OSError as exc:
        return f"{META_FILE} cannot be read ({exc.strerror or exc})"
    except ValueError as exc:
        return f"{META_FILE} is not JSON ({exc})"
    except (KeyError, TypeError, IndexError):
        return f"{META_FILE} records no step (malformed metadata)"
    return step if is_count(step) else f"{META_FILE}: step {step!r} is not a count (malformed metadata)"


def latest(root: PathLike, *, verify_files: bool = True) -> Path | None:
    """The committed checkpoint directory under ``root`` with the highest step, or None.

    With ``verify_files`` a damaged or malformed checkpoint is passed over for
    the next newest one, with a RuntimeWarning saying why; one whose metadata
    does not say its step (not readable, malformed, not a regular file) is
    passed over so in any case. Nothing but regular files is opened. Where a save without
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
        if not _has_commit(entry):
            continue
        step = _recorded_step(entry)
        if isinstance(step, str):  # without a step it cannot be ordered, nor loaded: passed over, saying why
            warnings.warn(f"latest(): skipping {entry}: {step}", RuntimeWarning, stacklevel=2)
            continue
        candidates.append((step, entry.name, entry))
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


# ------------------------------------------------------------------- save


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
    ``path`` is replaced only with ``overwrite=True``; without it, ``path`` is
    created atomically, so that of saves racing to create it exactly one
    succeeds and the others raise :class:`CheckpointError`. ``rng`` saves the torch,
    CUDA, Python and numpy RNG states. Raises :class:`CheckpointError` if
    something cannot be stored or written; then nothing was published. A save
    where the optimizer refuses its own ``state_dict()`` (OffloadAdamW with
    ``update_in_backward=True`` between a backward that already updated
    parameters and ``step()``) is refused with its message before anything is
    written. Under a process group every rank calls ``save`` (see the module contract).
    """
    final = Path(path).absolute()

    def check() -> None:
        _check_parents(final)
        _check_target(final, overwrite)
        _check_optimizer_can_save(final, optimizer)

    return sharded.save(final, model, optimizer, scheduler, extra, step=step, overwrite=overwrite, rng=rng, check=check)


def _first_dtensor(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> str | None:
    """The first DTensor of the model's state or the optimizer's parameters, in words; None where there is none."""
    culprit = next((f"model state {name!r}" for name, value in model.state_dict(keep_vars=True).items()
                    if is_dtensor(value)), None)
    if culprit is None and optimizer is not None:
        culprit = next((f"parameter {index} of optimizer group {gi}" for gi, group in enumerate(optimizer.param_groups)
                        for index, p in enumerate(group["params"]) if is_dtensor(p)), None)
    return culprit


def _refuse_sharded(what: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, outcome: str) -> None:
    """CheckpointError naming the first DTensor where a one-process (layout 1) checkpoint is to be loaded into it.

    Layout 1 holds whole tensors of one process; a DTensor is one rank's shard of a tensor (FSDP2, tensor
    parallelism). Layout 2 (:mod:`~offload_adamw.checkpoint.sharded`, what ``save`` writes for such a model) reshards.
    """
    culprit = _first_dtensor(model, optimizer)
    if culprit is not None:
        raise CheckpointError(
            f"{what}: {culprit} is a DTensor (a shard of an FSDP2 or tensor-parallel model), and this checkpoint "
            "(layout 1, one process) holds whole tensors of one process. Convert it to the sharded layout first: "
            f"python -m offload_adamw.checkpoint.convert SRC DST; {outcome}"
        )


def _check_parents(final: Path) -> None:
    """Every existing ancestor of ``final`` is a directory; else CheckpointError naming the first that is not.

    mkdir would say only FileExistsError or NotADirectoryError about some path; this names the file in the way.
    """
    for ancestor in reversed(final.parents):
        try:
            found = os.stat(ancestor)  # through links: a link to a directory is a directory here
        except FileNotFoundError:
            return  # created by the save, as the rest below it
        except OSError as exc:
            raise CheckpointError(f"cannot save checkpoint {final}: cannot look at {ancestor} ({exc}); "
                                  "nothing was written") from exc
        if not stat.S_ISDIR(found.st_mode):
            kind = "a file" if stat.S_ISREG(found.st_mode) else file_kind(found.st_mode)
            raise CheckpointError(f"cannot save checkpoint {final}: {ancestor} is {kind}, not a directory; "
                                  "nothing was written")


def _check_target(final: Path, overwrite: bool) -> None:
    if final.exists() and not overwrite:
        raise CheckpointError(f"{final} exists; pass overwrite=True to replace it atomically")
    if final.exists():
        # overwrite=True replaces (and then deletes) only what a save could have written there.
        if not final.is_dir() or not all(written_by_a_save(entry.name) for entry in final.iterdir()):
            raise CheckpointError(f"{final} is not a checkpoint directory; refusing to replace it")


def _check_optimizer_can_save(final: Path, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse where the optimizer refuses its own state_dict() (for OffloadAdamW with update_in_backward=True:
    between a backward that already updated parameters and step(), where the state holds half a step)."""
    if optimizer is None:
        return
    try:
        optimizer.state_dict()
    except Exception as exc:
        raise CheckpointError(
            f"cannot save checkpoint {final}: the optimizer refuses to give its state now "
            f"({type(exc).__name__}: {exc}); nothing was written"
        ) from exc


# ------------------------------------------------------------------- load


@dataclass
class _Saved:
    """What the read stage found: the directory read, its metadata and its three tensor files."""

    root: Path
    meta: dict[str, Any]
    model: dict[str, Tensor]
    optimizer: dict[str, Tensor]
    aux: dict[str, Tensor]

    @property
    def meta_file(self) -> Path:
        return self.root / META_FILE


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
    with _open(Path(path), follow=True) as snapshot:
        if publication.manifest_version(snapshot) == SHARDED_VERSION:
            collective = _first_dtensor(model, optimizer) is not None
            return sharded.load(snapshot, model, optimizer, scheduler, strict, rng=rng, collective=collective)
        _refuse_sharded(f"cannot load checkpoint {path}", model, optimizer, "nothing was changed")
        saved = _read_snapshot(snapshot)
    extra, rng_state = _verify(saved, rng=rng)
    from offload_adamw.checkpoint.convert import as_layout2

    # One matching and commit for both layouts: layout 1 is laid out as layout 2 in memory and loaded by it.
    meta, tensors, own = as_layout2(saved, extra, rng_state)
    return sharded.load_in_memory(saved.root, meta, own, tensors, model, optimizer, scheduler, strict, rng=rng,
                                  own_file=saved.meta_file)


# --- read: the files of one checkpoint, behind a verified seal


def _read_snapshot(snapshot: publication.Snapshot) -> _Saved:
    """The layout-1 checkpoint of a snapshot opened once (:func:`_open`): what the seal vouches for is what is
    parsed, whatever a concurrent save renames or deletes meanwhile."""
    return _Saved(
        root=snapshot.root,
        meta=_verified_meta(snapshot),
        model=codec.read_tensors(snapshot, MODEL_FILE),
        optimizer=codec.read_tensors(snapshot, OPTIMIZER_FILE),
        aux=codec.read_tensors(snapshot, AUX_FILE),
    )


# --- verify: the checkpoint agrees with itself


def _verify(saved: _Saved, *, rng: bool) -> tuple[Any, Any]:
    """(``extra``, the RNG states or None), decoded; the stored tensors are what meta.json says they are."""
    meta, meta_file = saved.meta, saved.meta_file
    extra = decode(meta["extra"], saved.aux, f"{meta_file}: extra")
    rng_state = None
    if rng and meta["rng"] is not None:
        rng_state = decode(meta["rng"], saved.aux, f"{meta_file}: rng")
        _check_rng(rng_state, meta_file)
    model_file = saved.root / MODEL_FILE
    for name, info in meta["model"].items():
        stored = saved.model.get(name)
        if stored is None:
            raise CheckpointCorrupt(f"{model_file}: holds no tensor {name!r}, which {META_FILE} lists")
        declared = getattr(torch, info.get("stored_dtype", info["dtype"]))
        if list(stored.shape) != info["shape"] or stored.dtype != declared:
            raise CheckpointCorrupt(
                f"{model_file}: {name!r} is {str(stored.dtype).removeprefix('torch.')} {tuple(stored.shape)}, "
                f"{META_FILE} says {str(declared).removeprefix('torch.')} {tuple(info['shape'])} (malformed metadata)"
            )
    for name in saved.model:
        if name not in meta["model"]:
            raise CheckpointCorrupt(f"{model_file}: holds {name!r}, which {META_FILE} does not list")
    return extra, rng_state


def _check_rng(states: Any, file: Path) -> None:
    """Every saved RNG state is restorable: tried on scratch generators, so that the commit cannot fail.

    A CUDA state cannot be tried without CUDA (a CPU generator has another layout): its layout is
    checked instead, as torch's CUDA generator checks it.
    """
    if not isinstance(states, dict) or "torch" not in states or "python" not in states:
        raise CheckpointCorrupt(f"{file}: rng must hold the 'torch' and 'python' states (malformed metadata)")
    if "cuda" in states:
        _check_cuda_states(states["cuda"], file)
    trials: dict[str, Any] = {
        "torch": lambda: torch.Generator().set_state(states["torch"]),
        "python": lambda: random.Random().setstate(states["python"]),
    }
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


#: the sizes torch's CUDA generator accepts as a state: its seed and Philox offset, or the seed alone
_CUDA_STATE_BYTES = (16, 8)


def _check_cuda_states(states: Any, file: Path) -> None:
    """One state per device, each as torch.cuda.get_rng_state() returns it: 16 bytes in a 1-dimensional uint8 tensor."""
    if not isinstance(states, list):
        raise malformed(f"{file}: rng/cuda", f"must be a list of per-device states, got {type(states).__name__}")
    for device, state in enumerate(states):
        where = f"{file}: rng/cuda/{device}"
        if not isinstance(state, Tensor):
            raise malformed(where, f"must be a tensor, got {type(state).__name__}")
        if state.dtype != torch.uint8:
            raise malformed(where, f"must be a uint8 tensor, got {str(state.dtype).removeprefix('torch.')}")
        if state.dim() != 1:
            raise malformed(where, f"must be 1-dimensional, got {state.dim()}-dimensional")
        if state.numel() not in _CUDA_STATE_BYTES:
            raise malformed(where, f"must be 16 bytes (the seed and the Philox offset), got {state.numel()} bytes")


# --- RNG states: restored last (layout 2's commit calls these)


def _restore_rng(states: dict[str, Any], report: LoadReport) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states:
        _restore_cuda_rng(states["cuda"], report)
    numpy = sys.modules.get("numpy")
    if "numpy" in states and numpy is not None:
        numpy.random.set_state(states["numpy"])
    report.rng_restored = True


def _restore_cuda_rng(states: list[Tensor], report: LoadReport) -> None:
    """Each CUDA device's state onto the device of the same index, where it exists; the rest reported.

    Without CUDA no CUDA generator exists to draw from, so nothing is lost and the report says so.
    With another number of devices the saved run cannot be continued exactly: the devices both
    sides have are restored, and a RuntimeWarning says what was not.
    """
    saved = len(states)
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device in range(min(saved, here)):
        torch.cuda.set_rng_state(states[device], device)
    if saved == here or saved == 0:
        return
    if here == 0:
        report.rng_skipped["cuda"] = (
            f"the checkpoint holds the RNG states of {saved} CUDA device(s); this process has no CUDA device, "
            "so they were not restored"
        )
        return
    restored = min(saved, here)
    rest = f"devices {restored} to {here - 1} kept their own" if here > saved else (
        f"the states of devices {restored} to {saved - 1} were not used")
    report.rng_skipped["cuda"] = (
        f"the checkpoint holds the RNG states of {saved} CUDA device(s), this process has {here}: "
        f"devices 0 to {restored - 1} were restored, {rest}"
    )
    warnings.warn(f"checkpoint.load: {report.rng_skipped['cuda']}", RuntimeWarning, stacklevel=4)
