"""`audit` of bad input: a malformed state_dict is a clean error (CLI exit 2, no traceback); impossible
hyperparameters are a finding, never "no findings"."""

from __future__ import annotations

import math

import pytest
import torch

from offload_adamw import OffloadAdamW, audit, audit_state_dict
from offload_adamw.cli.main import main as cli_main


def _state_dict():
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.named_parameters(), lr=0.1, weight_decay=0.0)
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()


def _with(**changes):
    def edit(sd):
        for key, value in changes.items():
            sd["param_groups"][0][key] = value
        return sd

    return edit


MALFORMED = {
    "groups_a_dict": lambda sd: {**sd, "param_groups": {"a": 1}},
    "group_a_number": lambda sd: {**sd, "param_groups": [3]},
    "params_a_number": _with(params=5),
    "param_names_a_string": _with(param_names="weight"),
    "state_a_list": lambda sd: {**sd, "state": [1]},
    "state_entry_a_string": lambda sd: {**sd, "state": {0: "exp_avg"}},
    "lr_a_string": _with(lr="fast"),
    "weight_decay_a_list": _with(weight_decay=[0.1]),
    "unhashable_id": _with(params=[[0], 1]),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_state_dict_is_a_clean_error(case):
    with pytest.raises(ValueError, match="sd.pt"):
        audit_state_dict(MALFORMED[case](_state_dict()), source="sd.pt")


@pytest.mark.parametrize("case", MALFORMED)
def test_cli_exits_2_without_a_traceback(tmp_path, capsys, case):
    path = tmp_path / "sd.pt"
    torch.save(MALFORMED[case](_state_dict()), path)
    assert cli_main(["audit", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(path) in err, err


def test_impossible_hyperparameters_in_a_state_dict_are_a_finding():
    report = audit_state_dict(_with(lr=math.nan, weight_decay=-5.0)(_state_dict()))
    found = report.of_kind("invalid_hyperparameter")
    assert len(found) == 1 and found[0].severity == "error" and found[0].group == 0
    assert "lr nan" in found[0].message and "weight_decay -5.0" in found[0].message
    assert report.faults


def test_impossible_hyperparameters_of_a_live_optimizer_are_a_finding():
    layer = torch.nn.Linear(3, 2)
    optimizer = OffloadAdamW(layer.named_parameters(), lr=0.1)
    optimizer.param_groups[0]["lr"] = math.nan  # e.g. a scheduler that produced NaN
    optimizer.param_groups[0]["betas"] = (0.9, 1.0)
    found = audit(layer, optimizer).of_kind("invalid_hyperparameter")
    assert len(found) == 1 and "lr nan" in found[0].message and "betas (0.9, 1.0)" in found[0].message
