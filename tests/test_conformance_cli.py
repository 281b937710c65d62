"""`offload-adamw check` through offload_adamw.cli.main and once as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload_adamw.cli.main import main

BROKEN_FILE = Path(__file__).parent / "broken_optimizers.py"
SPLIT = f"{BROKEN_FILE}:SplitBetaAdamW"
SPLIT_MAP = json.dumps({"betas": ["beta1", "beta2"], "eps": "epsilon", "weight_decay": "wd", "amsgrad": None, "maximize": None})
JUDGED = ",".join(str(n) for n in range(1, 15))


def test_other_signature_through_map_and_kwargs(tmp_path, capsys):
    out = tmp_path / "split.json"
    status = main(["check", SPLIT, "--map", SPLIT_MAP, "--kwargs", '{"correct_bias": true}', "--clauses", JUDGED,
                   "--json", str(out), "--no-progress"])
    table = capsys.readouterr().out
    assert status == 0, table
    data = json.loads(out.read_text())
    assert data["failed"] == []
    assert [r["number"] for r in data["results"]] == list(range(1, 15))
    assert "amsgrad: not asked" in data["results"][0]["detail"]  # mapped to null: the variant is skipped, not failed
    assert "SplitBetaAdamW" in table and "update rule" in table


def test_other_signature_without_its_kwargs_fails_the_update_rule(tmp_path, capsys):
    # correct_bias defaults to False in this signature: no bias correction, clause 1 only.
    out = tmp_path / "split.json"
    status = main(["check", SPLIT, "--map", SPLIT_MAP, "--clauses", "1,2,4,11", "--json", str(out), "--no-progress"])
    capsys.readouterr()
    assert status == 1
    assert json.loads(out.read_text())["failed"] == [1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "no_such_module_xyz:Opt"], "cannot load the candidate"),
        (["check", f"{BROKEN_FILE}:NoSuchClass"], "no attribute"),
        (["check", "torch.optim:AdamW", "--map", "{not json"], "--map: not valid JSON"),
        (["check", "torch.optim:AdamW", "--kwargs", "[1, 2]"], "--kwargs: expected a JSON object"),
        (["check", "torch.optim:AdamW", "--map", '{"momentum": "m"}'], "unknown hyperparameter 'momentum'"),
        (["check", "torch.optim:AdamW", "--dtype", "int8"], "unknown dtype"),
        (["check", "torch.optim:AdamW", "--clauses", "1,99"], "unknown clause"),
    ],
)
def test_exit_2_when_the_candidate_or_the_arguments_are_unusable(argv, message, capsys):
    assert main(argv + ["--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_kwargs_from_a_file(tmp_path, capsys):
    kwargs = tmp_path / "kwargs.json"
    kwargs.write_text('{"nonfinite": "skip"}')
    assert main(["check", "offload_adamw:OffloadAdamW", "--kwargs", f"@{kwargs}", "--clauses", "13", "--no-progress"]) == 0
    assert "behaviour: skip;" in capsys.readouterr().out


def test_real_subprocess_exit_status_table_and_json(tmp_path):
    out = tmp_path / "torch.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "offload_adamw", "check", "torch.optim:AdamW", "--clauses", "1,11,12", "--json", str(out)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 1, proc.stderr
    assert "FAIL" in proc.stdout and "resume matches state by name" in proc.stdout
    data = json.loads(out.read_text())
    assert data["candidate"] == "torch.optim:AdamW" and data["failed"] == [11]
    assert {r["number"]: r["verdict"] for r in data["results"]} == {1: "pass", 11: "fail", 12: "pass"}
