"""One command from a one-process checkpoint (layout 1) to the sharded layout (layout 2, DCP), loadable into FSDP2.

    python -m offload_adamw.checkpoint.convert SRC DST

Contract:

* :func:`convert` reads ``SRC`` as ``load`` does (the seal and every checksum first, safetensors and JSON
  only) and writes ``DST`` as a sharded checkpoint of world size 1, published atomically (created only if
  nothing is there). ``load`` of ``DST`` then reshards it into any layout (FSDP2 at any world size, DDP,
  one process) and gives what ``load`` of ``SRC`` gives: the same parameters, optimizer state, parameter
  groups, scheduler state, step, ``extra`` and RNG states.
* What layout 1 stores as a model entry for a low-precision parameter is its float32 master: it becomes the
  optimizer's ``master_param`` and the parameter its model-dtype value (round to nearest, as ``load`` of
  layout 1 writes it). A tied weight's aliases name the same tensor.
* ``SRC`` is not changed; nothing is written where ``DST`` exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from offload_adamw.checkpoint import codec, publication, store
from offload_adamw.checkpoint.codec import decode, encode, malformed
from offload_adamw.checkpoint.errors import CheckpointError
from offload_adamw.checkpoint.layout import FORMAT, META_FILE, SHARDED_VERSION, VERSION, dumps, rank_files
from offload_adamw.checkpoint.publication import TMP_TAG
from offload_adamw.contract.rules import MASTER_KEY

__all__ = ["convert", "main"]

_SHARD = "shard-00001-model-00001-of-00001.safetensors"


def convert(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write the layout-2 checkpoint ``dst`` holding what the layout-1 checkpoint ``src`` holds; return ``dst``."""
    final = Path(dst).absolute()
    with store._open(Path(src), follow=True) as snapshot:
        if publication.manifest_version(snapshot) != VERSION:
            raise CheckpointError(f"{snapshot.root} is not a one-process (layout {VERSION}) checkpoint")
        saved = store._read_snapshot(snapshot)
    extra, rng_state = store._verify(saved, rng=True)
    layout, tensors, own = as_layout2(saved, extra, rng_state)
    layout["converted_from"] = str(saved.root)
    own_tensors: dict[str, Tensor] = {}
    own_meta = {key: encode(value, own_tensors, key) for key, value in own.items()}
    store._check_parents(final)
    if os.path.lexists(final):
        raise CheckpointError(f"{final} exists; nothing was written")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = publication.temporary_name(final, TMP_TAG)
    lock = None
    try:
        tmp.mkdir()
        lock = publication.lock(tmp)
        offsets = {key: {"saved_offsets": [0] * t.dim()} for key, t in tensors.items()}
        save_file(codec._host_tensors(tensors), str(tmp / _SHARD),
                  metadata={"DCP_SHARDING_INFO": json.dumps(offsets), "DCP_VERSION": "1.0", "format": "pt"})
        publication.fsync_path(tmp / _SHARD)
        meta_name, tensors_name = rank_files(0)
        codec.write_tensors(tmp / tensors_name, own_tensors)
        publication.write_bytes(tmp / meta_name, dumps(own_meta))
        publication.write_bytes(tmp / META_FILE, dumps(layout))
        # created only if nothing is there by then (a DST made meanwhile is refused, nothing published)
        publication.seal_and_publish(tmp, final, sorted(os.listdir(tmp)), replace=False, version=SHARDED_VERSION)
        publication.fsync_path(final.parent, directory=True)
    except BaseException:
        publication.discard(tmp, lock)
        raise
    publication.unlock(lock)
    return final


def as_layout2(saved: Any, extra: Any, rng_state: Any) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, Any]]:
    """What a layout-1 checkpoint (read and checked by the store) holds, as layout 2 holds it: (meta.json's
    content, the tensors by key, rank 0's own state decoded: ``rank``, ``rng``, ``scheduler``, ``extra``).
    Both the converter (which writes it) and ``load`` of layout 1 (which loads it) take it from here."""
    meta = saved.meta
    state = {"model": _model(saved)}
    if meta["optimizer"] is not None:
        state["optimizer"] = _optimizer(saved)
    tensors: dict[str, Tensor] = {}
    encoded = encode(state, tensors, "state")
    scheduler = meta["scheduler"]
    if scheduler is not None:
        where = f"{saved.meta_file}: scheduler/state"
        scheduler = {"class": scheduler["class"], "state": decode(scheduler["state"], saved.aux, where)}
        if not isinstance(scheduler["state"], dict):
            raise malformed(where, f"must be an object, got {type(scheduler['state']).__name__}")
    own = {"rank": 0, "rng": rng_state, "scheduler": scheduler, "extra": extra}
    layout = {
        "format": FORMAT,
        "version": SHARDED_VERSION,
        "layout": "torch.distributed.checkpoint",
        "world_size": 1,
        "step": meta["step"],
        "torch": torch.__version__,
        "state": encoded,
        "tensors": {key: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                    for key, t in tensors.items()},
        "aliases": dict(meta["aliases"]),
    }
    return layout, tensors, own


def _model(saved: Any) -> dict[str, Tensor]:
    """Model entries by name in the model's own dtype (a tied weight once, under its canonical name)."""
    out: dict[str, Tensor] = {}
    for name, info in saved.meta["model"].items():
        out[name] = saved.model[name].to(getattr(torch, info["dtype"]))  # the master rounded as load() rounds it
    return out  # a tied weight's aliases are meta.json's "aliases", as a save writes them


def _optimizer(saved: Any) -> dict[str, Any]:
    """The optimizer's state as DCP's get_optimizer_state_dict lays it out: states and groups by parameter name."""
    meta = saved.meta
    where = f"{saved.meta_file}: optimizer"
    states: dict[str, Any] = {}
    for name, entry in meta["optimizer"]["states"].items():
        state = dict(decode(entry, saved.optimizer, f"{where}/states/{codec.part(name)}"))
        info = meta["model"].get(name)
        if info is not None and info.get("stored_dtype", info["dtype"]) != info["dtype"]:
            state[MASTER_KEY] = saved.model[name]  # the float32 master, which layout 1 stored as the model entry
        states[name] = state
    groups = []
    for gi, group in enumerate(meta["optimizer"]["groups"]):
        hyper = decode(group["hyper"], saved.aux, f"{where}/groups/{gi}/hyper")
        groups.append({**hyper, "params": list(group["param_names"])})
    return {"state": states, "param_groups": groups}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload_adamw.checkpoint.convert",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("src", help="a one-process checkpoint directory (layout 1)")
    parser.add_argument("dst", help="where to write the sharded checkpoint (must not exist)")
    args = parser.parse_args(argv)
    try:
        out = convert(args.src, args.dst)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
