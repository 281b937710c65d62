"""Checkpoints on torch.distributed.checkpoint, layout version 2: what ``checkpoint.save`` writes for every run
(one process, DDP, FSDP2 or any DTensor model).

Contract:

* :func:`save` is collective where a default process group runs: every rank calls it with its own state (DDP:
  DCP's planner writes each replicated tensor once; FSDP2: each rank its shards); without one it is this
  process's alone. Tied model entries (one tensor under several names) are stored once, under the first
  name, the others listed as ``aliases`` in ``meta.json``. The
  model and the optimizer are taken by parameter name through DCP's ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` (OffloadAdamW's float32 masters and moments included), their tensors
  written by ``dcp.save`` in the files of DCP's safetensors writer (``HuggingFaceStorageWriter``,
  ``save_distributed=True``: one ``shard-*.safetensors`` per rank, each shard's offsets in its header),
  streamed tensor by tensor (:func:`_writer`: DCP's own builds each file in memory first).
  Everything else is JSON: ``meta.json`` (rank 0: the nested state with references to the tensors, each
  tensor's global shape and dtype, the step, the world size) and per rank ``rank-NNNNN.json`` /
  ``.safetensors`` (that rank's RNG states of every device; rank 0's also the scheduler and ``extra``).
* Crash safety: rank 0 (the process itself, alone) creates the hidden, locked sibling
  ``.NAME.tmp-OWNER-PID-TOKEN`` and tells every rank its name; every file is fsynced by its writer;
  every rank sends the size and sha256 of its files to rank 0, which writes ``meta.json``, the manifest
  (every file), the commit marker, fsyncs the directory and publishes it with one atomic rename (or
  exchange), after which every rank returns. A save killed at any point leaves the previous checkpoint
  as it was and the new one absent (a hidden temporary that a later save deletes).
* :func:`load` never unpickles: DCP's own ``.metadata`` (a pickle) is never written nor read. The
  tensors' layout is rebuilt from the safetensors headers (JSON) of the files the manifest lists, read
  through the descriptors opened once (:class:`~offload_adamw.checkpoint.publication.Snapshot`). Any
  file in the directory that the manifest does not list (a ``.metadata`` pickle put there, say) is
  refused by name without being opened. Before anything changes every file is checked against the
  manifest (each rank checks its share, all ranks agree), and every tensor is matched by name, global
  shape and dtype against this run's state: a flipped byte is :class:`CheckpointCorrupt`, a mismatch
  :class:`CheckpointMismatch` naming each culprit, on every rank, with nothing changed. ``strict=False``
  loads what matches (:func:`_plan`: a model entry by name, shape and dtype; a parameter's optimizer state
  only where its model entry, its group, the group count and every state key match; a loaded parameter
  whose state is not loaded gets the saved master with it) and reports the rest; ranks that found
  different problems are refused.
* Resharding is DCP's: the shards are read into whatever this run's layout is (FSDP2 at another world
  size, DDP, one plain process), and what is loaded is bit for bit what was saved. A load is collective
  (every rank calls it; the digests are checked in shares) where the model holds DTensors; otherwise
  (one process, each DDP rank) a process loads alone, reading everything it needs, with no collective;
  rank *r* restores rank *r*'s RNG states either way.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import json
import os
import random
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from offload_adamw.checkpoint import codec, publication
from offload_adamw.checkpoint.codec import decode, encode, malformed
from offload_adamw.checkpoint.errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, LoadReport
from offload_adamw.checkpoint.layout import (
    COMMIT_FILE,
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    SHARD_FILE,
    SHARDED_VERSION,
    dumps,
    is_count,
    rank_files,
    written_by_a_save,
)
from offload_adamw.checkpoint.publication import TMP_TAG
from offload_adamw.contract.rules import MASTER_KEY
from offload_adamw.distributed.dtensor import is_dtensor

_STATE = "state"
_MODEL = f"{_STATE}/model/"
_OPTIMIZER = f"{_STATE}/optimizer/"


# ------------------------------------------------------------------ ranks


_LOCAL: contextvars.ContextVar[bool] = contextvars.ContextVar("offload_adamw_checkpoint_local", default=False)
"""Set while a load runs in this process alone (a model without DTensors: one process, or one DDP rank)."""


def _process_rank() -> int:
    """This process's rank in the default group (0 without one): whose RNG states it restores."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> tuple[int, int]:
    """(rank, world size) of the ranks taking part: every rank of the default group, or this process alone."""
    if not _LOCAL.get() and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (just ``[value]`` without a process group)."""
    _, world = _world()
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def _agree(error: str | None, kind: type[CheckpointError] = CheckpointError) -> None:
    """Raise ``kind`` on every rank where any rank found an error: no rank goes on alone (it would hang)."""
    errors = [f"rank {r}: {e}" for r, e in enumerate(_all(error)) if e is not None]
    if errors:
        raise kind("; ".join(errors))


@contextlib.contextmanager
def _alone(world: int) -> Iterator[None]:
    """DCP's warning that it runs in one process (it assumes so without a process group) silenced where that is
    what was asked: one process, or one DDP rank loading alone; a user sees it on every save otherwise."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------- state


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model's and the optimizer's state by parameter name (DTensors stay shards), as DCP gives it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def _tied(model_state: dict[str, Any]) -> dict[str, str]:
    """Tied entries (one tensor under several names, as a shared embedding) taken out of ``model_state``, so that
    each is stored once; alias -> the name it stays under. Shards (DTensors) are left as they are."""
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for name, value in list(model_state.items()):
        if not isinstance(value, Tensor) or is_dtensor(value) or value.numel() == 0 or value.is_meta:
            continue  # (a meta tensor has no storage to share: its address says nothing)
        key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
               value.stride(), value.dtype)
        if key in first:
            aliases[name] = first[key]
            del model_state[name]
        else:
            first[key] = name
    return aliases


def _tensor_info(t: Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}  # a DTensor's shape is global


def _largest_step(optimizer_state: dict[str, Any] | None) -> int:
    if not optimizer_state:
        return 0
    steps = [s.get("step") for s in optimizer_state.get("state", {}).values() if isinstance(s, dict)]
    return max((int(s.item() if isinstance(s, Tensor) else s) for s in steps if isinstance(s, (Tensor, int, float))),
               default=0)


def _rng_states(tensors: dict[str, Tensor]) -> dict[str, Any]:
    """This process's RNG states (torch, Python, numpy where imported, every CUDA device where CUDA is initialised);
    their tensors into ``tensors``."""
    states: dict[str, Any] = {
        "torch": encode(torch.get_rng_state(), tensors, "rng/torch"),
        "python": encode(random.getstate(), tensors, "rng/python"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = encode(torch.cuda.get_rng_state_all(), tensors, "rng/cuda")
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = encode(numpy.random.get_state(), tensors, "rng/numpy")
    return states


# -------------------------------------------------------------------- save


def save(
    final: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    extra: Any,
    *,
    step: int | None,
    overwrite: bool,
    rng: bool,
    check: Any,
) -> Path:
    """Collective save of layout 2 (see the module contract); ``check()`` runs on rank 0 before anything is written."""
    rank, world = _world()
    tmp: Path | None = None
    lock = None
    error = None
    if rank == 0:
        try:
            check()
            final.parent.mkdir(parents=True, exist_ok=True)
            publication.remove_stale(final.parent)
            tmp = publication.temporary_name(final, TMP_TAG)
            tmp.mkdir()
            lock = publication.lock(tmp)
        except Exception as exc:
            error = _describe(exc)
    shared = _all([error, None if tmp is None else str(tmp)])[0]
    if shared[0] is not None:
        raise CheckpointError(shared[0])
    tmp = Path(shared[1])
    try:
        previous = _write(final, tmp, rank, world, model, optimizer, scheduler, extra, step=step, overwrite=overwrite,
                          rng=rng)
    except BaseException:
        if rank == 0:
            publication.discard(tmp, lock)
        raise
    if rank == 0:
        publication.unlock(lock)
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
    return final


def _write(
    final: Path, tmp: Path, rank: int, world: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
    scheduler: Any, extra: Any, *, step: int | None, overwrite: bool, rng: bool,
) -> Path | None:
    import torch.distributed.checkpoint as dcp

    # Gather (every rank): an unsaveable object fails here, on every rank, before a shard is written.
    error = None
    try:
        state = _state(model, optimizer)
        aliases = _tied(state["model"])
        tensors: dict[str, Tensor] = {}
        encoded = encode(state, tensors, _STATE)
        own: dict[str, Tensor] = {}
        own_meta: dict[str, Any] = {"rank": rank, "rng": _rng_states(own) if rng else None}
        if rank == 0:
            own_meta["scheduler"] = None if scheduler is None else {
                "class": type(scheduler).__name__, "state": encode(scheduler.state_dict(), own, "scheduler")}
            own_meta["extra"] = encode(extra, own, "extra")
    except Exception as exc:
        error = f"cannot save checkpoint {final}: {_describe(exc)}; nothing was published"
    _agree(error)
    # The shards: one safetensors file per rank, streamed and fsynced by _write_shard.
    try:
        with _alone(world):
            dcp.save(tensors, storage_writer=_writer(tmp), no_dist=world == 1)
    except (Exception, dcp.api.CheckpointException) as exc:  # DCP gathers every rank's failure, raises on all
        raise CheckpointError(f"could not write checkpoint {final}: {exc}; nothing was published and any previous "
                              "checkpoint there is intact") from exc
    # This rank's own state, and the digests of what this rank wrote (so no rank hashes another's files).
    digests: dict[str, Any] = {}
    error = None
    try:
        meta_name, tensors_name = rank_files(rank)
        codec.write_tensors(tmp / tensors_name, own)
        publication.write_bytes(tmp / meta_name, dumps(own_meta))
        shard = f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"  # DCP's name for this rank's file
        for name in (meta_name, tensors_name, shard):
            if (tmp / name).exists():
                digests[name] = publication.digest(tmp / name)
    except Exception as exc:
        error = f"could not write checkpoint {final}: {_describe(exc)}; nothing was published"
    everyone = _all([error, digests])
    _agree(error)
    previous = None
    error = None
    if rank == 0:
        try:
            merged = {name: entry for _, part in everyone for name, entry in part.items()}
            meta = {
                "format": FORMAT,
                "version": SHARDED_VERSION,
                "layout": "torch.distributed.checkpoint",
                "world_size": world,
                "step": int(_largest_step(state.get("optimizer")) if step is None else step),
                "torch": torch.__version__,
                "state": encoded,
                "tensors": {key: _tensor_info(t) for key, t in tensors.items()},
                "aliases": aliases,
            }
            publication.write_bytes(tmp / META_FILE, dumps(meta))
            files = sorted(name for name in os.listdir(tmp))
            unknown = [name for name in files if name not in merged and name != META_FILE]
            if unknown:  # a file some rank wrote without reporting it: not sealed, so refuse to publish
                raise CheckpointError(f"unexpected files in the temporary: {unknown}")
            previous = publication.seal_and_publish(tmp, final, files, replace=overwrite, version=SHARDED_VERSION,
                                                    digests=merged)
            publication.fsync_path(final.parent, directory=True)
        except Exception as exc:
            error = _describe(exc) if isinstance(exc, CheckpointError) else (
                f"could not write checkpoint {final}: {_describe(exc)}; nothing was published and any previous "
                "checkpoint there is intact")
    # Every rank returns after the publication (or raises with rank 0), so that each sees the same checkpoints.
    _agree(error)
    return previous


def _writer(tmp: Path) -> Any:
    """DCP's safetensors writer (one file per rank, each shard's offsets in its header), streaming.

    DCP's own builds the whole file in memory (``safetensors.torch.save`` returns its bytes): one more
    copy of the rank's whole state on the host. This one writes the same file (the header first, from the
    plan's shapes and dtypes, then each tensor's bytes from where it lives): the host holds at most one
    tensor's contiguous CPU copy beyond the state (none for a contiguous host tensor).
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class StreamingWriter(HuggingFaceStorageWriter):
        def write_data(self, plan: Any, planner: Any) -> Future:
            results: list[Any] = []
            if plan.items:
                name = f"shard-{plan.storage_data['shard_index']:05d}-model-00001-of-00001.safetensors"
                results = _write_shard(tmp / name, name, plan.items, planner, _StorageInfo, WriteResult)
            done: Future = Future()
            done.set_result(results)
            return done

    return StreamingWriter(str(tmp), save_distributed=True)


_TO_SAFETENSORS = {v: k for k, v in {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                                     "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                                     "BOOL": "bool"}.items()}


def _write_shard(path: Path, name: str, items: list[Any], planner: Any, storage_info: Any, write_result: Any) -> list[Any]:
    """One rank's safetensors file, streamed tensor by tensor, fsynced; DCP's WriteResults for its items."""
    header: dict[str, Any] = {}
    offsets: dict[str, Any] = {}
    begin = 0
    layout = []
    for item in items:
        props, chunk = item.tensor_data.properties, item.tensor_data.chunk
        dtype = str(props.dtype).removeprefix("torch.")
        if dtype not in _TO_SAFETENSORS:
            raise CheckpointError(f"cannot save {item.index.fqn!r}: a {dtype} tensor has no safetensors dtype")
        length = torch.Size(chunk.sizes).numel() * props.dtype.itemsize
        header[item.index.fqn] = {"dtype": _TO_SAFETENSORS[dtype], "shape": list(chunk.sizes),
                                  "data_offsets": [begin, begin + length]}
        offsets[item.index.fqn] = {"saved_offsets": list(chunk.offsets)}
        layout.append((item, begin, length))
        begin += length
    header["__metadata__"] = {"DCP_SHARDING_INFO": json.dumps(offsets), "DCP_VERSION": "1.0", "format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as safetensors writes it
    results = []
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        start = f.tell()
        for item, at, length in layout:
            tensor = planner.resolve_data(item).detach().to("cpu").contiguous()
            if tensor.numel() * tensor.element_size() != length:  # the plan and the data disagree: a DCP bug
                raise CheckpointError(f"cannot save {item.index.fqn!r}: {tensor.shape} is not the planned chunk")
            if length:
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            results.append(write_result(index=item.index, size_in_bytes=length,
                                        storage_data=storage_info(relative_path=name, offset=start + at, length=length)))
        f.flush()
        os.fsync(f.fileno())
    return results


# -------------------------------------------------------------------- read


def _reader(snapshot: publication.Snapshot, shards: list[str]) -> Any:
    """DCP's safetensors reader over the shard files of ``snapshot``, its layout from their headers (JSON)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import Metadata

    class SnapshotReader(HuggingFaceStorageReader):
        """Reads the files the manifest lists, each through the snapshot's descriptor; no ``.metadata``, no pickle."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return _layout(snapshot, shards)

    return SnapshotReader(str(snapshot.root))


def _layout(snapshot: publication.Snapshot, shards: list[str]) -> Any:
    """DCP's Metadata rebuilt from plain data: each shard's tensors, shapes and dtypes from its safetensors header,
    their offsets in the whole tensor from the JSON that DCP's safetensors writer puts in that header."""
    from safetensors import safe_open
    from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    tensors: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, Any] = {}
    for name in shards:
        where = snapshot.reopenable(name) or str(snapshot.root / name)
        try:
            with safe_open(where, framework="pt") as f:
                offsets_of = json.loads((f.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
                for key in f.keys():
                    piece = f.get_slice(key)
                    shape = list(piece.get_shape())
                    offsets = list(offsets_of.get(key, {}).get("saved_offsets", [0] * len(shape)))
                    dtype = getattr(torch, _SAFETENSORS_DTYPES[piece.get_dtype()])
                    end = [o + n for o, n in zip(offsets, shape, strict=True)]
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))
                    entry = tensors.get(key)
                    if entry is None:
                        tensors[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(end), [chunk])
                    else:
                        entry.chunks.append(chunk)
                        entry.size = torch.Size(max(a, b) for a, b in zip(entry.size, end, strict=True))
                    storage[MetadataIndex(fqn=key, offset=torch.Size(offsets))] = _HFStorageInfo(
                        relative_path=where, shape=torch.Size(shape), dtype=dtype)
        except Exception as exc:  # the digests passed: a writer bug or a forged file
            raise CheckpointCorrupt(
                f"{snapshot.root / name}: not a readable safetensors shard ({type(exc).__name__}: {exc})") from exc
    return Metadata(state_dict_metadata=dict(tensors), storage_data=storage, storage_meta=StorageMeta())


#: safetensors' dtype names -> torch's
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def open_listed(snapshot: publication.Snapshot) -> list[str]:
    """Open every file the manifest of ``snapshot`` lists (not yet checked: :func:`verified_meta` does); the names
    that were missing. An unreadable manifest opens nothing here; the check refuses it."""
    try:
        files = json.loads(snapshot.read(MANIFEST_FILE))["files"]
        # only names a save writes: a forged manifest must not open "../x" or "/etc/passwd" through the directory
        names = [name for name in files if isinstance(name, str) and written_by_a_save(name)] if isinstance(
            files, dict) else []
    except (ValueError, KeyError, TypeError, RecursionError):
        return []
    snapshot.open_more(names)
    return [name for name in names if name in snapshot.missing]


def verified_meta(snapshot: publication.Snapshot, *, share: bool = False) -> dict[str, Any]:
    """The checked metadata of a layout-2 snapshot, every file checked against the manifest first.

    With ``share`` (a load on several ranks) each rank checks its share of the files and all agree.
    """
    root = snapshot.root
    if share:
        rank, world = _world()
    else:
        rank, world = 0, 1
    error = None
    entries: dict[str, Any] = {}
    try:
        entries = publication.manifest_files(snapshot, version=SHARDED_VERSION)
        stray = [n for n in snapshot.listing() if n not in entries and n not in (MANIFEST_FILE, COMMIT_FILE)]
        if stray:
            raise CheckpointCorrupt(f"refusing to load {root}: " + "; ".join(
                f"{n} is not in the manifest (a save never writes it; it was not opened)" for n in stray))
        foreign = [name for name in entries if not written_by_a_save(name)]
        if foreign:
            raise CheckpointCorrupt(f"refusing to load {root}: the manifest lists {foreign}, which no save writes "
                                    "(malformed manifest; nothing was opened)")
        names = sorted(entries)
        snapshot.open_more(names)
        damaged = publication.check_files(snapshot, entries, names[rank::world])
        if damaged:
            raise CheckpointCorrupt(f"refusing to load {root}: " + "; ".join(damaged))
    except CheckpointError as exc:
        error = str(exc)
    if share:
        _agree(error, CheckpointCorrupt)
    elif error is not None:
        raise CheckpointCorrupt(error)
    return _parse_meta(root / META_FILE, snapshot.read(META_FILE), entries)


def _parse_meta(file: Path, data: bytes, entries: dict[str, Any]) -> dict[str, Any]:
    try:
        meta = json.loads(data)
    except RecursionError:
        raise CheckpointCorrupt(f"{file}: nested too deeply to read (malformed metadata)") from None
    except ValueError as exc:
        raise CheckpointCorrupt(f"{file}: not JSON ({exc})") from exc

    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise CheckpointCorrupt(f"{file}: {key} {what} (malformed metadata)")

    need(isinstance(meta, dict), "the top level", "must be an object")
    need(meta.get("format") == FORMAT and meta.get("version") == SHARDED_VERSION, "'format'/'version'",
         f"must be {FORMAT!r} / {SHARDED_VERSION}")
    need(is_count(meta.get("step")), "'step'", "must be a non-negative integer")
    need(is_count(meta.get("world_size")) and meta["world_size"] > 0, "'world_size'", "must be a positive integer")
    need(isinstance(meta.get("state"), dict), "'state'", "must be an object")
    meta.setdefault("aliases", {})  # written by every save since tied weights are stored once
    aliases = meta["aliases"]
    need(isinstance(aliases, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()),
         "'aliases'", "must map names to names")
    tensors = meta.get("tensors")
    need(isinstance(tensors, dict), "'tensors'", "must be an object")
    for key, info in tensors.items():
        ok = isinstance(info, dict) and isinstance(info.get("shape"), list) and all(is_count(d) for d in info["shape"])
        need(ok and codec.is_dtype_name(info.get("dtype")), f"tensors[{key!r}]", "must be {'shape': sizes, 'dtype': name}")
    for r in range(meta["world_size"]):
        for name in rank_files(r):
            need(name in entries, f"the file {name}", "is not in the manifest")
    return meta


def _read_rank(snapshot: publication.Snapshot, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s own state, decoded (its RNG states; rank 0's scheduler and ``extra``)."""
    meta_name, tensors_name = rank_files(rank)
    file = snapshot.root / meta_name
    try:
        own = json.loads(snapshot.read(meta_name))
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{file}: not JSON ({exc})") from exc
    if not isinstance(own, dict):
        raise malformed(str(file), "must be an object")
    tensors = codec.read_tensors(snapshot, tensors_name)
    return {key: decode(value, tensors, f"{file}: {key}") for key, value in own.items()}


# -------------------------------------------------------------------- load


def load(
    snapshot: publication.Snapshot,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    strict: bool,
    *,
    rng: bool,
    collective: bool,
) -> LoadReport:
    """A load of a layout-2 snapshot into this run's layout (see the module contract): collective (every rank
    of the default group calls it) where the model holds DTensors, else by this process alone."""
    token = _LOCAL.set(not collective)
    try:
        return _load(snapshot, model, optimizer, scheduler, strict, rng=rng)
    finally:
        _LOCAL.reset(token)


def _load(
    snapshot: publication.Snapshot,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    strict: bool,
    *,
    rng: bool,
) -> LoadReport:

    rank, world = _world()
    own = _process_rank()
    meta = verified_meta(snapshot, share=True)
    root = snapshot.root
    # Every rank must read the same checkpoint: ranks given two paths, or a save replacing the checkpoint
    # between the ranks' opening it, would mix two checkpoints (each rank's digests would pass).
    manifests = _all(hashlib.sha256(snapshot.read(MANIFEST_FILE)).hexdigest())
    if len(set(manifests)) > 1:
        raise CheckpointError(
            f"cannot load checkpoint {root}: the ranks opened different checkpoints (manifest sha256 by rank: "
            f"{[m[:12] for m in manifests]}): another path on some rank, or a save replaced it meanwhile; "
            "nothing was changed")
    error: str | None = None
    mine: dict[str, Any] | None = None
    zero: dict[str, Any] | None = None
    try:
        mine = _read_rank(snapshot, own) if own < meta["world_size"] else None
        zero = mine if own == 0 else _read_rank(snapshot, 0)
    except CheckpointError as exc:
        error = str(exc)
    _agree(error, CheckpointCorrupt)
    shards = sorted(n for n in publication.manifest_files(snapshot, version=SHARDED_VERSION) if SHARD_FILE.fullmatch(n))

    def read(loaded: dict[str, Tensor]) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            with _alone(world):
                dcp.load(loaded, storage_reader=_reader(snapshot, shards), no_dist=world == 1)
        except (Exception, dcp.api.CheckpointException) as exc:  # DCP gathers every rank's failure, raises on all
            # (CheckpointException is a BaseException)
            raise CheckpointCorrupt(f"cannot read the shards of {root}: nothing was changed; {exc}") from exc

    return load_state(root, meta, zero, mine, read, model, optimizer, scheduler, strict, rng=rng,
                      own_file=root / rank_files(own)[0])


def load_in_memory(
    root: Path, meta: dict[str, Any], own: dict[str, Any], tensors: dict[str, Tensor], model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None, scheduler: Any, strict: bool, *, rng: bool, own_file: Path,
) -> LoadReport:
    """:func:`load_state` of a checkpoint already read and checked (layout 1, by the store), by this process
    alone; ``own`` is every process's own state (layout 1 holds one)."""

    def read(loaded: dict[str, Tensor]) -> None:
        for key, copy_ in loaded.items():
            copy_.copy_(tensors[key])

    token = _LOCAL.set(True)
    try:
        return load_state(root, meta, own, own, read, model, optimizer, scheduler, strict, rng=rng, own_file=own_file)
    finally:
        _LOCAL.reset(token)


def load_state(
    root: Path, meta: dict[str, Any], zero: dict[str, Any] | None, mine: dict[str, Any] | None,
    read: Callable[[dict[str, Tensor]], None], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
    scheduler: Any, strict: bool, *, rng: bool, own_file: Path,
) -> LoadReport:
    """The load of a checked checkpoint, whatever stores its tensors: ``meta`` (its step, world size, nested
    state with tensor references, each tensor's shape and dtype, aliases), rank 0's and this rank's own state
    (decoded: RNG, scheduler, ``extra``), and ``read``, which fills copies of the planned tensors by key. Plan,
    read, commit (see the module contract); nothing changes before everything was read and checked."""
    from offload_adamw.checkpoint import store

    rank, _ = _world()
    own = _process_rank()
    error: str | None = None
    report = LoadReport(path=str(root), step=meta["step"])
    try:
        report.extra = zero.get("extra") if zero is not None else None
        rng_state = mine.get("rng") if (rng and mine is not None) else None
        if rng and mine is None:
            report.rng_skipped["rank"] = (
                f"the checkpoint holds the RNG states of {meta['world_size']} rank(s); rank {own} has none to restore")
        if rng_state is not None:
            store._check_rng(rng_state, own_file)
    except CheckpointError as exc:
        error = str(exc)
    _agree(error, CheckpointCorrupt)
    # DCP's get_optimizer_state_dict allocates the state of parameters that have none (a zero-lr step): taken
    # back on a refusal, so that a refused load leaves the optimizer as it found it.
    stateless = [] if optimizer is None else [
        p for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)]
    try:
        templates: dict[str, Tensor] = {}
        plan: _Plan | None = None
        try:
            state = _state(model, optimizer)
        except Exception as exc:  # OffloadAdamW between a backward that updated and step(): its state_dict refuses
            report.problems.append(f"the model or the optimizer refuses to give its state now ({type(exc).__name__}: "
                                   f"{exc})")
        else:  # every rank reaches the agreement below, whatever it found
            encode(state, templates, _STATE)
            plan = _plan(meta, state, templates, report, optimizer, scheduler, zero)
        everyone = _all(report.problems)
        if any(everyone):
            # Shapes and dtypes are global, so ranks find the same problems; where they do not (ranks of
            # different models), no rank may go on: a partial load of some ranks only would mix two states.
            disagree = any(found != report.problems for found in everyone)
            report.problems.extend(f"rank {r}: {len(found)} problem(s)" for r, found in enumerate(everyone)
                                   if found and r != rank and found != report.problems)
            if strict or plan is None or disagree:
                raise CheckpointMismatch(report)
        assert plan is not None  # no problem found, so the state was taken
        # Read into copies: the model and the optimizer change only once everything was read.
        loaded = {key: templates[here].detach().clone() for key, here in plan.wanted.items()}
        read(loaded)
        # What was not read (strict=False: mismatched entries) decodes to an empty placeholder that nothing takes.
        unread = {key: torch.empty(0) for key in meta["tensors"] if key not in loaded}
        saved = decode(meta["state"], {**unread, **loaded}, f"{root / META_FILE}: state")
        _commit(saved, state, plan, report, model, optimizer, scheduler, rng_state)
    except BaseException:
        for p in stateless:
            if optimizer is not None:
                optimizer.state.pop(p, None)
        raise
    return report


def _unescape(component: str) -> str:
    return component.replace("%2F", "/").replace("%25", "%")


def _owner(key: str) -> tuple[str, str]:
    """(section, parameter name) of a tensor key: ("model", name), ("optimizer", name) for a per-parameter state,
    ("other", key) for anything else (an optimizer's tensor hyperparameter)."""
    parts = key.split("/")
    if len(parts) == 3 and parts[1] == "model":
        return "model", _unescape(parts[2])
    if len(parts) >= 5 and parts[1] == "optimizer" and parts[2] == "state":
        return "optimizer", _unescape(parts[3])
    return "other", key


@dataclass
class _Plan:
    """What the match found loadable: everything under strict, what matches under strict=False."""

    wanted: dict[str, str]
    """The tensor keys to read -> the key of this run's tensor of that shape and dtype (its own, or a tied alias's)."""
    model: set[str]
    """Model entries that take their saved value (a tied alias with its canonical entry)."""
    optimizer: set[str]
    """Parameters whose saved optimizer state is loaded: the model entry, the group and every state key match."""
    hyper: bool
    """Whether the saved groups' hyperparameters are loaded (the group counts are equal)."""
    scheduler_state: Any
    aliases: dict[str, str]
    """Tied model entries stored once: alias -> the name it is stored under."""


def _plan(
    meta: dict[str, Any], state: dict[str, Any], templates: dict[str, Tensor], report: LoadReport,
    optimizer: torch.optim.Optimizer | None, scheduler: Any, zero: dict[str, Any] | None,
) -> _Plan:
    """Match everything by name (changes nothing): every mismatch into ``report``, what fits into the plan.

    The report's lists name model entries, as layout 1's load always did; a mismatch of an optimizer
    state key is a problem naming its parameter.
    """
    saved = meta["tensors"]
    aliases = meta["aliases"]
    with_optimizer = optimizer is not None
    wanted: dict[str, str] = {}
    fits: set[str] = set()
    model_names: set[str] = set()
    for key, target in templates.items():
        section, name = _owner(key)
        if section == "model":
            model_names.add(name)
        elif not with_optimizer:
            continue
        source = f"{_MODEL}{codec.part(aliases[name])}" if section == "model" and name in aliases else key
        info = saved.get(source)
        where = repr(name) if section != "optimizer" else f"{name!r} (optimizer state {key.rsplit('/', 1)[-1]!r})"
        if info is None:
            if section == "model":
                report.missing.append(name)
                report.problems.append(f"missing {name!r}: in the model, not in the checkpoint")
            else:
                report.problems.append(f"missing {where}: here, not in the checkpoint")
            continue
        own = _tensor_info(target)
        if section == "model" and target.is_meta:
            report.problems.append(
                f"meta device {name!r}: the model's tensor holds no storage, nothing can be loaded into it; "
                "materialize the model first (module.to_empty(device=...))")
        elif section == "model" and not is_dtensor(target) and (
                target.is_inference() or torch._debug_has_internal_overlap(target) == 1):
            # copy_ would raise half-way through the commit: refused before anything changes
            report.problems.append(
                f"unwritable {name!r}: an inference-mode tensor or one whose elements share memory (expand)")
        elif info["shape"] != own["shape"]:
            if section == "model":
                report.wrong_shape[name] = (tuple(info["shape"]), tuple(own["shape"]))
            report.problems.append(f"wrong shape {where}: {tuple(info['shape'])} in the checkpoint, "
                                   f"{tuple(own['shape'])} here")
        elif info["dtype"] != own["dtype"]:
            if section == "model":
                report.wrong_dtype[name] = (info["dtype"], own["dtype"])
            report.problems.append(f"wrong dtype {where}: {info['dtype']} in the checkpoint, {own['dtype']} here")
        else:
            fits.add(key)
            wanted.setdefault(source, key)  # a tied alias reads its canonical entry, once
    matched = {name for name in model_names if f"{_MODEL}{codec.part(name)}" in fits}
    for key in saved:
        section, name = _owner(key)
        if key in templates or (section != "model" and not with_optimizer):
            continue
        if section == "model":
            if name not in model_names:
                report.unexpected.append(name)
                report.problems.append(f"unexpected {name!r}: in the checkpoint, not in the model")
        elif section == "optimizer" and name in matched:
            report.problems.append(f"unexpected {name!r} (optimizer state {key.rsplit('/', 1)[-1]!r}): in the "
                                   "checkpoint, not here")
        elif section == "other":
            report.problems.append(f"unexpected {key!r}: in the checkpoint, not here")
    loadable: set[str] = set()
    hyper = False
    if with_optimizer:
        if "optimizer" not in meta["state"]:
            report.problems.append("the checkpoint has no optimizer state (it was saved with optimizer=None)")
        else:
            hyper, same_group = _match_groups(meta["state"]["optimizer"], state["optimizer"], report, matched,
                                              model_names)
            keys_of: dict[str, set[str]] = {}
            for key in {*templates, *saved}:
                section, name = _owner(key)
                if section == "optimizer":
                    keys_of.setdefault(name, set()).add(key)
            loadable = {name for name in same_group if hyper and name in matched
                        and all(key in fits and key in saved for key in keys_of.get(name, ()))}
    scheduler_state = None if scheduler is None else _match_scheduler(zero, report, scheduler)
    return _Plan(wanted, matched, loadable, hyper, scheduler_state, aliases)


def _groups_of(optimizer_state: Any) -> dict[str, int]:
    """parameter name -> index of its group, in an optimizer state as DCP gives it (groups list names)."""
    groups = optimizer_state.get("param_groups") if isinstance(optimizer_state, dict) else None
    if not isinstance(groups, list):
        return {}
    return {name: gi for gi, group in enumerate(groups) if isinstance(group, dict)
            for name in group.get("params", []) if isinstance(name, str)}


def _match_groups(
    saved: Any, here: dict[str, Any], report: LoadReport, matched: set[str], model_names: set[str],
) -> tuple[bool, set[str]]:
    """(whether the group counts are equal, the parameters optimized in the same group on both sides).

    Every other parameter of the model is a group mismatch naming it: DCP would load the saved groups'
    hyperparameters onto whatever parameters they list, silently regrouping them.
    """
    saved_of, here_of = _groups_of(saved), _groups_of(here)
    saved_count = len(saved.get("param_groups", [])) if isinstance(saved, dict) else 0
    here_count = len(here.get("param_groups", []))
    if saved_count != here_count:
        report.problems.append(f"the checkpoint has {saved_count} parameter group(s), the optimizer has {here_count}")
    same: set[str] = set()
    for name, gi in here_of.items():
        if name not in matched:
            continue  # its model entry is a problem already
        if saved_of.get(name) == gi:
            same.add(name)
            continue
        report.group_mismatch.append(name)
        where = "not optimized" if name not in saved_of else f"in group {saved_of[name]}"
        report.problems.append(f"group mismatch {name!r}: {where} in the checkpoint, group {gi} here")
    for name, gi in saved_of.items():
        if name not in here_of and name in model_names:
            report.group_mismatch.append(name)
            report.problems.append(f"group mismatch {name!r}: optimized in group {gi} of the checkpoint, not here")
    return saved_count == here_count, same


def _match_scheduler(zero: dict[str, Any] | None, report: LoadReport, scheduler: Any) -> Any:
    """The saved scheduler state where it is this scheduler's class with the same keys; else a problem and None."""
    saved = None if zero is None else zero.get("scheduler")
    if saved is None:
        report.problems.append("the checkpoint has no scheduler state (it was saved with scheduler=None)")
        return None
    if not isinstance(saved, dict) or saved.get("class") != type(scheduler).__name__:
        found = saved.get("class") if isinstance(saved, dict) else type(saved).__name__
        report.problems.append(f"scheduler: the checkpoint holds a {found}, this is a {type(scheduler).__name__}")
        return None
    state = saved.get("state")
    if not isinstance(state, dict):  # every rank reads rank 0's state: all refuse alike
        raise malformed(f"{rank_files(0)[0]}: scheduler/state", f"must be an object, got {type(state).__name__}")
    own_keys, saved_keys = set(scheduler.state_dict()), set(state)
    if own_keys != saved_keys:
        report.problems.append(
            f"scheduler {type(scheduler).__name__}: keys {sorted(saved_keys - own_keys)} only in the checkpoint, "
            f"{sorted(own_keys - saved_keys)} only here")
        return None
    return state


def _same_value(a: Any, b: Any) -> bool:
    """Whether two hyperparameters are the same plain value (a tensor is never taken as the same: it is loaded)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _optimizer_state(saved: dict[str, Any], own: dict[str, Any], plan: _Plan,
                     live: list[dict[str, Any]]) -> dict[str, Any]:
    """The optimizer state to load, by name: the saved state of each loadable parameter, this run's own state of
    every other (strict=False), whose master becomes the saved one where its model entry is loaded, so that a
    parameter and its master agree."""
    saved_states = saved["optimizer"]["state"]
    states: dict[str, Any] = {}
    for name, own_entry in own["state"].items():
        if name in plan.optimizer:
            states[name] = saved_states[name]
            continue
        entry = dict(own_entry)
        if MASTER_KEY in entry and name in plan.model:
            master = saved_states.get(name, {}).get(MASTER_KEY)
            fits = isinstance(master, Tensor) and master.shape == entry[MASTER_KEY].shape and master.numel() > 0
            # without a saved master that fits (saved without one), the master is the loaded model value
            value = saved["model"][plan.aliases.get(name, name)]
            entry[MASTER_KEY] = master if fits else value.to(entry[MASTER_KEY].dtype)
        states[name] = entry
    for name in plan.optimizer:
        states.setdefault(name, saved_states[name])
    groups = []
    for gi, group in enumerate(own["param_groups"]):
        out = dict(saved["optimizer"]["param_groups"][gi]) if plan.hyper else dict(group)
        for key, value in live[gi].items():
            # A value the optimizer's own state_dict writes otherwise than it holds it (OffloadAdamW: fused None
            # as True, the same kernel) stays as held where the checkpoint saved what this run would save.
            if key in out and _same_value(out[key], group.get(key)):
                out[key] = value
        out["params"] = list(group["params"])
        if "param_names" in group:
            out["param_names"] = list(group["param_names"])
        groups.append(out)
    return {"state": states, "param_groups": groups}


def _commit(
    saved: dict[str, Any], own: dict[str, Any], plan: _Plan, report: LoadReport, model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None, scheduler: Any, rng_state: Any,
) -> None:
    """Scheduler, optimizer, model, RNG, in this order; a refusal of the optimizer puts the scheduler back.

    Only the scheduler's and the optimizer's own load_state_dict can still refuse (every tensor was checked
    before); the model's copies and the RNG states come after them.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from offload_adamw.checkpoint import store

    scheduler_before = None
    error = None
    if plan.scheduler_state is not None:
        scheduler_before = copy.deepcopy(scheduler.state_dict())
        try:
            scheduler.load_state_dict(plan.scheduler_state)
        except Exception as exc:  # a scheduler may fail half-way through its own load: put back as it was
            scheduler.load_state_dict(scheduler_before)
            report.problems.append(f"scheduler {type(scheduler).__name__} refused its state: {type(exc).__name__}: "
                                   f"{exc}")
            raise CheckpointMismatch(report) from exc
    try:
        if optimizer is not None and "optimizer" in saved:
            set_optimizer_state_dict(model, optimizer, _optimizer_state(saved, own["optimizer"], plan,
                                                                            optimizer.param_groups))
            report.optimizer_restored = True
    except Exception as exc:
        if scheduler_before is not None:
            scheduler.load_state_dict(scheduler_before)
        report.problems.extend(getattr(exc, "problems", [f"{type(exc).__name__}: {exc}"]))
        error = str(exc)
    report.scheduler_restored = plan.scheduler_state is not None and error is None
    if error is not None:
        raise CheckpointMismatch(report)
    values = {name: saved["model"][plan.aliases.get(name, name)] for name in plan.model}
    set_model_state_dict(model, values, options=StateDictOptions(strict=False))
    report.loaded = sorted(plan.model)
    if rng_state is not None:
        store._restore_rng(rng_state, report)
