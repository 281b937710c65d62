"""Optimizer states saved with parameter names move between a model and the same model wrapped.

Wrappers put prefixes into ``named_parameters()``: torch.compile ``_orig_mod.``, activation checkpointing
``_checkpoint_wrapped_module.``, DDP a leading ``module.`` (here a real DDP on a one-process gloo group, in
a subprocess so that this process keeps no process group). Loading matches canonical names, as
torch.distributed.checkpoint does, in every direction; a name that is really missing is still named.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from offload_adamw import OffloadAdamW, StateDictMismatch


def _bare() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


def _compiled() -> nn.Module:
    return torch.compile(_bare())


def _checkpointed() -> nn.Module:
    model = _bare()
    model[0] = checkpoint_wrapper(model[0])
    return model


def _compiled_checkpointed() -> nn.Module:
    return torch.compile(_checkpointed())


WRAPPERS = {"bare": _bare, "compiled": _compiled, "checkpointed": _checkpointed, "compiled_checkpointed": _compiled_checkpointed}


def _trained_state(make) -> dict:
    model = make()
    opt = OffloadAdamW(model.named_parameters(), lr=1e-2)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("saved", sorted(WRAPPERS))
@pytest.mark.parametrize("loaded", sorted(WRAPPERS))
def test_state_moves_between_wrapped_and_bare(saved, loaded):
    sd = _trained_state(WRAPPERS[saved])
    assert any("_orig_mod" in n or "_checkpoint" in n for n in sd["param_groups"][0]["param_names"]) == (saved != "bare")
    model = WRAPPERS[loaded]()
    opt = OffloadAdamW(model.named_parameters(), lr=1e-2)
    opt.load_state_dict(sd)
    assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == [1.0] * 4
    ref = _trained_state(_bare)
    for a, b in zip(opt.state_dict()["state"].values(), ref["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_a_missing_parameter_is_still_named_with_its_own_name():
    sd = _trained_state(_compiled)
    sd["param_groups"][0]["param_names"][0] = "_orig_mod.9.weight"
    model = _bare()
    opt = OffloadAdamW(model.named_parameters(), lr=1e-2)
    with pytest.raises(StateDictMismatch) as err:
        opt.load_state_dict(sd)
    assert "'0.weight'" in str(err.value) and "'_orig_mod.9.weight'" in str(err.value)


@pytest.mark.parametrize(
    "name, canonical",
    [
        ("module.0.weight", "0.weight"),
        ("_orig_mod.module.0.weight", "0.weight"),
        ("module._orig_mod.layers.1._checkpoint_wrapped_module.attn.weight", "layers.1.attn.weight"),
        ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.weight", "layers.0.weight"),
        ("encoder.module.weight", "encoder.module.weight"),  # a submodule called "module" keeps its name
        ("module", "module"),
    ],
)
def test_canonical_name(name, canonical):
    from offload_adamw.optim.loading import canonical_name

    assert canonical_name(name) == canonical


def test_ddp_names_load_into_the_bare_model(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, torch, torch.distributed as dist
        from torch import nn
        from offload_adamw import OffloadAdamW
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://{tmp_path}/pg")
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)))
        opt = OffloadAdamW(ddp.named_parameters(), lr=1e-2)
        ddp(torch.ones(3, 4)).sum().backward()
        opt.step()
        sd = opt.state_dict()
        assert sd["param_groups"][0]["param_names"][0] == "module.0.weight"
        torch.save(sd, "{tmp_path}/sd.pt")
        dist.destroy_process_group()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    model = _bare()
    opt = OffloadAdamW(model.named_parameters(), lr=1e-2)
    opt.load_state_dict(sd)
    ref = _trained_state(_bare)
    for a, b in zip(opt.state_dict()["state"].values(), ref["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])
