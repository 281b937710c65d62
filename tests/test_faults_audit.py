"""`audit` of bad input: a malformed state_dict, a script that ends the process (``sys.exit``, ``os._exit``)
and a set-up function that returns the wrong things are each a clean error of the command (exit 2, one line
naming the script, no traceback); impossible hyperparameters are a finding, never "no findings"."""

from __future__ import annotations

import math
import subprocess
import sys

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


# --------------------------------------------------------------------- scripts that end the process or return nonsense

_SETUP = (
    "import torch\n"
    "def audit_setup():\n"
    "    model = torch.nn.Linear(2, 2)\n"
    "    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)\n"
)

#: (a script, what the error must say): each ends the process at import or inside audit_setup().
ENDINGS = {
    "sys_exit_0_on_import": ("import sys\nsys.exit(0)\n" + _SETUP + "    return model, optimizer\n", "sys.exit(0)"),
    "sys_exit_0_in_setup": (_SETUP + "    raise SystemExit(0)\n", "sys.exit(0)"),
    "os_exit_0_on_import": ("import os\nos._exit(0)\n" + _SETUP + "    return model, optimizer\n", "exit status 0"),
    "os_exit_3_in_setup": (_SETUP + "    import os\n    os._exit(3)\n", "exit status 3"),
}


@pytest.mark.parametrize("case", [c if c in ("sys_exit_0_in_setup", "os_exit_0_on_import") else
                                  pytest.param(c, marks=pytest.mark.slow) for c in ENDINGS])  # CI: one of each ending
def test_a_script_that_ends_the_process_is_the_commands_own_error(tmp_path, case):
    """Run as a real command: a script that ends the process must not end it with its own status, unaudited."""
    text, said = ENDINGS[case]
    script = tmp_path / "train.py"
    script.write_text(text)
    done = subprocess.run([sys.executable, "-m", "offload_adamw", "audit", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    assert f"offload-adamw audit: {script}" in done.stderr and said in done.stderr, done.stderr
    assert "not audited" in done.stderr and "Traceback" not in done.stderr, done.stderr


#: what audit_setup() returns -> what the error must name besides the script.
WRONG_RETURNS = {
    "optimizer_first": ("optimizer, model", ["(AdamW, Linear)", "model", "torch.nn.Module"]),
    "model_twice": ("model, model", ["(Linear, Linear)", "optimizer"]),
    "scheduler_a_number": ("model, optimizer, 3", ["(Linear, AdamW, int)", "scheduler"]),
    "steps_a_string": ("model, optimizer, None, 'many'", ["(Linear, AdamW, NoneType, str)", "steps"]),
    "steps_negative": ("{'model': model, 'optimizer': optimizer, 'steps': -1}", ["steps", "-1"]),
    "accumulation_a_string": ("{'model': model, 'optimizer': optimizer, 'grad_accumulation': '2'}", ["grad_accumulation"]),
    "five_items": ("model, optimizer, None, 10, 1", ["a tuple of 5"]),
    "nothing": ("None", ["NoneType"]),
}


@pytest.mark.parametrize("case", WRONG_RETURNS)
def test_a_wrong_setup_is_a_usage_error_naming_the_script_and_what_it_returned(tmp_path, capsys, case):
    returned, named = WRONG_RETURNS[case]
    script = tmp_path / "train.py"
    script.write_text(_SETUP + f"    return {returned}\n")
    assert cli_main(["audit", str(script)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err, captured.err
    line = captured.err.strip()
    assert "\n" not in line and line.startswith(f"offload-adamw audit: {script}: audit_setup() returned"), line
    assert all(word in line for word in named), (named, line)
