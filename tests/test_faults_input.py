"""Malformed checkpoints and impossible states: a clean refusal naming the culprit, and nothing changed.

The checkpoints here pass their checksums (they are re-committed after the
edit, as a buggy writer or a copy tool would leave them), so only the checks
of their content stand between them and a half-loaded run.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _fault_worker import Net, build, train
from _layout1_writer import save_layout1
from _parity import assert_same_snapshot
from offload_adamw import OffloadAdamW, StateDictMismatch, checkpoint
from offload_adamw.checkpoint import CheckpointCorrupt, CheckpointError, CheckpointMismatch, codec, layout, publication


def snapshot(model, optimizer, scheduler) -> dict:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            out[f"opt/{i}/{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    out["groups"] = repr([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    out["scheduler"] = repr(scheduler.state_dict())
    out["rng"] = torch.get_rng_state().clone()
    out["python_rng"] = random.getstate()
    return out


def recommit(path: Path, meta: dict | None = None, meta_bytes: bytes | None = None) -> None:
    """Replace meta.json and make the manifest and the commit marker vouch for every file again."""
    if meta_bytes is None and meta is not None:
        meta_bytes = json.dumps(meta).encode()
    if meta_bytes is not None:
        (path / checkpoint.META_FILE).write_bytes(meta_bytes)
    files = {
        name: {"bytes": (path / name).stat().st_size, "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest()}
        for name in layout.DATA_FILES
    }
    manifest = json.dumps({"format": checkpoint.FORMAT, "version": 1, "files": files}).encode()
    (path / checkpoint.MANIFEST_FILE).write_bytes(manifest)
    (path / checkpoint.COMMIT_FILE).write_text(
        json.dumps({"format": checkpoint.FORMAT, "manifest_sha256": hashlib.sha256(manifest).hexdigest()})
    )


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of the old one-process layout (version 1), which ``load`` still reads: its reader's checks of
    meta.json and of the stored tensors are what these tests edit past the seal."""
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 2)
    return save_layout1(tmp_path / "root" / "b", model, optimizer, scheduler, extra={"epoch": 1, "t": torch.ones(2)})


def _meta(path: Path) -> dict:
    return json.loads((path / checkpoint.META_FILE).read_text())


def _edit(key_path: tuple, value):
    def edit(meta):
        target = meta
        for k in key_path[:-1]:
            target = target[k]
        target[key_path[-1]] = value
        return meta

    return edit


MALFORMED = {
    "step_a_string": _edit(("step",), "three"),
    "step_negative": _edit(("step",), -2),
    "model_a_list": _edit(("model",), []),
    "shape_a_string": _edit(("model", "inp.bias", "shape"), "12"),
    "dtype_unknown": _edit(("model", "inp.bias", "dtype"), "float99"),
    "entry_a_number": _edit(("model", "inp.bias"), 7),
    "missing_model": lambda meta: {k: v for k, v in meta.items() if k != "model"},
    "groups_a_dict": _edit(("optimizer", "groups"), {"a": 1}),
    "param_names_numbers": _edit(("optimizer", "groups", 0, "param_names"), [1, 2]),
    "hyper_a_list": _edit(("optimizer", "groups", 0, "hyper"), [1]),
    "state_a_list": _edit(("optimizer", "states", "inp.bias"), [1]),
    "tensor_ref_unknown": _edit(("extra", "t"), {"__tensor__": "extra/nowhere"}),
    "tensor_ref_a_number": _edit(("extra", "t"), {"__tensor__": 5}),
    "dtype_ref_unknown": _edit(("extra", "t"), {"__dtype__": "not_a_dtype"}),
    "unhashable_key": _edit(("extra",), {"__items__": [[["a", "list"], 1]]}),
    "items_a_number": _edit(("extra",), {"__items__": 3}),
    "tuple_a_number": _edit(("extra",), {"__tuple__": 3}),
    "scheduler_class_a_number": _edit(("scheduler", "class"), 3),
    "scheduler_state_a_list": _edit(("scheduler", "state"), [1, 2]),
    "rng_a_list": _edit(("rng",), [1]),
    "rng_torch_a_number": _edit(("rng", "torch"), 1),
    "rng_python_wrong": _edit(("rng", "python"), {"__tuple__": [3, {"__tuple__": [1, 2]}, None]}),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_metadata_is_refused_naming_the_file_and_nothing_changes(saved, case):
    recommit(saved, MALFORMED[case](_meta(saved)))
    model, optimizer, scheduler = build(seed=3)
    train(model, optimizer, scheduler, 1)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(CheckpointCorrupt) as info:
        checkpoint.load(saved, model, optimizer, scheduler)
    assert checkpoint.META_FILE in str(info.value) and "malformed" in str(info.value), str(info.value)
    assert_same_snapshot(snapshot(model, optimizer, scheduler), before)


def test_nesting_too_deep_for_the_parser_is_refused(saved):
    meta = json.dumps(_meta(saved))
    deep = "[" * 200_000 + "]" * 200_000
    recommit(saved, meta_bytes=meta.replace('"extra": {', f'"deep": {deep}, "extra": {{', 1).encode())
    model, optimizer, scheduler = build(seed=3)
    with pytest.raises(CheckpointCorrupt, match="nested too deeply"):
        checkpoint.load(saved, model, optimizer, scheduler)


def test_latest_skips_a_malformed_checkpoint_and_says_why(saved):
    good = saved.parent / "a"
    model, optimizer, scheduler = build()
    checkpoint.save(good, model, optimizer, scheduler, step=1)
    recommit(saved, _edit(("optimizer", "groups"), {"a": 1})(_meta(saved)))
    with pytest.warns(RuntimeWarning, match="skipping .*b.*optimizer\\['groups'\\]"):
        assert checkpoint.latest(saved.parent) == good
    recommit(saved, meta_bytes=b"[" * 100_000 + b"]" * 100_000)
    shutil.rmtree(good)
    with pytest.warns(RuntimeWarning, match="nested too deeply"):
        assert checkpoint.latest(saved.parent) is None


def test_stored_tensor_shape_is_checked_not_the_declared_one(saved):
    """meta.json says (12,), the file holds a (1,) tensor: it must not be broadcast into the parameter."""
    tensors = load_file(str(saved / layout.MODEL_FILE))
    tensors["inp.bias"] = tensors["inp.bias"][:1].clone()
    save_file(tensors, str(saved / layout.MODEL_FILE), metadata={"format": checkpoint.FORMAT})
    recommit(saved)
    model, optimizer, scheduler = build(seed=3)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(CheckpointCorrupt, match="'inp.bias' is float32 \\(1,\\), meta.json says float32 \\(12,\\)"):
        checkpoint.load(saved, model, optimizer, scheduler)
    with pytest.raises(CheckpointCorrupt):
        checkpoint.load(saved, model, optimizer, scheduler, strict=False)
    assert_same_snapshot(snapshot(model, optimizer, scheduler), before)


def test_stored_tensor_dtype_is_checked(saved):
    tensors = load_file(str(saved / layout.MODEL_FILE))
    tensors["inp.bias"] = tensors["inp.bias"].to(torch.int32)
    save_file(tensors, str(saved / layout.MODEL_FILE), metadata={"format": checkpoint.FORMAT})
    recommit(saved)
    with pytest.raises(CheckpointCorrupt, match="'inp.bias' is int32"):
        checkpoint.load(saved, *build(seed=3))


def test_scheduler_refusing_its_state_leaves_everything_as_it_was(saved):
    """Keys match, LambdaLR.load_state_dict fails half-way: scheduler, optimizer, model, RNG all as before."""
    meta = _meta(saved)
    meta["scheduler"]["state"]["lr_lambdas"] = [None, None, {"x": 1}]  # three lambdas for a two-group scheduler
    meta["scheduler"]["state"]["last_epoch"] = 1234
    recommit(saved, meta)
    model, optimizer, scheduler = build(seed=3)
    train(model, optimizer, scheduler, 1)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(CheckpointMismatch, match="scheduler LambdaLR refused its state"):
        checkpoint.load(saved, model, optimizer, scheduler)
    assert_same_snapshot(snapshot(model, optimizer, scheduler), before)


def test_optimizer_refusal_puts_the_scheduler_back(saved):
    meta = _meta(saved)
    meta["optimizer"]["groups"][0]["hyper"]["lr"] = -1.0
    meta["scheduler"]["state"]["last_epoch"] = 1234
    recommit(saved, meta)
    model, optimizer, scheduler = build(seed=3)
    train(model, optimizer, scheduler, 1)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(CheckpointMismatch, match="Invalid learning rate: -1.0"):
        checkpoint.load(saved, model, optimizer, scheduler)
    assert_same_snapshot(snapshot(model, optimizer, scheduler), before)


def test_extra_keys_that_look_alike_do_not_collide(tmp_path):
    model, optimizer, scheduler = build()
    extra = {
        "train/loss": torch.tensor([1.0]),
        "train": {"loss": torch.tensor([2.0])},
        "a%2Fb": torch.tensor([3.0]),
        "a/b": torch.tensor([4.0]),
    }
    path = checkpoint.save(tmp_path / "c", model, optimizer, scheduler, extra=extra)
    back = checkpoint.load(path, *build(seed=1)).extra
    assert torch.equal(back["train/loss"], torch.tensor([1.0])) and torch.equal(back["train"]["loss"], torch.tensor([2.0]))
    assert torch.equal(back["a%2Fb"], torch.tensor([3.0])) and torch.equal(back["a/b"], torch.tensor([4.0]))


def test_meta_device_model_is_refused_naming_the_tensors(saved):
    with torch.device("meta"):
        model = Net()
    with pytest.raises(CheckpointMismatch) as info:
        checkpoint.load(saved, model, None, rng=False)
    assert "meta device 'inp.weight'" in str(info.value) and "to_empty" in str(info.value)
    report = checkpoint.load(saved, model, None, strict=False, rng=False)
    assert report.loaded == [] and len(report.problems) == 4


def test_meta_device_optimizer_load_is_refused(saved):
    model, optimizer, _ = build()
    state_dict = optimizer.state_dict()
    with torch.device("meta"):
        meta_model = Net()
    meta_opt = OffloadAdamW(
        [{"params": list(meta_model.named_parameters())[:2]}, {"params": list(meta_model.named_parameters())[2:]}]
    )
    train(model, optimizer, build()[2], 1)
    with pytest.raises(StateDictMismatch, match="meta device"):
        meta_opt.load_state_dict(optimizer.state_dict())
    assert len(meta_opt.state) == 0
    del state_dict


# ------------------------------------------------------------ clean-up


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _fake_temporary(parent: Path, name: str, files=("model.safetensors", "COMMIT")) -> Path:
    path = parent / name
    path.mkdir()
    for f in files:
        (path / f).write_bytes(b"x")
    return path


def test_clean_up_removes_only_what_this_machine_provably_abandoned(tmp_path):
    model, optimizer, scheduler = build()
    dead = _dead_pid()
    me = publication.owner()
    other_host = "0123456789abcdef" if me != "0123456789abcdef" else "fedcba9876543210"
    abandoned = _fake_temporary(tmp_path, f".c.tmp-{me}-{dead}-deadbeef")
    foreign = _fake_temporary(tmp_path, f".c.tmp-{other_host}-{dead}-deadbeef")  # another host's save in progress
    legacy_user = _fake_temporary(tmp_path, f".c.tmp-{dead}-deadbeef", files=("notes.txt",))  # a user's directory
    user_look_alike = _fake_temporary(tmp_path, f".c.tmp-{me}-{dead}-cafebabe", files=("notes.txt",))
    alive = _fake_temporary(tmp_path, f".c.tmp-{me}-{os.getppid()}-0badf00d")
    checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    assert not abandoned.exists()
    assert foreign.exists() and legacy_user.exists() and user_look_alike.exists() and alive.exists()


def test_clean_up_removes_a_save_killed_inside_safetensors_write(tmp_path):
    """safetensors writes each file through a temporary beside it (".tmp" and 6 characters); a kill during
    that write leaves it in the save's directory, which is still this machine's abandoned save."""
    model, optimizer, scheduler = build()
    killed = _fake_temporary(tmp_path, f".c.tmp-{publication.owner()}-{_dead_pid()}-deadbeef",
                             files=("model.safetensors", ".tmpGK2aFn"))
    checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    assert not killed.exists()


def test_clean_up_spares_a_temporary_whose_lock_is_held(tmp_path):
    model, optimizer, scheduler = build()
    locked = _fake_temporary(tmp_path, f".c.tmp-{publication.owner()}-{_dead_pid()}-deadbeef")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)", str(locked)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
        assert locked.exists()
    finally:
        holder.kill()
        holder.wait()
    checkpoint.save(tmp_path / "c", model, optimizer, scheduler, overwrite=True)
    assert not locked.exists()


def test_kept_previous_checkpoint_is_found_by_load_latest_and_resolve(tmp_path, monkeypatch):
    """A save without the exchange, killed between its two renames: only the .prev- copy is left."""
    monkeypatch.setenv(checkpoint.ENV_EXCHANGE, "0")
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 1)
    final = checkpoint.save(tmp_path / "c", model, optimizer, scheduler, step=1)
    previous = final.with_name(f".c.prev-{publication.owner()}-{_dead_pid()}-deadbeef")  # the killed writer's name
    os.rename(final, previous)
    assert checkpoint.resolve(final) == previous
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checkpoint.latest(tmp_path) == previous
    report = checkpoint.load(final, *build(seed=4))
    assert report.step == 1 and report.path == str(previous)
    train(model, optimizer, scheduler, 1)
    checkpoint.save(final, model, optimizer, scheduler, step=2, overwrite=True)
    assert checkpoint.resolve(final) == final and checkpoint.latest(tmp_path) == final
    checkpoint.save(tmp_path / "d", model, optimizer, scheduler, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]  # the kept copy goes once "c" is complete again
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        checkpoint.load(tmp_path / "nothing", *build())


# --------------------------------------------------- impossible optimizer states


def _stepped_state_dict():
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 2)
    return optimizer.state_dict()


def _set_state(key, value, pid=0):
    def edit(sd):
        sd["state"][pid][key] = value(sd["state"][pid][key]) if callable(value) else value
        return sd

    return edit


def _set_group(key, value, gi=0):
    def edit(sd):
        sd["param_groups"][gi][key] = value
        return sd

    return edit


NAN, INF = float("nan"), float("inf")
IMPOSSIBLE = {
    "exp_avg_sq_negative": (_set_state("exp_avg_sq", lambda t: t - 1.0), "exp_avg_sq holds a negative"),
    "exp_avg_sq_nan": (_set_state("exp_avg_sq", lambda t: t * NAN), "exp_avg_sq holds a negative, infinite or NaN"),
    "max_exp_avg_sq_negative": (_set_state("max_exp_avg_sq", lambda t: -t - 1.0, pid=2), "max_exp_avg_sq holds a negative"),
    "exp_avg_inf": (_set_state("exp_avg", lambda t: t + INF), "exp_avg holds inf or NaN"),
    "exp_avg_nan": (_set_state("exp_avg", lambda t: t * NAN), "exp_avg holds inf or NaN"),
    "exp_avg_a_string": (_set_state("exp_avg", "zeros"), "exp_avg must be a tensor"),
    "step_negative": (_set_state("step", torch.tensor(-1.0)), "step must be a non-negative whole number, got -1.0"),
    "step_fractional": (_set_state("step", torch.tensor(2.5)), "step must be a non-negative whole number, got 2.5"),
    "step_inf": (_set_state("step", torch.tensor(INF)), "step must be a non-negative whole number, got inf"),
    "step_nan": (_set_state("step", NAN), "step must be a non-negative whole number, got nan"),
    "step_beyond_2_24": (_set_state("step", torch.tensor(2.0**24 + 2)), "step 16777218 is beyond 2\\*\\*24"),
    "step_a_string": (_set_state("step", "2"), "step must be a number, got str"),
    "step_a_vector": (_set_state("step", torch.ones(3)), "step must be one number"),
    "lr_negative": (_set_group("lr", -1.0), "Invalid learning rate: -1.0"),
    "lr_nan": (_set_group("lr", NAN), "Invalid learning rate: nan"),
    "beta_one": (_set_group("betas", (1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
    "betas_a_string": (_set_group("betas", "0.9"), "betas must be a pair"),
    "eps_negative": (_set_group("eps", -1e-8), "Invalid epsilon value"),
    "weight_decay_negative": (_set_group("weight_decay", -5.0), "Invalid weight_decay value: -5.0"),
    "lr_a_string": (_set_group("lr", "fast"), "malformed hyperparameters"),
    "amsgrad_a_string": (_set_group("amsgrad", "yes"), "amsgrad must be True or False"),
    "state_entry_a_list": (lambda sd: {**sd, "state": {**sd["state"], 0: [1, 2]}}, "state entry 0 must be a dict"),
    "state_a_list": (lambda sd: {**sd, "state": []}, "state must be a dict"),
    "groups_a_dict": (lambda sd: {**sd, "param_groups": {}}, "param_groups must be a list"),
    "group_without_params": (
        lambda sd: {**sd, "param_groups": [{"lr": 1.0}, *sd["param_groups"][1:]]},
        "must be a dict with a list 'params'",
    ),
    "param_names_too_short": (_set_group("param_names", ["inp.weight"]), "one per entry of 'params'"),
}


@pytest.mark.parametrize("case", IMPOSSIBLE)
def test_impossible_state_is_refused_naming_the_culprit_and_changing_nothing(case):
    edit, message = IMPOSSIBLE[case]
    state_dict = edit(_stepped_state_dict())
    model, optimizer, scheduler = build(seed=3)
    train(model, optimizer, scheduler, 1)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(StateDictMismatch, match=message) as info:
        optimizer.load_state_dict(state_dict)
    if case.startswith(("exp_avg", "max_", "step")):
        assert "parameter 'inp.weight'" in str(info.value) or "parameter 'inp.bias'" in str(info.value), str(info.value)
    assert_same_snapshot(snapshot(model, optimizer, scheduler), before)


@pytest.mark.parametrize("case", ["exp_avg_sq_negative", "step_beyond_2_24", "weight_decay_negative"])
def test_impossible_state_in_a_checkpoint_is_refused_by_load(tmp_path, case):
    edit, message = IMPOSSIBLE[case]
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 2)
    sd = edit(optimizer.state_dict())
    # write the impossible values into the optimizer itself, then checkpoint it
    for state, saved in zip(optimizer.state.values(), sd["state"].values()):
        state.update({k: v for k, v in saved.items()})
    optimizer.param_groups[0]["weight_decay"] = sd["param_groups"][0]["weight_decay"]
    path = checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    target = build(seed=3)
    before = snapshot(*target)
    with pytest.raises(CheckpointMismatch, match=message):
        checkpoint.load(path, *target)
    assert_same_snapshot(snapshot(*target), before)


def test_an_unwritable_buffer_is_refused_before_anything_is_committed(saved):
    """A buffer copy_ cannot write (an expanded tensor) would fail after the optimizer was committed."""
    model, optimizer, scheduler = build(seed=3)
    train(model, optimizer, scheduler, 1)
    model.register_buffer("counts", torch.zeros(1).expand(4))
    tensors = load_file(str(saved / layout.MODEL_FILE))
    tensors["counts"] = torch.ones(4)
    save_file(tensors, str(saved / layout.MODEL_FILE), metadata={"format": checkpoint.FORMAT})
    meta = _meta(saved)
    meta["model"]["counts"] = {"dtype": "float32", "shape": [4], "stored_dtype": "float32"}
    recommit(saved, meta)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(CheckpointMismatch, match="unwritable 'counts'"):
        checkpoint.load(saved, model, optimizer, scheduler)
    assert_same_snapshot(snapshot(model, optimizer, scheduler), before)


# ------------------------------------------- extra: a law, not an example

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_keys = st.text(alphabet="a/%2F_", min_size=0, max_size=4)
_leaves = st.one_of(st.integers(-5, 5), st.none(), st.integers(0, 9).map(lambda n: torch.arange(n, dtype=torch.float32)))
_values = st.recursive(
    _leaves, lambda inner: st.one_of(st.dictionaries(_keys, inner, max_size=4), st.lists(inner, max_size=3)), max_leaves=12
)


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same_value, a, b))
    return a == b


@settings(max_examples=200, deadline=None)
@given(_values)
def test_extra_round_trips_whatever_its_keys(value):
    """Keys with "/" and "%" in any nesting: every tensor is stored under its own name and comes back in its place."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = codec.encode(value, tensors, "extra")
    assert _same_value(codec.decode(json.loads(json.dumps(encoded)), tensors, "meta.json: extra"), value)


# ------------------------------------------------- malformed metadata of the current layout

import _checkpoint_files as files  # noqa: E402


def _edit_json(name: str, edit):
    def apply(path: Path) -> None:
        data = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps(edit(data)))

    return apply


MALFORMED_NOW = {
    "step_a_string": (checkpoint.META_FILE, _edit(("step",), "three")),
    "state_a_list": (checkpoint.META_FILE, _edit(("state",), [])),
    "tensors_shape_a_string": (checkpoint.META_FILE, _edit(("tensors", "state/model/inp.bias", "shape"), "12")),
    "tensor_ref_unknown": (checkpoint.META_FILE, _edit(("state", "model", "inp.bias"), {"__tensor__": "nowhere"})),
    "aliases_a_list": (checkpoint.META_FILE, _edit(("aliases",), ["a"])),
    "rank_rng_a_list": ("rank-00000.json", _edit(("rng",), [1])),
    "rank_scheduler_state_a_list": ("rank-00000.json", _edit(("scheduler", "state"), [1, 2])),
    "rank_extra_ref_unknown": ("rank-00000.json", _edit(("extra", "t"), {"__tensor__": "extra/nowhere"})),
}


@pytest.mark.parametrize("case", MALFORMED_NOW)
def test_malformed_metadata_of_the_current_layout_is_refused_naming_the_file_and_nothing_changes(tmp_path, case):
    """What a save writes now (layout 2), edited past its seal: a refusal naming the file, nothing changed."""
    name, edit = MALFORMED_NOW[case]
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 2)
    path = checkpoint.save(tmp_path / "c", model, optimizer, scheduler, extra={"epoch": 1, "t": torch.ones(2)})
    _edit_json(name, edit)(path)
    files.reseal(path)
    model, optimizer, scheduler = build(seed=3)
    train(model, optimizer, scheduler, 1)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(CheckpointCorrupt) as info:
        checkpoint.load(path, model, optimizer, scheduler)
    assert name in str(info.value) and "malformed" in str(info.value), str(info.value)
    assert_same_snapshot(snapshot(model, optimizer, scheduler), before)
