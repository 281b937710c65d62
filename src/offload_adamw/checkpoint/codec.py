"""The checkpoint codec: Python values as JSON plus named tensors, tensors as safetensors files.

Contract:

* :func:`encode` turns a value into JSON, moving every tensor (and numpy array) into a dict of named
  tensors and leaving a reference; tuples, dicts with non-string keys and torch dtypes are tagged so
  that :func:`decode` gives back the same types. Anything else is refused (checkpoints never pickle).
  Tensor names are paths of escaped dict keys (:func:`part`), so no two values collide.
* :func:`decode` accepts only what :func:`encode` writes; anything else is :class:`CheckpointCorrupt`
  naming the file and key path, never a bare TypeError or KeyError.
* :func:`write_tensors` / :func:`read_tensors` store a dict of tensors as one safetensors file
  (fsynced; contiguous host copies, no two sharing memory) and read it back from an opened
  :class:`~offload_adamw.checkpoint.publication.Snapshot` (the file its seal was checked on).
* :func:`check_meta` checks the layout of ``meta.json`` before anything reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, load_file, save_file
from torch import Tensor

from offload_adamw.checkpoint import publication
from offload_adamw.checkpoint.errors import CheckpointCorrupt, CheckpointError
from offload_adamw.checkpoint.layout import FORMAT, VERSION, is_count

# --------------------------------------------------------------- JSON codec
# Tensors go to a safetensors file and JSON keeps a reference; tuples, dicts
# with non-string keys and numpy arrays are tagged so that they come back as
# the same types. Nothing else is accepted: no pickling, ever.


def part(key: str) -> str:
    """A dict key as one component of a tensor's storage name: "/" escaped, so that no two paths collide."""
    return key.replace("%", "%25").replace("/", "%2F")


def encode(obj: Any, tensors: dict[str, Tensor], where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Tensor):
        if where in tensors:  # unreachable with escaped keys; a collision would silently drop a tensor
            raise CheckpointError(f"cannot save {where!r}: two values would be stored under the same name")
        tensors[where] = obj.detach()
        return {"__tensor__": where}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, f"{where}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{where}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, tensors, f"{where}/{part(k)}") for k, v in obj.items()}
        return {
            "__items__": [
                [encode(k, tensors, f"{where}/k{i}"), encode(v, tensors, f"{where}/v{i}")]
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


def decode(obj: Any, tensors: dict[str, Tensor], where: str) -> Any:
    """The value :func:`encode` wrote; CheckpointCorrupt naming ``where`` (file: key path) for anything else."""
    try:
        return _decode_value(obj, tensors, where)
    except RecursionError:
        raise CheckpointCorrupt(f"{where}: nested too deeply to read") from None


def malformed(where: str, what: str) -> CheckpointCorrupt:
    return CheckpointCorrupt(f"{where}: {what} (malformed metadata)")


def _tensor_ref(key: Any, tensors: dict[str, Tensor], where: str) -> Tensor:
    if not isinstance(key, str) or key not in tensors:
        raise malformed(where, f"refers to a tensor {key!r} that the checkpoint does not hold")
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
            raise malformed(where, f"a tuple must be a list, got {type(obj['__tuple__']).__name__}")
        return tuple(_decode_value(v, tensors, f"{where}/{i}") for i, v in enumerate(obj["__tuple__"]))
    if "__items__" in obj:
        items = obj["__items__"]
        if not isinstance(items, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
            raise malformed(where, "dict items must be a list of [key, value] pairs")
        out = {}
        for i, (k, v) in enumerate(items):
            key = _decode_value(k, tensors, f"{where}/k{i}")
            try:
                hash(key)
            except TypeError:
                raise malformed(where, f"dict key {i} is a {type(key).__name__}, which cannot be a key") from None
            out[key] = _decode_value(v, tensors, f"{where}/v{i}")
        return out
    if "__dtype__" in obj:
        name = obj["__dtype__"]
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise malformed(where, f"{name!r} is not a torch dtype")
        return dtype
    if "__ndarray__" in obj:
        import numpy as np

        tensor = _tensor_ref(obj["__ndarray__"], tensors, where)
        try:
            return tensor.numpy().astype(np.dtype(obj["dtype"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise malformed(where, f"not a numpy array ({exc})") from None
    return {k: _decode_value(v, tensors, f"{where}/{part(k)}") for k, v in obj.items()}


# ------------------------------------------------------------- tensor files


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


def write_tensors(path: Path, tensors: dict[str, Tensor]) -> None:
    save_file(_host_tensors(tensors), str(path), metadata={"format": FORMAT})
    publication.fsync_path(path)


def read_tensors(snapshot: publication.Snapshot, name: str) -> dict[str, Tensor]:
    """The tensors of the file ``name`` of ``snapshot``: the very file its seal was checked on."""
    try:
        again = snapshot.reopenable(name)
        return load_file(again) if again is not None else load(snapshot.read(name))
    except Exception as exc:  # checksums passed, so this is a writer bug or a foreign file
        raise CheckpointCorrupt(f"{snapshot.root / name}: not a readable safetensors file ({exc})") from exc


# ---------------------------------------------------------------- meta.json


def is_dtype_name(x: Any) -> bool:
    return isinstance(x, str) and isinstance(getattr(torch, x, None), torch.dtype)


def check_meta(file: Path, meta: Any) -> None:
    """The layout :func:`save` writes, checked before anything reads it: CheckpointCorrupt naming the key."""

    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise CheckpointCorrupt(f"{file}: {key} {what} (malformed metadata)")

    need(isinstance(meta, dict), "the top level", "must be an object")
    need(meta.get("format") == FORMAT, "'format'", f"must be {FORMAT!r}, got {meta.get('format')!r}")
    need(meta.get("version") == VERSION, "'version'", f"must be {VERSION}, got {meta.get('version')!r}")
    for key in ("step", "model", "aliases", "optimizer", "scheduler", "rng", "extra"):
        need(key in meta, repr(key), "is missing")
    need(is_count(meta["step"]), "'step'", f"must be a non-negative integer, got {meta['step']!r}")
    need(isinstance(meta["model"], dict), "'model'", "must be an object")
    for name, info in meta["model"].items():
        where = f"model[{name!r}]"
        need(isinstance(info, dict), where, "must be an object")
        need(is_dtype_name(info.get("dtype")), f"{where}['dtype']", f"must name a torch dtype, got {info.get('dtype')!r}")
        need(
            is_dtype_name(info.get("stored_dtype", info.get("dtype"))),
            f"{where}['stored_dtype']",
            f"must name a torch dtype, got {info.get('stored_dtype')!r}",
        )
        shape = info.get("shape")
        sizes = isinstance(shape, list) and all(is_count(d) for d in shape)
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
