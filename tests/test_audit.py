"""audit / audit_state_dict / `offload-adamw audit`: every fault found, each exactly once, nothing on a clean set-up.

The set-ups are real transformers models (tiny Llama with tied embeddings, GPT-2) with hand-made faults.
Each case states the exact set of finding kinds and the exact culprits; the shrink factor is checked against
the weights of a real OffloadAdamW run with explicit zero gradients (docs/contract.md#decay-over-a-run), against a
scheduler stepped for real, and the user's scheduler and optimizer are checked untouched.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch

from offload_adamw import OffloadAdamW, audit, audit_state_dict, param_groups
from offload_adamw.auditing.audit import KINDS, shrink_factor
from offload_adamw.cli.main import main as cli_main

transformers = pytest.importorskip("transformers")

from _models import tiny_gpt2, tiny_llama  # noqa: E402

# Two set-ups list a tensor twice on purpose; torch warns about it, the audit is what is tested.
pytestmark = pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")


LLAMA_RULES = [("*norm*", {"weight_decay": 0.0})]
GPT2_RULES = [("*.bias", {"weight_decay": 0.0}), ("*.ln_*", {"weight_decay": 0.0})]
LLAMA_NORMS = tuple(
    [f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    + ["model.norm.weight"]
)


def backward(model: torch.nn.Module) -> None:
    model(torch.arange(8).reshape(1, 8)).logits.float().sum().backward()


# Each set-up returns (model, optimizer, {kind: expected culprit names, in order}); group-level kinds map to groups.
def clean_llama_offload():
    model = tiny_llama()
    return model, OffloadAdamW(param_groups(model, LLAMA_RULES, {"weight_decay": 0.1})), {}


def clean_gpt2_torch():
    model = tiny_gpt2()
    return model, torch.optim.AdamW(param_groups(model, GPT2_RULES, {"weight_decay": 0.1})), {}


def clean_bf16_llama_offload_after_step():
    model = tiny_llama(dtype=torch.bfloat16)
    optimizer = OffloadAdamW(param_groups(model, LLAMA_RULES, {"weight_decay": 0.1}))
    backward(model)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer, {}


def decay_everything_llama():
    model = tiny_llama()
    return model, torch.optim.AdamW(model.parameters(), weight_decay=0.1), {"decay_on_1d": LLAMA_NORMS}


def tied_listed_twice_gpt2():
    model = tiny_gpt2()  # named_parameters(remove_duplicate=False) lists wte and lm_head: one tensor, twice
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    optimizer = torch.optim.AdamW([{"params": params, "weight_decay": 0.0}])
    return model, optimizer, {"duplicate_in_optimizer": ("transformer.wte.weight",)}


def missing_lm_head_untied_llama():
    model = tiny_llama(tied=False)
    groups = param_groups(model, LLAMA_RULES + [("lm_head.*", {})], {"weight_decay": 0.1})
    optimizer = OffloadAdamW([g for g in groups if g["rule"] != "lm_head.*"])
    return model, optimizer, {"missing_from_optimizer": ("lm_head.weight",)}


def frozen_layer_with_old_grad():
    model = tiny_llama()
    optimizer = OffloadAdamW(param_groups(model, LLAMA_RULES, {"weight_decay": 0.1}))
    backward(model)
    frozen = []
    for name, p in model.named_parameters():
        if name.startswith("model.layers.0."):
            p.requires_grad_(False)  # frozen after backward: .grad stays
            frozen.append(name)
    return model, optimizer, {"frozen_with_grad": tuple(frozen)}


def empty_group_and_swapped_names():
    model = tiny_gpt2()
    groups = param_groups(model, GPT2_RULES, {"weight_decay": 0.1})
    names = groups[2]["param_names"]
    names[0], names[1] = names[1], names[0]
    optimizer = torch.optim.AdamW(groups + [{"params": [], "param_names": []}])
    return model, optimizer, {
        "empty_group": (3,),
        "name_mismatch": ("param_groups[2][0]", "param_groups[2][1]"),
    }


def bf16_torch_adamw_before_step():
    model = tiny_llama(dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(param_groups(model, LLAMA_RULES, {"weight_decay": 0.1}))
    return model, optimizer, {"low_precision_state": tuple(n for n, _ in model.named_parameters())}


def bf16_torch_adamw_after_step():
    model, optimizer, expected = bf16_torch_adamw_before_step()
    backward(model)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer, expected


def optimizer_of_another_model():
    model = tiny_gpt2()
    stale = tiny_gpt2()  # e.g. the model was re-created after the optimizer
    optimizer = torch.optim.AdamW(param_groups(stale, GPT2_RULES, {"weight_decay": 0.1}))
    names = tuple(n for n, _ in model.named_parameters())
    return model, optimizer, {"missing_from_optimizer": names, "not_in_model": names}


def everything_at_once():
    """Several faults together: each still reported once, with exactly its culprits."""
    model = tiny_llama()
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]  # the tied embedding twice
    optimizer = torch.optim.AdamW([{"params": params[:-3] + params[-1:], "weight_decay": 0.1}, {"params": []}])
    backward(model)
    model.model.layers[1].mlp.down_proj.weight.requires_grad_(False)
    return model, optimizer, {
        "duplicate_in_optimizer": ("model.embed_tokens.weight",),
        "missing_from_optimizer": ("model.layers.1.post_attention_layernorm.weight", "model.norm.weight"),
        "frozen_with_grad": ("model.layers.1.mlp.down_proj.weight",),
        "decay_on_1d": LLAMA_NORMS[:3],
        "empty_group": (1,),
    }


SETUPS = [
    clean_llama_offload,
    clean_gpt2_torch,
    clean_bf16_llama_offload_after_step,
    decay_everything_llama,
    tied_listed_twice_gpt2,
    missing_lm_head_untied_llama,
    frozen_layer_with_old_grad,
    empty_group_and_swapped_names,
    bf16_torch_adamw_before_step,
    bf16_torch_adamw_after_step,
    optimizer_of_another_model,
    everything_at_once,
]


@pytest.mark.parametrize("setup", SETUPS, ids=[s.__name__ for s in SETUPS])
def test_each_fault_reported_exactly_once(setup):
    model, optimizer, expected = setup()
    report = audit(model, optimizer)
    kinds = Counter(f.kind for f in report.findings)
    group_kinds = {"empty_group", "weight_decay_shrink"}
    assert set(kinds) == set(expected), report.to_table()
    for kind, culprits in expected.items():
        found = report.of_kind(kind)
        if kind in group_kinds:
            assert tuple(f.group for f in found) == culprits
        else:
            assert len(found) == 1, f"{kind} reported {len(found)} times"
            assert set(found[0].params) == set(culprits)
            assert len(found[0].params) == len(culprits)  # each culprit once
        assert all(f.severity == KINDS[kind] for f in found)
    assert bool(report.faults) == bool(expected)
    # The table and the JSON carry every finding.
    table = report.to_table()
    for f in report.findings:
        assert f.kind in table
    decoded = json.loads(report.to_json())
    assert [f["kind"] for f in decoded["findings"]] == [f.kind for f in report.findings]
    assert decoded["faults"] == len(report.faults)


def test_a_frozen_parameter_with_a_grad_really_moves_and_zero_grad_clears_the_finding():
    model, optimizer, expected = frozen_layer_with_old_grad()
    frozen = dict(model.named_parameters())[expected["frozen_with_grad"][0]]
    before = frozen.detach().clone()
    optimizer.step()
    assert not torch.equal(frozen, before)  # what the finding warns about (docs/contract.md#frozen-parameters)
    optimizer.zero_grad(set_to_none=True)
    assert not audit(model, optimizer).faults


def test_audit_changes_nothing():
    model, optimizer, _ = everything_at_once()
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=50)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    lrs = [g["lr"] for g in optimizer.param_groups]
    scheduler_state = scheduler.state_dict()
    audit(model, optimizer, scheduler, steps=50, grad_accumulation=2)
    assert scheduler.state_dict() == scheduler_state
    assert [g["lr"] for g in optimizer.param_groups] == lrs
    assert not optimizer.state
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])
        assert (p.grad is None) == (grads[n] is None) and (p.grad is None or torch.equal(p.grad, grads[n]))


# ------------------------------------------------------------------------- decay shrink

SCHEDULES = {
    "constant": lambda opt, steps: None,
    "cosine": lambda opt, steps: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=1e-3),
    "warmup_cosine_hf": lambda opt, steps: transformers.get_cosine_schedule_with_warmup(opt, steps // 5, steps),
    "sequential": lambda opt, steps: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=5), torch.optim.lr_scheduler.StepLR(opt, 7, 0.5)],
        milestones=[5],
    ),
}


def float64_setup(schedule: str, steps: int):
    """Two groups with different decay; float64 so the product is compared tightly."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double()
    groups = param_groups(model, [("0.weight", {"weight_decay": 0.2}), ("*.bias", {"weight_decay": 0.0})], {"weight_decay": 0.05})
    optimizer = OffloadAdamW(groups, lr=0.05)
    return model, optimizer, SCHEDULES[schedule](optimizer, steps)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_shrink_equals_the_weights_of_a_real_run_with_zero_gradients(schedule):
    steps = 30
    model, optimizer, scheduler = float64_setup(schedule, steps)
    report = audit(model, optimizer, scheduler, steps=steps)
    shrinks = {f.group: f.details["shrink"] for f in report.of_kind("weight_decay_shrink")}
    assert set(shrinks) == {0, 2}  # the group without decay has no shrink
    assert len(report.of_kind("weight_decay_shrink")) == 2
    assert not report.faults

    # The real run: explicit zero gradients, zero moments => theta_T = theta_0 * prod(1 - lr_t * wd).
    start = {p: p.detach().clone() for g in optimizer.param_groups for p in g["params"]}
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    for gi, shrink in shrinks.items():
        for p in optimizer.param_groups[gi]["params"]:
            torch.testing.assert_close(p.detach(), start[p] * shrink, rtol=1e-12, atol=0)


def test_shrink_replays_from_the_schedulers_current_position():
    model, optimizer, scheduler = float64_setup("cosine", 40)
    for _ in range(10):  # the run is a quarter done
        optimizer.step()
        scheduler.step()
    report = audit(model, optimizer, scheduler, steps=30)
    lrs = []
    for _ in range(30):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert report.of_kind("weight_decay_shrink")[0].details["shrink"] == pytest.approx(
        math.prod(1 - lr * 0.2 for lr in lrs), rel=1e-12
    )


@pytest.mark.parametrize("current, new", [(1, 4), (4, 1), (2, 3)])
def test_grad_accumulation_changes_updates_and_shrink(current, new):
    steps, lr, wd = 120, 0.05, 0.05
    model, optimizer, _ = float64_setup("constant", steps)
    report = audit(model, optimizer, steps=steps, grad_accumulation=(current, new))
    finding = report.of_kind("weight_decay_shrink")[1]
    assert finding.group == 2
    acc = finding.details["accumulation"]
    updates = round(steps * current / new)
    assert acc["updates"] == updates
    assert finding.details["shrink"] == pytest.approx((1 - lr * wd) ** steps, rel=1e-12)
    assert acc["shrink"] == pytest.approx((1 - lr * wd) ** updates, rel=1e-12)
    # The weight decay that keeps the total decay: (1 - lr*wd')**updates == (1 - lr*wd)**steps.
    assert (1 - lr * acc["weight_decay_for_same_shrink"]) ** updates == pytest.approx((1 - lr * wd) ** steps, rel=1e-9)
    assert audit(model, optimizer, steps=steps, grad_accumulation=new).to_dict() == audit(
        model, optimizer, steps=steps, grad_accumulation=(1, new)
    ).to_dict()


def test_weight_decay_for_same_shrink_under_a_schedule():
    model, optimizer, scheduler = float64_setup("warmup_cosine_hf", 200)
    finding = audit(model, optimizer, scheduler, steps=200, grad_accumulation=4).of_kind("weight_decay_shrink")[0]
    acc = finding.details["accumulation"]
    assert acc["updates"] == 50
    assert acc["shrink"] > finding.details["shrink"]  # fewer updates, less total decay
    # The proposed weight decay under the schedule rebuilt for 50 updates gives the old shrink again.
    short = transformers.get_cosine_schedule_with_warmup(
        OffloadAdamW(param_groups(model, [("0.weight", {})]), lr=0.05), 10, 50
    )
    lrs = []
    for _ in range(50):
        lrs.append(short.get_last_lr()[0])
        short.optimizer.step()
        short.step()
    assert shrink_factor(lrs, acc["weight_decay_for_same_shrink"]) == pytest.approx(finding.details["shrink"], rel=1e-9)


def test_plateau_scheduler_falls_back_to_the_current_lr_and_bad_arguments_raise():
    model, optimizer, _ = float64_setup("constant", 10)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    finding = audit(model, optimizer, plateau, steps=10).of_kind("weight_decay_shrink")[0]
    assert "ReduceLROnPlateau" in finding.details["lr_source"]
    assert finding.details["shrink"] == pytest.approx((1 - 0.05 * 0.2) ** 10, rel=1e-12)
    with pytest.raises(ValueError, match="steps="):
        audit(model, optimizer, plateau)
    with pytest.raises(ValueError, match="grad_accumulation"):
        audit(model, optimizer, steps=10, grad_accumulation=(0, 2))


# ------------------------------------------------------------------- state_dict and CLI


def test_state_dict_audit_of_a_bf16_torch_adamw_checkpoint(tmp_path, capsys):
    model = tiny_llama(dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)  # no names, decay everywhere
    backward(model)
    optimizer.step()
    path = tmp_path / "optimizer.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    assert cli_main(["audit", str(path), "--json", "--steps", "100"]) == 1
    out = json.loads(capsys.readouterr().out)
    kinds = Counter(f["kind"] for f in out["findings"])
    assert kinds == Counter({"decay_on_1d": 1, "low_precision_state": 1, "weight_decay_shrink": 1})
    by_kind = {f["kind"]: f for f in out["findings"]}
    ids = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    assert by_kind["decay_on_1d"]["params"] == [f"id {ids[n]}" for n in LLAMA_NORMS]
    assert len(by_kind["low_precision_state"]["params"]) == len(ids)
    assert by_kind["weight_decay_shrink"]["details"]["shrink"] == pytest.approx((1 - 1e-3 * 0.1) ** 100, rel=1e-12)
    assert out["source"].endswith("['optimizer']")
    assert out["notes"]


def test_state_dict_audit_of_a_clean_named_checkpoint_and_of_broken_ones(tmp_path, capsys):
    model = tiny_gpt2()
    optimizer = OffloadAdamW(param_groups(model, GPT2_RULES, {"weight_decay": 0.1}))
    backward(model)
    optimizer.step()
    saved = optimizer.state_dict()
    path = tmp_path / "clean.pt"
    torch.save(saved, path)
    assert cli_main(["audit", str(path)]) == 0
    table = capsys.readouterr().out
    assert "no findings" in table and "<default>" in table and "*.ln_*" in table

    report = audit_state_dict(saved)
    assert not report.findings
    assert [g.tensors for g in report.groups] == [len(g["params"]) for g in optimizer.param_groups]
    assert [g.elements for g in report.groups] == [sum(p.numel() for p in g["params"]) for g in optimizer.param_groups]

    # Broken: a name listed in two groups, a state entry of no group, an empty group.
    broken = {"state": dict(saved["state"]), "param_groups": [dict(g) for g in saved["param_groups"]]}
    first = broken["param_groups"][0]
    broken["param_groups"][1] = dict(broken["param_groups"][1], params=broken["param_groups"][1]["params"] + [first["params"][0]],
                                     param_names=broken["param_groups"][1]["param_names"] + [first["param_names"][0]])
    broken["state"][999] = saved["state"][0]
    broken["param_groups"].append(dict(first, params=[], param_names=[]))
    report = audit_state_dict(broken)
    assert Counter(f.kind for f in report.findings) == Counter(
        {"duplicate_in_optimizer": 1, "state_without_group": 1, "empty_group": 1}
    )
    assert report.of_kind("duplicate_in_optimizer")[0].params == (first["param_names"][0],)
    assert report.of_kind("state_without_group")[0].params == ("id 999",)
    assert report.of_kind("empty_group")[0].group == 3


def test_cli_refuses_what_it_cannot_load_naming_the_file(tmp_path, capsys):
    not_optimizer = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, not_optimizer)
    assert cli_main(["audit", str(not_optimizer)]) == 2
    assert f"{not_optimizer}: holds no optimizer state_dict" in capsys.readouterr().err
    pickled = tmp_path / "pickled.pt"
    torch.save({"state": {}, "param_groups": [], "module": torch.nn.Identity()}, pickled)
    assert cli_main(["audit", str(pickled)]) == 2
    assert "weights_only=True" in capsys.readouterr().err
    script = tmp_path / "no_setup.py"
    script.write_text("x = 1\n")
    assert cli_main(["audit", str(script)]) == 2
    assert f"{script}: defines no function audit_setup()" in capsys.readouterr().err
    assert cli_main(["audit", str(tmp_path / "absent.pt")]) == 2


SCRIPT = textwrap.dedent(
    """
    import torch
    from offload_adamw import OffloadAdamW, param_groups

    def audit_setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
        model[2].weight.requires_grad_(False)
        model[2].weight.grad = torch.ones_like(model[2].weight)
        optimizer = OffloadAdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=100)
        return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "steps": 100, "grad_accumulation": (1, 2)}

    if __name__ == "__main__":
        raise SystemExit("the training loop must not run under the audit")
    """
)


def test_cli_on_a_script_in_a_real_subprocess(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "offload_adamw", "audit", str(script), "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    out = json.loads(done.stdout)
    kinds = Counter(f["kind"] for f in out["findings"])
    assert kinds == Counter({"frozen_with_grad": 1, "decay_on_1d": 1, "weight_decay_shrink": 1})
    by_kind = {f["kind"]: f for f in out["findings"]}
    assert by_kind["frozen_with_grad"]["params"] == ["2.weight"]
    assert by_kind["decay_on_1d"]["params"] == ["0.bias", "1.weight", "1.bias", "2.bias"]
    lrs = [0.01 * (1 - t / 100) for t in range(100)]  # LinearLR from 1.0 to 0.0 over 100 updates
    shrink = by_kind["weight_decay_shrink"]["details"]
    assert shrink["shrink"] == pytest.approx(math.prod(1 - lr * 0.1 for lr in lrs), rel=1e-9)
    assert shrink["accumulation"]["updates"] == 50


def test_cli_steps_override_the_script_and_the_table_is_the_default(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert cli_main(["audit", str(script), "--steps", "10", "--grad-accumulation", "2:1"]) == 1
    table = capsys.readouterr().out
    assert "over 10 updates" in table and "20 updates" in table and "frozen_with_grad" in table
    assert "1 error(s), 1 warning(s)" in table


def test_the_command_names_the_set_up_function_the_room_calls():
    from offload_adamw.auditing import inputs
    from offload_adamw.cli import audit as audit_command

    assert audit_command.DEFAULT_FUNCTION == inputs.DEFAULT_FUNCTION


def test_the_registry_names_every_kind_once_and_a_state_dict_shows_only_what_it_can():
    from offload_adamw.auditing.findings import CHECKS

    kinds = [check.kind for check in CHECKS]
    assert len(kinds) == len(set(kinds)) and set(kinds) == set(KINDS)
    assert all(check.of_setup or check.of_state_dict for check in CHECKS)
    saved_kinds = {check.kind for check in CHECKS if check.of_state_dict is not None}
    assert {"missing_from_optimizer", "frozen_with_grad", "not_in_model"}.isdisjoint(saved_kinds)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.1)
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    saved["state"][7] = saved["state"][0]
    report = audit_state_dict(saved, steps=10)
    assert {f.kind for f in report.findings} == {"decay_on_1d", "state_without_group", "weight_decay_shrink"}
    assert {f.kind for f in report.findings} <= saved_kinds
