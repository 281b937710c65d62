"""`offload-adamw check` through offload_adamw.cli.main and once as a real subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
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
    assert data["candidate"] == "torch.optim:AdamW" and data["failed"] == [11] and data["schema_version"] == 1
    assert {r["number"]: r["verdict"] for r in data["results"]} == {1: "pass", 11: "fail", 12: "pass"}


CANDIDATES = '''
import os, sys, time, torch

class Hangs(torch.optim.AdamW):
    def step(self, closure=None):
        while True:
            time.sleep(0.01)

class Exits(torch.optim.AdamW):
    def step(self, closure=None):
        sys.exit(0)

class Renamed(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0):
        super().__init__(params, lr=lr, betas=(beta1, beta2), eps=epsilon, weight_decay=wd)
'''


@pytest.fixture()
def candidates(tmp_path):
    path = tmp_path / "candidates.py"
    path.write_text(CANDIDATES)
    return path


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_usage_errors_exit_2_before_any_clause_with_one_line(tmp_path, candidates, capsys):
    cases = [
        (["torch.optim:AdamW", "--device", "cuda"], "device 'cuda' is not usable here"),
        (["torch.optim:AdamW", "--device", "tpu9"], "device 'tpu9'"),
        (["torch.optim:AdamW", "--json", str(tmp_path / "no_such_dir" / "r.json")], "no_such_dir' does not exist"),
        (["torch.optim:AdamW", "--json", str(tmp_path)], "is a directory"),
        (["torch.optim:AdamW", "--setup", "train"], "has no method 'train'"),
        (["torch.optim:AdamW", "--timeout", "0"], "--timeout"),
        (["torch.optim:AdamW", "--timeout", "nan"], "--timeout"),
        ([f"{candidates}:Renamed"], "does not take the canonical AdamW keywords"),
    ]
    for argv, message in cases:
        assert main(["check", *argv, "--no-progress"]) == 2, argv
        captured = capsys.readouterr()
        assert message in captured.err and "Traceback" not in captured.err, captured.err
        assert len(captured.err.strip().splitlines()) == 1 and captured.out == ""


def test_a_signature_mismatch_suggests_the_map_that_fits(candidates, capsys):
    assert main(["check", f"{candidates}:Renamed", "--no-progress"]) == 2
    err = capsys.readouterr().err
    suggested = err.split("--map '")[1].rsplit("'", 1)[0]
    assert json.loads(suggested) == {"betas": ["beta1", "beta2"], "eps": "epsilon", "weight_decay": "wd",
                                     "amsgrad": None, "maximize": None}
    assert main(["check", f"{candidates}:Renamed", "--map", suggested, "--clauses", "1,2", "--no-progress"]) == 0
    capsys.readouterr()



def test_with_several_candidates_each_usage_line_names_its_candidate(candidates, capsys):
    # The summary's row says only "not checked": the line on stderr must say which candidate it is about.
    renamed = f"{candidates}:Renamed"
    assert main(["check", "torch.optim:AdamW", renamed, "--clauses", "12", "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and repr(renamed) in lines[0] and "canonical AdamW keywords" in lines[0], lines
    assert main(["check", "torch.optim:AdamW", "torch.optim:Adam", "--setup", "train", "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [("'torch.optim:AdamW'" in line, "'torch.optim:Adam'" in line, "no method 'train'" in line)
            for line in lines] == [(True, False, True), (False, True, True)], lines

# waits out a time limit (10 s); in CI the API-level test_a_hang_an_exit_or_a_dead_process_is_that_clauses_error_never_a_pass
@pytest.mark.slow
def test_a_hang_or_an_exit_in_the_candidate_is_exit_1_with_the_clause_named(tmp_path, candidates):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "offload_adamw", "check", f"{candidates}:Hangs", "--clauses", "1,12",
                           "--timeout", "3", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1 and data["timeout"] == 3.0 and data["conforming"] is False
    assert {r["number"]: r["verdict"] for r in data["results"]} == {1: "error", 12: "pass"}
    assert "did not finish within 3 s" in data["results"][0]["detail"]
    proc = subprocess.run([sys.executable, "-m", "offload_adamw", "check", f"{candidates}:Exits", "--clauses", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "ERROR" in proc.stdout and "sys.exit(0)" in proc.stdout


def test_an_optimizer_without_eps_is_not_reported_conforming(capsys):
    # torch's AdamW driven as if it had no eps: the update rule cannot be compared, the other clauses run.
    status = main(["check", "torch.optim:AdamW", "--map", '{"eps": null}', "--clauses", "1,2,5", "--no-progress"])
    out = capsys.readouterr().out
    assert status == 1
    assert "not shown to be AdamW" in out and "2 pass" in out


ON_IMPORT = {
    "exits_on_import": ("import sys\nsys.exit(0)\n", "called sys.exit(0)"),
    "dies_on_import": ("import os\nos._exit(3)\n", "ended the process (exit status 3)"),
    "hangs_on_import": ("import time\nwhile True:\n    time.sleep(0.01)\n", "did not finish within 3 s"),
}


@pytest.mark.parametrize("module", [pytest.param(m, marks=pytest.mark.slow) if m == "hangs_on_import" else m
                                    for m in ON_IMPORT])  # a hang waits out its time limit: -m slow
def test_a_candidate_that_ends_or_hangs_on_import_is_refused_with_its_name_never_passed(tmp_path, module):
    # The candidate is imported in a process of its own, within --timeout: what its module does on import
    # reaches neither the exit status (0 would read as conforming) nor the command's own output.
    source, message = ON_IMPORT[module]
    path = tmp_path / f"{module}.py"
    path.write_text(source)
    spec = f"{path}:AdamW"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "offload_adamw", "check", spec, "--timeout", "3", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert time.perf_counter() - started < 60
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("offload-adamw check: cannot load the candidate: ") and spec in proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stdout == ""


def test_the_command_keeps_torch_out_of_its_own_process(tmp_path):
    # The check runs in a forked child that imports torch and ends with os._exit: the command's process
    # never imports torch, so it does not spend its exit tearing torch and torch._dynamo down.
    out = tmp_path / "r.json"
    code = ("import sys\nfrom offload_adamw.cli.main import main\n"
            f"status = main(['check', 'torch.optim:AdamW', '--clauses', '12', '--json', {str(out)!r}, '--no-progress'])\n"
            "print(status, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split()[-2:] == ["0", "False"], proc.stdout + proc.stderr
    assert json.loads(out.read_text())["results"][0]["verdict"] == "pass"


def test_several_candidates_one_command_each_report_a_summary_and_the_worst_exit(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # the summary's rows on one line each
    out = tmp_path / "study.json"
    candidates = ["offload_adamw:OffloadAdamW", f"{BROKEN_FILE}:EpsInsideRoot", "no_such_module_xyz:Opt"]
    status = main(["check", *candidates, "--clauses", "1,2", "--json", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert status == 2  # one candidate could not be loaded: the others were still checked
    assert captured.err.count("offload-adamw check:") == 1 and "no_such_module_xyz" in captured.err
    summary = captured.out[captured.out.rindex("\ncandidate "):]
    rows = [line for line in summary.splitlines() if line.split() and line.split()[0] in candidates]
    assert [r.split()[0] for r in rows] == candidates
    assert "conforming" in rows[0] and "NOT conforming" in rows[1] and "not checked" in rows[2]
    assert captured.out.count("conformance of ") == 2  # both reports, before the summary
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1 and data["command"] == "check"
    assert [(r["candidate"], r["failed"]) for r in data["reports"]] == [(candidates[0], []), (candidates[1], [1])]
    assert [n["candidate"] for n in data["not_checked"]] == [candidates[2]]
    assert "schema_version" not in data["reports"][0]


def test_several_candidates_exit_1_when_one_does_not_conform_and_0_when_all_do(capsys):
    assert main(["check", "offload_adamw:OffloadAdamW", f"{BROKEN_FILE}:EpsInsideRoot", "--clauses", "1",
                 "--no-progress"]) == 1
    assert main(["check", "offload_adamw:OffloadAdamW", "torch.optim:AdamW", "--clauses", "1,2",
                 "--no-progress"]) == 0
    capsys.readouterr()


def test_an_invalid_argument_stops_several_candidates_before_the_first_with_one_line(tmp_path, capsys):
    out = tmp_path / "study.json"
    status = main(["check", "offload_adamw:OffloadAdamW", "torch.optim:AdamW", "--dtype", "int8", "--json", str(out),
                   "--no-progress"])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.count("offload-adamw check:") == 1 and "unknown dtype" in captured.err
    assert "conformance of " not in captured.out
    data = json.loads(out.read_text())
    assert data["reports"] == [] and len(data["not_checked"]) == 2


CHATTY = ("import torch\nprint('chatty: imported')\n"
          "class Chatty(torch.optim.AdamW):\n"
          "    def __init__(self, *args, **kwargs):\n"
          "        print('chatty: built')\n"
          "        super().__init__(*args, **kwargs)\n")
"""A conforming candidate that prints on import and in every clause."""


KILLS_THE_CHECKS = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nclass Opt: pass\n"
"""A module whose import kills its importing process's parent: the one process that runs the command's checks."""


def test_real_subprocess_checks_several_candidates_in_one_child(tmp_path):
    out = tmp_path / "study.json"
    chatty, killer = tmp_path / "chatty.py", tmp_path / "killer.py"
    chatty.write_text(CHATTY)
    killer.write_text(KILLS_THE_CHECKS)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "400"}
    candidates = ["torch.optim:AdamW", f"{BROKEN_FILE}:NoValidation", f"{chatty}:Chatty", f"{killer}:Opt",
                  "offload_adamw:OffloadAdamW"]
    proc = subprocess.run([sys.executable, "-m", "offload_adamw", "check", *candidates, "--clauses", "12",
                           "--json", str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr  # the checks were lost, which is no usage error
    data = json.loads(out.read_text())
    assert [(r["candidate"], r["failed"]) for r in data["reports"]] == [
        ("torch.optim:AdamW", []), (f"{BROKEN_FILE}:NoValidation", [12]), (f"{chatty}:Chatty", [])]
    assert "NOT conforming" in proc.stdout and proc.stdout.count("conformance of ") == 3
    # what a candidate prints is not the command's output: it goes to stderr, never between the reports
    assert "chatty:" not in proc.stdout and "chatty: imported" in proc.stderr and "chatty: built" in proc.stderr
    # the process that ran the checks was killed at the fourth: the three reports before it are kept, and the
    # fourth and fifth are not checked, with why
    lost = "the process that ran the checks ended (killed by signal SIGKILL) before the last report"
    assert data["not_checked"] == [{"candidate": c, "why": lost} for c in candidates[3:]]
    assert proc.stderr.count(lost) == 1
    rows = [line.split()[0] for line in proc.stdout[proc.stdout.rindex("\ncandidate ") + 1:].splitlines()[2:]]
    assert rows == candidates


@pytest.mark.slow  # a real subprocess (about 8 s, most of it one clause waiting out its time limit)
def test_each_report_is_printed_when_its_check_ends_not_after_the_last(tmp_path, candidates):
    proc = subprocess.Popen([sys.executable, "-m", "offload_adamw", "check", "torch.optim:AdamW", f"{candidates}:Hangs",
                             "--clauses", "12,14", "--timeout", "4", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    shown = time.monotonic()
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 1
    ended = time.monotonic()
    assert first.startswith("conformance of torch.optim:AdamW")
    assert ended - shown > 3.0, "the first report waited for the second candidate's hanging clause"
    assert "the clause did not finish within 4 s" in rest


@pytest.mark.slow  # a real subprocess of its own (about 3.5 s); the several-candidates test above covers the tables
def test_what_a_candidate_prints_never_reaches_the_commands_stdout(tmp_path):
    # With --json - stdout is the JSON document only: what a candidate prints on import or in a clause goes to
    # stderr (each candidate is imported in a process of its own, so its output is not the command's).
    path = tmp_path / "chatty.py"
    path.write_text(CHATTY)
    candidates = [f"{path}:Chatty", "torch.optim:AdamW"]
    proc = subprocess.run([sys.executable, "-m", "offload_adamw", "check", *candidates, "--clauses", "12", "--json", "-",
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [r["candidate"] for r in data["reports"]] == candidates
    assert "chatty: imported" in proc.stderr and "chatty: built" in proc.stderr


def test_a_batch_file_checks_each_entry_with_its_own_options_in_one_command(tmp_path, capsys):
    study = tmp_path / "study.json"
    study.write_text(json.dumps([
        {"candidate": SPLIT, "map": json.loads(SPLIT_MAP), "kwargs": {"correct_bias": True}, "clauses": "1,2"},
        {"candidate": SPLIT, "map": json.loads(SPLIT_MAP), "clauses": [1]},  # without its kwargs: no bias correction
        {"candidate": "offload_adamw:OffloadAdamW", "dtype": "bf16"},
        {"candidate": "torch.optim:AdamW", "dtype": "int8"},  # the checker refuses this entry's dtype: only this one
    ]))
    out = tmp_path / "reports.json"
    status = main(["check", "--batch", str(study), "--clauses", "1,12", "--json", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.count("offload-adamw check:") == 1 and "candidate 'torch.optim:AdamW': unknown dtype" in captured.err
    data = json.loads(out.read_text())
    seen = [(r["candidate"], r["dtype"], [x["number"] for x in r["results"]], r["failed"]) for r in data["reports"]]
    assert seen == [(SPLIT, "float32", [1, 2], []), (SPLIT, "float32", [1], [1]),
                    ("offload_adamw:OffloadAdamW", "bfloat16", [1, 12], [])]  # the flags' clauses where none given
    assert [n["candidate"] for n in data["not_checked"]] == ["torch.optim:AdamW"]


@pytest.mark.parametrize("content, message", [
    ('{"candidate": "torch.optim:AdamW"}', "expected a non-empty JSON list"),
    ("[]", "expected a non-empty JSON list"),
    ("[1", "not valid JSON"),
    ('[{"candidate": "torch.optim:AdamW"}, {"candidate": "x:Y", "mapping": {}}]', "entry 1: unknown key(s) ['mapping']"),
    ('[{"dtype": "bf16"}]', "entry 0: 'candidate' must be a string"),
    ('[{"candidate": "x:Y", "clauses": "1,a"}]', "entry 0: 'clauses': expected numbers"),
    ('[{"candidate": "x:Y", "timeout": 0}]', "entry 0: 'timeout': expected a number of seconds above 0"),
    ('[{"candidate": "x:Y", "map": "eps"}]', "entry 0: 'map' must be a JSON object"),
])
def test_a_malformed_batch_file_is_a_usage_error_naming_the_entry_before_any_check(tmp_path, capsys, content, message):
    study = tmp_path / "study.json"
    study.write_text(content)
    assert main(["check", "--batch", str(study), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and "conformance of " not in captured.out


@pytest.mark.parametrize("argv, message", [
    (["check", "--no-progress"], "give a candidate to check"),
    (["check", "torch.optim:AdamW", "--batch", "study.json", "--no-progress"], "not both"),
    (["check", "--batch", "/no/such/study.json", "--no-progress"], "--batch '/no/such/study.json': no such file"),
])
def test_candidates_or_a_batch_file_one_of_them(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def _process_table(text: str) -> list[tuple[int, int, int, str, str]]:
    """(pid, parent, process group, state, kernel wait channel) of the live (not zombie) processes whose command line
    holds ``text``."""
    rows = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() not in (entry / "cmdline").read_bytes():
                    continue
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                wchan = (entry / "wchan").read_text()
            except OSError:
                continue
            if fields[0] != "Z":
                rows.append((int(entry.name), int(fields[1]), int(fields[2]), fields[0], wchan))
    return rows


def _processes_naming(text: str) -> list[int]:
    """The live processes whose command line holds ``text``."""
    return [row[0] for row in _process_table(text)]


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_an_interrupt_ends_the_command_with_130_one_line_and_every_process_it_started(candidates):
    import signal

    # As a terminal starts it, with SIGINT at its default: a test run started in the background (`make test &`)
    # ignores SIGINT, every child inherits that, and Python then keeps ignoring it, as POSIX asks; the command would
    # never see the interrupt (it hung there, every process in poll: seen in two full runs started that way). A
    # handled signal is reset to its default in the child at exec; an ignored one stays ignored.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "offload_adamw", "check", f"{candidates}:Hangs",
                                 "torch.optim:AdamW", "--clauses", "1", "--no-progress"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, before)
    deadline = time.monotonic() + 60
    while len(_processes_naming(str(candidates))) < 4:  # the command, its checks, the candidate's, the clause's
        assert time.monotonic() < deadline and proc.poll() is None, "the clause never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the terminal's group, here the command's session
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # say who was left, and end them
        left, ended = _process_table(str(candidates)), proc.poll() is not None
        for pid in [proc.pid] + [row[0] for row in left]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"60 s after the interrupt: the command {'had ended' if ended else 'still ran'}; "
                    f"its processes (pid, ppid, pgid, state, wchan): {left}")
    assert proc.returncode == 130
    assert err.strip().splitlines() == ["offload-adamw check: interrupted"] and "Traceback" not in err
    deadline = time.monotonic() + 10
    while _processes_naming(str(candidates)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_naming(str(candidates)) == [], "a process the command started outlived it"


def test_the_commands_nonfinite_choices_are_the_contracts():
    from offload_adamw.cli import check as check_command
    from offload_adamw.contract.rules import NONFINITE_POLICIES

    assert check_command.NONFINITE_POLICIES == NONFINITE_POLICIES


def test_the_commands_longest_timeout_is_the_checkers_and_the_checker_refuses_past_it_and_no_clause():
    from offload_adamw.cli import check as check_command
    from offload_adamw.conformance import checker

    assert check_command.MAX_TIMEOUT == checker.MAX_TIMEOUT
    for timeout in (checker.MAX_TIMEOUT * 2, 1e10, float("inf"), float("nan"), 0):
        with pytest.raises(ValueError, match="timeout"):
            checker.check("torch.optim:AdamW", clauses=[12], timeout=timeout)
    with pytest.raises(ValueError, match="no clause"):
        checker.check("torch.optim:AdamW", clauses=[])
