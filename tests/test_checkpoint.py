"""checkpoint.save / load: exact resume, name-verified loading, all-or-nothing, no pickle.

The mismatch tests are a table of (checkpoint source, target) configurations
crossed with two properties: strict loading raises one error naming every
culprit and changes nothing; non-strict loading loads exactly what matches and
leaves the rest as it was.
"""

from __future__ import annotations

import json
import pickle
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import _checkpoint_files as files
from _fault_worker import Net, build, groups, train
from _layout1_writer import save_layout1
from configs import same_bits
from offload_adamw import OffloadAdamW, StateDictMismatch, checkpoint
from offload_adamw.checkpoint import CheckpointError, CheckpointMismatch, layout
from offload_adamw.checkpoint.layout import rank_files


def snapshot(model, optimizer, scheduler=None) -> dict:
    """Every tensor and value a load could change, copied (optimizer states by parameter name)."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    name = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            out[f"opt/{name[id(p)]}/{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    out["groups"] = repr([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    if scheduler is not None:
        out["scheduler"] = repr(scheduler.state_dict())
    out["rng"] = torch.get_rng_state().clone()
    return out


def assert_same(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key.startswith(skip):
            continue
        if isinstance(a[key], torch.Tensor):
            assert same_bits(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# ------------------------------------------------------------------ resume


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_resume_is_bitwise_equal_to_uninterrupted(tmp_path, out_dtype):
    model, optimizer, scheduler = build(out_dtype=out_dtype)
    train(model, optimizer, scheduler, 3)
    checkpoint.save(tmp_path / "c", model, optimizer, scheduler, extra={"epoch": 1})
    train(model, optimizer, scheduler, 3)  # batches and dropout come from the RNG: it must be restored too
    expected = snapshot(model, optimizer, scheduler)

    model2, optimizer2, scheduler2 = build(seed=99, out_dtype=out_dtype)
    report = checkpoint.load(tmp_path / "c", model2, optimizer2, scheduler2)
    assert report.ok and report.step == 3 and report.extra == {"epoch": 1}
    assert report.optimizer_restored and report.scheduler_restored and report.rng_restored
    train(model2, optimizer2, scheduler2, 3)
    assert_same(snapshot(model2, optimizer2, scheduler2), expected)


def test_low_precision_parameters_are_saved_with_their_float32_masters(tmp_path):
    """The float32 master of a bf16 parameter is the source of truth: stored bit for bit next to the bf16 value
    (the optimizer's state, keyed by the parameter's name), and a resume continues from it (see the resume test)."""
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 2)
    path = checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    entries = files.model_entries(path)
    assert model.out.weight.dtype == torch.bfloat16
    for name, p in model.named_parameters():
        assert same_bits(entries[name], p.detach()), name
        master = optimizer.master_param(p)
        if p.dtype != torch.float32:
            assert same_bits(files.optimizer_entry(path, name, "master_param"), master), name
    assert files.optimizer_entry(path, "out.weight", "master_param").dtype == torch.float32
    assert not torch.equal(files.optimizer_entry(path, "out.weight", "master_param"),
                           model.out.weight.float())  # the master carries more bits
    assert files.meta(path)["tensors"]["state/model/out.weight"]["dtype"] == "bfloat16"
    keys = set(files.tensors(path))
    assert "state/optimizer/state/out.weight/exp_avg" in keys and "state/optimizer/state/out.bias/max_exp_avg_sq" in keys


def test_files_are_safetensors_and_json_and_load_never_unpickles(tmp_path, monkeypatch):
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 1)
    path = checkpoint.save(tmp_path / "c", model, optimizer, scheduler, extra={"t": torch.arange(3), "pair": (1, 2.5)})
    shard, (own_json, own_tensors) = "shard-00001-model-00001-of-00001.safetensors", rank_files(0)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [shard, own_json, own_tensors, checkpoint.META_FILE, checkpoint.MANIFEST_FILE, checkpoint.COMMIT_FILE]
    )
    assert not (path / ".metadata").exists()  # DCP's own metadata file is a pickle: never written
    with safe_open(str(path / shard), "pt") as f:
        assert f.metadata()["format"] == "pt" and "DCP_SHARDING_INFO" in f.metadata()
    with safe_open(str(path / own_tensors), "pt") as f:
        assert f.metadata()["format"] == checkpoint.FORMAT
    for name in (checkpoint.META_FILE, own_json, checkpoint.MANIFEST_FILE, checkpoint.COMMIT_FILE):
        json.loads((path / name).read_text())

    def refuse(*args, **kwargs):
        raise AssertionError("load must not unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    model2, optimizer2, scheduler2 = build(seed=1)
    report = checkpoint.load(path, model2, optimizer2, scheduler2)
    assert torch.equal(report.extra["t"], torch.arange(3)) and report.extra["pair"] == (1, 2.5)


def test_unsaveable_objects_are_refused_before_the_disk_is_touched(tmp_path):
    model, optimizer, scheduler = build()
    with pytest.raises(CheckpointError, match="extra/callback"):
        checkpoint.save(tmp_path / "c", model, optimizer, scheduler, extra={"callback": print})
    assert list(tmp_path.iterdir()) == []


def test_extra_and_rng_round_trip(tmp_path):
    np = pytest.importorskip("numpy")
    model, optimizer, scheduler = build()
    extra = {
        "nested": [(1, "a"), {"k": None}],
        3: "int key",
        "__x": 1.5,
        "inf": float("inf"),
        "t": torch.ones(2, dtype=torch.bfloat16),
    }
    checkpoint.save(tmp_path / "c", model, optimizer, scheduler, extra=extra)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(5), random.random(), np.random.rand()  # move every generator on
    report = checkpoint.load(tmp_path / "c", model, optimizer, scheduler)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    extra_back = report.extra
    assert extra_back["nested"] == [(1, "a"), {"k": None}] and extra_back[3] == "int key"
    assert extra_back["__x"] == 1.5 and extra_back["inf"] == float("inf")
    assert same_bits(extra_back["t"], extra["t"])


def test_overwrite_needs_the_flag_and_leaves_no_temporaries(tmp_path):
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 1)
    checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    train(model, optimizer, scheduler, 1)
    with pytest.raises(CheckpointError, match="overwrite=True"):
        checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    assert checkpoint.load(tmp_path / "c", build()[0], None).step == 1
    checkpoint.save(tmp_path / "c", model, optimizer, scheduler, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    assert checkpoint.load(tmp_path / "c", build()[0], None).step == 2
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        checkpoint.save(tmp_path / "data", model, optimizer, scheduler, overwrite=True)
    assert (tmp_path / "data" / "precious.txt").read_text() == "not a checkpoint"


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    def tied():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
        m[1].weight = m[0].weight
        return m, OffloadAdamW(m.named_parameters(), lr=0.1)

    model, optimizer = tied()
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    checkpoint.save(tmp_path / "c", model, optimizer)
    assert files.meta(tmp_path / "c")["aliases"] == {"1.weight": "0.weight"}
    assert set(files.model_entries(tmp_path / "c")) == {"0.weight"}
    model2, optimizer2 = tied()
    assert checkpoint.load(tmp_path / "c", model2, optimizer2).ok
    assert model2[1].weight is model2[0].weight and torch.equal(model2[0].weight, model[0].weight)


def test_generic_torch_optimizer_round_trip(tmp_path):
    def make():
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3)
        return m, torch.optim.AdamW(m.parameters(), lr=0.1)

    model, optimizer = make()
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    checkpoint.save(tmp_path / "c", model, optimizer)
    model2, optimizer2 = make()
    checkpoint.load(tmp_path / "c", model2, optimizer2)
    assert_same(snapshot(model2, optimizer2), snapshot(model, optimizer))


# ----------------------------------------------------------- name matching


class AB(torch.nn.Module):
    """Two same-shape parameters registered in a given order: positions swap, names do not."""

    def __init__(self, order: str):
        super().__init__()
        for name in order:
            setattr(self, name, torch.nn.Parameter(torch.zeros(4)))


def _stepped(order: str):
    model = AB(order)
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=0.1)
    model.a.grad, model.b.grad = torch.full((4,), 1.0), torch.full((4,), -3.0)
    optimizer.step()
    return model, optimizer


def test_torch_adamw_state_dict_into_reordered_model_is_matched_by_name():
    model, torch_opt = _stepped("ab")
    state_dict = torch_opt.state_dict()
    expected = {n: torch_opt.state[p]["exp_avg"] for n, p in model.named_parameters()}

    reordered = AB("ba")
    # torch matches by position: a's moments silently land on b. This is the hazard.
    positional = torch.optim.AdamW(reordered.named_parameters())
    positional.load_state_dict(state_dict)
    assert torch.equal(positional.state[reordered.a]["exp_avg"], expected["b"])

    offload = OffloadAdamW(reordered.named_parameters())
    offload.load_state_dict(state_dict)
    for name, p in reordered.named_parameters():
        assert torch.equal(offload.state[p]["exp_avg"], expected[name]), name


def test_torch_adamw_state_dict_with_other_names_is_refused_naming_both():
    _, torch_opt = _stepped("ab")
    renamed = torch.nn.Module()
    renamed.a, renamed.c = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    offload = OffloadAdamW(renamed.named_parameters())
    with pytest.raises(StateDictMismatch) as info:
        offload.load_state_dict(torch_opt.state_dict())
    assert "'b'" in str(info.value) and "'c'" in str(info.value)
    assert len(offload.state) == 0


def test_checkpoint_into_reordered_model_is_matched_by_name_even_without_param_names(tmp_path):
    model = AB("ab")
    optimizer = OffloadAdamW(model.parameters(), lr=0.1)  # no param_names: the checkpoint takes names from the model
    model.a.grad, model.b.grad = torch.full((4,), 1.0), torch.full((4,), -3.0)
    optimizer.step()
    checkpoint.save(tmp_path / "c", model, optimizer)
    reordered = AB("ba")
    optimizer2 = OffloadAdamW(reordered.parameters(), lr=0.1)
    checkpoint.load(tmp_path / "c", reordered, optimizer2)
    for name in "ab":
        assert torch.equal(
            optimizer2.state[getattr(reordered, name)]["exp_avg"], optimizer.state[getattr(model, name)]["exp_avg"]
        )
        assert torch.equal(getattr(reordered, name), getattr(model, name))


# --------------------------------------------------------- mismatch table

# name -> (source Net options, target Net options, target optimizer layout, expected report fields)
CASES = {
    "missing": ({}, {"extra": True}, "groups", {"missing": ["extra.bias", "extra.weight"]}),
    "unexpected": ({"extra": True}, {}, "groups", {"unexpected": ["extra.bias", "extra.weight"]}),
    "wrong_shape": ({}, {"hidden": 10}, "groups", {"wrong_shape": ["inp.bias", "inp.weight", "out.weight"]}),
    "wrong_dtype": ({}, {"out_dtype": torch.float32}, "groups", {"wrong_dtype": ["out.bias", "out.weight"]}),
    "moved_group": ({}, {}, "swap", {"group_mismatch": ["inp.bias"]}),
    "group_count": (
        {},
        {},
        "single",
        {"group_mismatch": ["inp.bias", "out.bias"], "problem": "2 parameter group(s), the optimizer has 1"},
    ),
    "everything": (
        {},
        {"extra": True, "hidden": 10, "out_dtype": torch.float32},
        "groups",
        {
            "missing": ["extra.bias", "extra.weight"],
            "wrong_shape": ["inp.bias", "inp.weight", "out.weight"],
            "wrong_dtype": ["out.bias"],
        },
    ),
}


def _target(net_options: dict, layout: str):
    torch.manual_seed(42)
    model = Net(**net_options)
    if layout == "single":
        params = [{"params": list(model.named_parameters()), "weight_decay": 0.3}]
    else:
        params = groups(model, swap=layout == "swap")
    optimizer = OffloadAdamW(params, lr=5e-3, pin_memory=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5)
    # The target has state of its own, which a refused load must keep.
    x = torch.randn(5, 6)
    model(x).sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return model, optimizer, scheduler


@pytest.fixture(scope="module", params=["current", "layout1"])
def sources(request, tmp_path_factory):
    """The sources as ``save`` writes them, and as the old one-process writer wrote them (loaded in place)."""
    root = tmp_path_factory.mktemp("sources")
    write = checkpoint.save if request.param == "current" else save_layout1
    out = {}
    for extra in (False, True):
        model, optimizer, scheduler = build(extra=extra)
        train(model, optimizer, scheduler, 2)
        out[extra] = write(root / f"extra-{extra}", model, optimizer, scheduler)
    return out


def stored(path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model entries, exp_avg) by name as the checkpoint stores them (layout 1: a bf16 entry as its master)."""
    if checkpoint.verify(path)["version"] == 1:
        moments = load_file(str(path / layout.OPTIMIZER_FILE))
        return load_file(str(path / layout.MODEL_FILE)), {
            k.removesuffix("::exp_avg"): v for k, v in moments.items() if k.endswith("::exp_avg")}
    entries = files.model_entries(path)
    return entries, {name: files.optimizer_entry(path, name, "exp_avg") for name in entries}


def _culprits(expected: dict) -> list[str]:
    return sorted({n for key, names in expected.items() if key != "problem" for n in names})


@pytest.mark.parametrize("case", CASES)
def test_strict_mismatch_names_every_culprit_and_changes_nothing(sources, case):
    source, target, layout, expected = CASES[case]
    model, optimizer, scheduler = _target(target, layout)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(CheckpointMismatch) as info:
        checkpoint.load(sources[source.get("extra", False)], model, optimizer, scheduler)
    message, report = str(info.value), info.value.report
    for name in _culprits(expected):
        assert repr(name) in message, (name, message)
    if "problem" in expected:
        assert expected["problem"] in message
    for field in ("missing", "unexpected", "wrong_shape", "wrong_dtype", "group_mismatch"):
        assert sorted(getattr(report, field)) == sorted(expected.get(field, [])), field
    assert_same(snapshot(model, optimizer, scheduler), before)


@pytest.mark.parametrize("case", CASES)
def test_non_strict_loads_what_matches_and_keeps_the_rest(sources, case):
    source, target, layout, expected = CASES[case]
    path = sources[source.get("extra", False)]
    model, optimizer, scheduler = _target(target, layout)
    before = snapshot(model, optimizer, scheduler)
    report = checkpoint.load(path, model, optimizer, scheduler, strict=False)
    assert not report.ok and sorted(report.missing) == sorted(expected.get("missing", []))
    entries, moments = stored(path)
    # A parameter in another group still gets its model value; only its optimizer state stays.
    bad = set(_culprits({k: v for k, v in expected.items() if k != "group_mismatch"}))
    assert set(report.loaded) == set(entries) - bad - set(report.unexpected)
    for name, value in model.state_dict().items():
        if name in report.loaded:
            assert same_bits(value, entries[name].to(value.dtype)), name  # bf16 = round-to-nearest of the master
        else:
            assert same_bits(value, before[f"model/{name}"]), name
    loaded_groups = layout != "single"
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        if name in report.loaded and name not in report.group_mismatch and loaded_groups:
            assert same_bits(state["exp_avg"], moments[name]), name
        else:
            assert same_bits(state["exp_avg"], before[f"opt/{name}/exp_avg"]), name
        assert same_bits(optimizer.master_param(p).to(p.dtype), p.detach()), name  # model and master agree


def test_refusal_by_the_optimizer_itself_changes_nothing(tmp_path):
    """Names and shapes all match, but a state is invalid: OffloadAdamW.load_state_dict refuses, nothing moves."""
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 1)
    optimizer.state[model.inp.weight]["step"] = torch.tensor(-1.0)
    checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    model2, optimizer2, scheduler2 = _target({}, "groups")
    before = snapshot(model2, optimizer2, scheduler2)
    with pytest.raises(CheckpointMismatch, match="step must be a non-negative whole number"):
        checkpoint.load(tmp_path / "c", model2, optimizer2, scheduler2)
    assert_same(snapshot(model2, optimizer2, scheduler2), before)


def test_scheduler_mismatch_is_reported(tmp_path):
    model, optimizer, scheduler = build()
    checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    other = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    with pytest.raises(CheckpointMismatch, match="LambdaLR"):
        checkpoint.load(tmp_path / "c", model, optimizer, other)
    checkpoint.save(tmp_path / "no-sched", model, optimizer)
    with pytest.raises(CheckpointMismatch, match="no scheduler state"):
        checkpoint.load(tmp_path / "no-sched", model, optimizer, scheduler)


# ------------------------------------------------- RNG states of a CUDA process


def cuda_state(seed: int, offset: int) -> torch.Tensor:
    """A CUDA generator's state as torch.cuda.get_rng_state() returns it: 16 bytes, the seed then the Philox offset."""
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


def with_cuda_rng(path, states) -> None:
    """Rewrite a checkpoint as a process with CUDA initialised saves it: ``states`` as rng/cuda, the seal renewed."""
    own, own_tensors = files.rank_state(path)
    refs = []
    for i, state in enumerate(states):
        own_tensors[f"rng/cuda/{i}"] = state
        refs.append({"__tensor__": f"rng/cuda/{i}"})
    own["rng"]["cuda"] = refs
    files.write_rank_state(path, own, own_tensors)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the checkpoint's CUDA states would be restored here")
def test_a_checkpoint_with_cuda_rng_states_loads_without_cuda_and_says_they_were_not_restored(tmp_path):
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 2)
    path = checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    with_cuda_rng(path, [cuda_state(7, 0), cuda_state(7, 4096)])
    expected = (torch.rand(3), random.random())
    torch.rand(5), random.random()  # move the generators on
    model2, optimizer2, scheduler2 = build(seed=1)
    report = checkpoint.load(path, model2, optimizer2, scheduler2)
    assert report.ok and report.rng_restored  # the generators this process has
    assert (torch.rand(3).tolist(), random.random()) == (expected[0].tolist(), expected[1])
    assert set(report.rng_skipped) == {"cuda"}
    assert "2 CUDA device(s)" in report.rng_skipped["cuda"] and "no CUDA" in report.rng_skipped["cuda"]
    for name, value in model2.state_dict().items():
        assert same_bits(value, model.state_dict()[name]), name


@pytest.mark.parametrize(
    ("states", "why"),
    [
        ([cuda_state(7, 0)[:15]], "15 bytes"),
        ([torch.zeros(16)], "float32"),
        ([cuda_state(7, 0).view(2, 8)], "2-dimensional"),
        ("not-a-list", "a list"),
    ],
    ids=["short", "float", "2d", "not-a-list"],
)
def test_a_malformed_cuda_rng_state_is_refused_naming_it(tmp_path, states, why):
    model, optimizer, scheduler = build()
    path = checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    if isinstance(states, str):
        own, own_tensors = files.rank_state(path)
        own["rng"]["cuda"] = states
        files.write_rank_state(path, own, own_tensors)
    else:
        with_cuda_rng(path, states)
    model2, optimizer2, scheduler2 = build(seed=1)
    before = snapshot(model2, optimizer2, scheduler2)
    with pytest.raises(checkpoint.CheckpointCorrupt, match="rng/cuda") as info:
        checkpoint.load(path, model2, optimizer2, scheduler2)
    assert why in str(info.value)
    assert_same(snapshot(model2, optimizer2, scheduler2), before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_states_are_saved_and_restored_where_cuda_exists(tmp_path):
    torch.cuda.init()
    model, optimizer, scheduler = build()
    path = checkpoint.save(tmp_path / "c", model, optimizer, scheduler)
    expected = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")  # move the generator on
    report = checkpoint.load(path, *build(seed=1))
    assert report.rng_restored and not report.rng_skipped
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    # One device more in the checkpoint than here: the devices both sides have are restored, the rest said.
    states = [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())]
    with_cuda_rng(path, [*states, cuda_state(7, 0)])
    with pytest.warns(RuntimeWarning, match="CUDA device"):
        report = checkpoint.load(path, *build(seed=1))
    assert "were not used" in report.rng_skipped["cuda"]
    assert torch.equal(torch.cuda.get_rng_state(0), states[0])


# ------------------------------------------------- a save in the middle of a step


def _uib_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    opt = OffloadAdamW(model.parameters(), lr=1e-2, offload_gradients=True, update_in_backward=True, bucket_bytes=64)
    return model, opt


def _uib_loss(model, i: int) -> torch.Tensor:
    return model(torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + i))).square().mean()


def test_a_save_between_a_backward_that_updated_and_step_is_refused_before_anything_is_written(tmp_path):
    """update_in_backward=True: a save there would hold this batch's early updates, and a resume apply it twice."""
    model, opt = _uib_model()
    for i in range(2):  # from the second backward on, updates run during backward
        _uib_loss(model, i).backward()
        opt.step()
        opt.zero_grad()
    good = checkpoint.save(tmp_path / "c", model, opt)  # between step() and the next backward: allowed
    kept = files.data_files(good)
    _uib_loss(model, 2).backward()
    with pytest.raises(RuntimeError) as refused_by_optimizer:
        opt.state_dict()
    for target, overwrite in ((tmp_path / "new", False), (good, True)):
        with pytest.raises(CheckpointError) as info:
            checkpoint.save(target, model, opt, overwrite=overwrite)
        assert str(refused_by_optimizer.value) in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # nothing written, no temporaries
    assert files.data_files(good) == kept
    opt.step()  # the step itself completes normally
    opt.zero_grad()
    checkpoint.save(tmp_path / "c", model, opt, overwrite=True)


def test_a_load_between_a_backward_that_updated_and_step_is_refused_and_changes_nothing(tmp_path):
    """The step then ends exactly where a twin run without the load attempt ends (updates of this backward
    may still be running when it returns, so the parameters are compared after step())."""
    runs = []
    for attempt_load in (False, True):
        model, opt = _uib_model()
        for i in range(2):
            _uib_loss(model, i).backward()
            opt.step()
            opt.zero_grad()
        path = checkpoint.save(tmp_path / f"c-{attempt_load}", model, opt)
        _uib_loss(model, 2).backward()
        if attempt_load:
            rng_before = torch.get_rng_state()
            with pytest.raises(CheckpointMismatch, match="update_in_backward=True"):
                checkpoint.load(path, model, opt)
            assert torch.equal(torch.get_rng_state(), rng_before)
        opt.step()
        runs.append(model)
    for (name, p), q in zip(runs[0].named_parameters(), runs[1].parameters()):
        assert same_bits(p.detach(), q.detach()), name


# ------------------------------------------------- the room's layout


@pytest.mark.parametrize("module", ["layout", "errors", "publication"])
def test_the_publication_side_needs_no_torch(module):
    """layout, errors and publication import no torch, and at import time only each other within the package
    (and the leaf _output, which imports nothing: its file_kind names a file that is not regular)."""
    from test_architecture import SRC, direct_torch_imports, import_time_graph

    torch_free = {f"offload_adamw.checkpoint.{m}" for m in ("layout", "errors", "publication")} | {"offload_adamw._output"}
    name = f"offload_adamw.checkpoint.{module}"
    assert direct_torch_imports(SRC / "offload_adamw" / "checkpoint" / f"{module}.py") == []
    assert import_time_graph(SRC)[name] <= torch_free
