"""state_dict layout, loading across OffloadAdamW and torch.optim.AdamW, and name-verified, all-or-nothing loads."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from _parity import same_bits
from offload_adamw import OffloadAdamW, StateDictMismatch


def mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3)).to(dtype)


def train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen).to(dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def snapshot(opt):
    return (
        [{k: [id(p) for p in v] if k == "params" else copy.deepcopy(v) for k, v in g.items()} for g in opt.param_groups],
        {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for p, s in opt.state.items()},
    )


def assert_unchanged(opt, snap):
    groups, state = snap
    assert [{k: [id(p) for p in v] if k == "params" else v for k, v in g.items()} for g in opt.param_groups] == groups
    now = {id(p): s for p, s in opt.state.items()}
    assert now.keys() == state.keys()
    for pid, s in state.items():
        assert now[pid].keys() == s.keys()
        for k, v in s.items():
            assert same_bits(now[pid][k], v) if isinstance(v, torch.Tensor) else now[pid][k] == v


def test_layout_matches_torch_and_states_are_float32_with_masters():
    for dtype in (torch.float32, torch.bfloat16):
        model = mlp(dtype)
        ours = OffloadAdamW(model.parameters(), lr=1e-2)
        # The saved groups are those of the torch optimizer the run equals: fused (test_leaving_for_torch_... below).
        theirs = torch.optim.AdamW(mlp(dtype).parameters(), lr=1e-2, fused=True)
        train(model, ours, 2)
        sd = ours.state_dict()
        assert sd["param_groups"] == theirs.state_dict()["param_groups"]
        assert sorted(sd["state"]) == [0, 1, 2, 3]
        for entry in sd["state"].values():
            assert entry["step"].dtype == torch.float32 and entry["step"].item() == 2
            assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.float32
            assert ("master_param" in entry) == (dtype != torch.float32)


def test_torch_state_dict_loads_and_offload_state_dict_loads_into_torch_bitwise():
    model_a, model_b = mlp(), mlp()
    torch_opt = torch.optim.AdamW(model_a.parameters(), lr=1e-2, fused=True)
    train(model_a, torch_opt, 5)
    model_b.load_state_dict(model_a.state_dict())
    ours = OffloadAdamW(model_b.parameters(), lr=1e-2)
    ours.load_state_dict(torch_opt.state_dict())
    train(model_a, torch_opt, 5, seed=2)
    train(model_b, ours, 5, seed=2)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert same_bits(p, q)
    # ... and back into torch.
    model_c = mlp()
    model_c.load_state_dict(model_b.state_dict())
    torch_again = torch.optim.AdamW(model_c.parameters(), lr=1e-2, fused=True)
    # torch's load keeps same-device tensors by reference: copy so the two runs share nothing.
    torch_again.load_state_dict(copy.deepcopy(ours.state_dict()))
    train(model_b, ours, 4, seed=3)
    train(model_c, torch_again, 4, seed=3)
    for p, q in zip(model_b.parameters(), model_c.parameters()):
        assert same_bits(p, q)


def test_loading_keeps_float32_state_for_bf16_parameters():
    model = mlp(torch.bfloat16)
    ours = OffloadAdamW(model.parameters(), lr=1e-2)
    train(model, ours, 3)
    sd = ours.state_dict()
    fresh_model = mlp(torch.bfloat16, seed=9)
    fresh = OffloadAdamW(fresh_model.parameters(), lr=1e-2)
    fresh.load_state_dict(sd)
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert fresh.state[q][key].dtype == torch.float32
            assert same_bits(fresh.state[q][key], ours.state[p][key])
        assert same_bits(q, p), "the loaded master is written back to the bf16 parameter"
    # torch's own load would have cast the moments to bf16:
    torch_opt = torch.optim.AdamW(mlp(torch.bfloat16).parameters())
    torch_opt.load_state_dict(sd)
    assert next(iter(torch_opt.state.values()))["exp_avg"].dtype == torch.bfloat16


def test_state_dict_survives_torch_save_with_weights_only():
    model = mlp(torch.bfloat16)
    ours = OffloadAdamW(model.named_parameters(), lr=1e-2)
    train(model, ours, 2)
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def named_groups(model, order):
    named = dict(model.named_parameters())
    return [
        {"params": [(n, named[n]) for n in order if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [(n, named[n]) for n in order if n.endswith("bias")], "weight_decay": 0.0},
    ]


def test_names_map_states_to_the_right_tensor_whatever_the_order():
    model = mlp()
    forward = ["0.weight", "0.bias", "2.weight", "2.bias"]
    opt = OffloadAdamW(named_groups(model, forward), lr=1e-2)
    train(model, opt, 3)
    reordered = OffloadAdamW(named_groups(model, list(reversed(forward))), lr=1e-2)
    reordered.load_state_dict(opt.state_dict())
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bits(reordered.state[p][key], opt.state[p][key])


def test_every_mismatch_named_in_one_error_and_nothing_changes():
    model = mlp()
    opt = OffloadAdamW(named_groups(model, ["0.weight", "0.bias", "2.weight", "2.bias"]), lr=1e-2)
    train(model, opt, 2)
    sd = opt.state_dict()
    # Saved: rename one, mis-shape one, move one bias into the weight group.
    bad = copy.deepcopy(sd)
    g0, g1 = bad["param_groups"]
    g0["param_names"][0] = "encoder.weight"  # unexpected; '0.weight' missing
    wrong_shape_id = g0["params"][1]
    bad["state"][wrong_shape_id]["exp_avg"] = torch.zeros(99)
    moved = g1["param_names"].pop(0)
    g0["param_names"].append(moved)
    g0["params"].append(g1["params"].pop(0))

    target_model = mlp(seed=5)
    target = OffloadAdamW(named_groups(target_model, ["0.weight", "0.bias", "2.weight", "2.bias"]), lr=1e-2)
    train(target_model, target, 1)
    before = snapshot(target)
    params_before = [p.detach().clone() for p in target_model.parameters()]
    with pytest.raises(StateDictMismatch) as err:
        target.load_state_dict(bad)
    text = str(err.value)
    for culprit in ("'0.weight' (group 0) is missing", "unexpected parameter 'encoder.weight'",
                    "'2.weight'", "exp_avg has shape (99,)", "'0.bias' is in group 0 of the state_dict but in group 1 here"):
        assert culprit in text, (culprit, text)
    assert len(err.value.problems) == 4
    assert_unchanged(target, before)
    assert all(torch.equal(p, q) for p, q in zip(target_model.parameters(), params_before))


def test_positional_load_without_names_checks_sizes_like_torch():
    model = mlp()
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    other = OffloadAdamW(list(model.parameters())[:3], lr=1e-2)
    before = snapshot(other)
    with pytest.raises(StateDictMismatch, match="group 0: the state_dict has 4 parameter\\(s\\), the optimizer has 3"):
        other.load_state_dict(opt.state_dict())
    assert_unchanged(other, before)


def test_hyperparameters_come_from_the_state_dict():
    model = mlp()
    opt = OffloadAdamW(model.parameters(), lr=0.5, weight_decay=0.3)
    sd = opt.state_dict()
    fresh = OffloadAdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == 0.5 and fresh.param_groups[0]["weight_decay"] == 0.3


def test_saved_names_are_kept_by_an_optimizer_built_without_names_as_torch_keeps_them():
    # issue 37: torch's Optimizer.load_state_dict carries the saved param_names into the groups, so the next
    # checkpoint still has them; an optimizer that dropped them would lose the names at the next save.
    model = mlp()
    named = OffloadAdamW(model.named_parameters(), lr=1e-2)
    train(model, named, 2)
    saved = named.state_dict()
    for make in (lambda ps: OffloadAdamW(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)):
        fresh_model = mlp()
        opt = make(fresh_model.parameters())
        opt.load_state_dict(copy.deepcopy(saved))
        again = opt.state_dict()
        assert [g["param_names"] for g in again["param_groups"]] == [["0.weight", "0.bias", "2.weight", "2.bias"]]
        assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("fused", [None, False])
def test_leaving_for_torch_continues_exactly_whatever_torch_was_built_with(fused):
    # issue 37: OffloadAdamW(fused=None) runs torch's fused kernel; its state_dict said fused=None, which torch adopts
    # on load as "its default" (the for-loop on the CPU), so torch.optim.AdamW(fused=True) continued 1.5e-8 away.
    # The saved group names the kernel the run used: torch continues with it, bit for bit.
    model = mlp()
    ours = OffloadAdamW(model.parameters(), lr=1e-2, fused=fused)
    train(model, ours, 5)
    saved = ours.state_dict()
    assert saved["param_groups"][0]["fused"] is (fused is None)
    assert fused is None or saved["param_groups"][0]["foreach"] is False  # torch's single-tensor loop, on any device
    for torch_kwargs in ({"fused": True}, {}, {"foreach": False, "fused": False}):
        leaving = mlp()
        leaving.load_state_dict(model.state_dict())
        theirs = torch.optim.AdamW(leaving.parameters(), lr=1e-2, **torch_kwargs)
        theirs.load_state_dict(copy.deepcopy(saved))
        staying = copy.deepcopy(model)
        again = OffloadAdamW(staying.parameters(), lr=1e-2)
        again.load_state_dict(copy.deepcopy(saved))
        train(staying, again, 4, seed=3)
        train(leaving, theirs, 4, seed=3)
        for p, q in zip(staying.parameters(), leaving.parameters()):
            assert same_bits(p, q), torch_kwargs
