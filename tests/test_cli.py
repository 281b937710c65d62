"""The `offload-adamw` command line: version, help, and what happens when an optional package is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from offload_adamw import __version__
from offload_adamw.cli.main import SUBCOMMANDS, main


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_version_and_help_list_every_subcommand(capsys):
    assert main(["--version"]) == 0 and __version__ in capsys.readouterr().out
    assert main([]) == 0
    shown = capsys.readouterr().out
    assert all(name in shown for name in SUBCOMMANDS)


def test_demo_without_its_optional_dependencies_says_what_to_install():
    proc = run_python(
        "import sys; sys.modules['transformers'] = None\n"  # as if transformers were not installed
        "from offload_adamw.cli.main import main; sys.exit(main(['demo', '--steps', '2']))"
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs transformers" in proc.stderr and "offload-adamw[demo]" in proc.stderr


def test_a_missing_optional_package_is_named_with_its_extra(tmp_path):
    proc = run_python(
        "import sys; sys.modules['matplotlib'] = None\n"
        "from offload_adamw.cli.main import main; "
        f"sys.exit(main(['plan', '--preset', 'llama-3-8b', '--plot', r'{tmp_path / 'p.png'}']))"
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs matplotlib" in proc.stderr and "offload-adamw[plot]" in proc.stderr
    assert not (tmp_path / "p.png").exists()


# ----------------------------------------------------------------------------- one error path


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload_adamw", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_usage_error(done: subprocess.CompletedProcess, *culprits: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for culprit in culprits:
        assert culprit in lines[0], lines[0]
    assert done.stdout == ""  # refused before any work: nothing printed


@pytest.mark.parametrize(
    "argv, culprits",
    [
        (["bench", "--sizes", "1Q"], ["--sizes", "1Q"]),
        (["bench", "--cases", "nope"], ["--cases", "nope"]),
        (["bench", "--repeats", "0"], ["--repeats"]),
        (["plan", "--params", "1e400"], ["--params", "1e400"]),
        (["plan", "--preset", "llama-3-8b", "--gpus-per-node", "0"], ["gpus_per_node"]),
        (["plan", "--preset", "nope"], ["--preset", "nope"]),
        (["plan", "--preset", "llama-3-8b", "--json", "/nonexistent/dir/plan.json"], ["--json", "/nonexistent/dir"]),
        (["check", "torch.optim:AdamW", "--json", "/nonexistent/dir/x.json"], ["--json", "/nonexistent/dir"]),
        (["check", "torch.optim:AdamW", "--clauses", "x"], ["--clauses"]),
        (["audit", "/nonexistent/opt.pt"], ["/nonexistent/opt.pt"]),
        (["audit", "/nonexistent/opt.pt", "--steps", "-1"], ["--steps"]),
        (["demo", "--steps", "1"], ["--steps"]),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0] in SUBCOMMANDS else "",
)
def test_usage_errors_exit_2_on_one_line_naming_the_culprit(argv, culprits):
    assert_usage_error(run_cli(*argv), *culprits)


def test_an_output_path_that_is_a_directory_or_unwritable_is_refused_first(tmp_path):
    assert_usage_error(run_cli("plan", "--preset", "llama-3-8b", "--json", str(tmp_path)), "is a directory")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_usage_error(run_cli("demo", "--out", str(blocker / "sub")), "--out")
    assert_usage_error(run_cli("plan", "--preset", "llama-3-8b", "--plot", str(blocker / "p.png")), "--plot")


def test_check_refuses_an_unwritable_json_before_the_run(tmp_path):
    import time

    started = time.perf_counter()
    done = run_cli("check", "torch.optim:AdamW", "--json", "/nonexistent/dir/x.json")
    assert_usage_error(done, "/nonexistent/dir")
    assert time.perf_counter() - started < 30  # the whole check takes far longer: it did not run


@pytest.mark.parametrize("argv", [["plan", "--preset", "llama-3-8b"], ["bench", "--quick", "--cases", "ours-fp32"]])
def test_plot_without_matplotlib_fails_before_the_run(tmp_path, argv):
    target = tmp_path / "p.png"
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            f"from offload_adamw.cli.main import main; sys.exit(main({[*argv, '--plot', str(target)]!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert_usage_error(done, "matplotlib", "offload-adamw[plot]")
    assert not target.exists()


def test_a_closed_pipe_ends_quietly():
    # head may read everything before it exits (the output fits the pipe's buffer): then the writer never sees
    # the closed pipe and ends with 0; both endings must be quiet.
    done = subprocess.run(f"{sys.executable} -m offload_adamw plan --preset llama-3-70b | head -1; "
                          "echo \"status ${PIPESTATUS[0]}\"", shell=True, executable="/bin/bash", capture_output=True,
                          text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("llama-3-70b: 70,553,706,496 parameters")
    assert lines[-1] in ("status 141", "status 0")
    assert done.stderr == "", done.stderr
    # A reader that is gone before the first write (the interpreter takes far longer to start than it to exit).
    done = subprocess.run(f"{sys.executable} -m offload_adamw plan --preset llama-3-70b | (exit 0); "
                          "echo \"status ${PIPESTATUS[0]}\"", shell=True, executable="/bin/bash", capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "status 141"
    assert done.stderr == "", done.stderr


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_help_lists_the_exit_codes_and_the_json_convention(name, capsys):
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert "exit status:" in out and "  2 " in out and "141" in out
    assert "--json [FILE]" in out
    if name != "plan":
        assert "--progress, --no-progress" in out or name == "audit"
    assert main(["--help"]) == 0
    assert "exit status:" in capsys.readouterr().out


# ----------------------------------------------------------------------------- --json means the same everywhere


def test_json_to_stdout_or_to_a_file_is_the_same_document(tmp_path, capsys):
    assert main(["plan", "--preset", "llama-3-8b", "--json"]) == 0
    to_stdout = json.loads(capsys.readouterr().out)
    target = tmp_path / "plan.json"
    assert main(["plan", "--preset", "llama-3-8b", "--json", str(target)]) == 0
    captured = capsys.readouterr()
    assert "Recommendation:" in captured.out  # with a FILE the tables still go to stdout
    assert json.loads(target.read_text()) == to_stdout
    assert main(["plan", "--preset", "llama-3-8b", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == to_stdout
    assert to_stdout["schema_version"] == 1 and to_stdout["command"] == "plan"


def test_check_and_audit_json_carry_the_schema_version(tmp_path, capsys):
    assert main(["check", "offload_adamw:OffloadAdamW", "--clauses", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # only the document: the table is left out
    assert report["schema_version"] == 1 and report["command"] == "check" and report["failed"] == []
    import torch

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(3)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    status = main(["audit", str(tmp_path / "opt.pt"), "--json", str(tmp_path / "audit.json")])
    assert status in (0, 1)
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["schema_version"] == 1 and audit["command"] == "audit" and "findings" in audit


def test_bench_json_carries_the_schema_version(capsys):
    argv = ["bench", "--sizes", "64K", "--repeats", "1", "--warmup", "0", "--cases", "ours-fp32",
            "--bandwidth-elements", "64K", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["schema_version"] == 1 and result["command"] == "bench" and len(result["sizes"]) == 1


# ----------------------------------------------------------------------------- no torch for --help and plan


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], ["plan", "--help"], ["plan", "--preset", "llama-3-70b"],
     ["plan", "--preset", "mixtral-8x7b", "--json"], ["plan", "--params", "7B"], ["check", "--help"], ["audit", "--help"],
     ["demo", "--help"]],
    ids=" ".join,
)
def test_help_and_plan_import_no_torch(argv):
    code = (
        "import sys, io, contextlib\n"
        "from offload_adamw.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    status = main({argv!r})\n"
        "assert status in (0, 1), status\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_plan_with_a_config_file_imports_no_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "num_local_experts": 4}))
    code = ("import sys\nfrom offload_adamw.cli.main import main\n"
            f"main(['plan', '--config', {str(tmp_path)!r}, '--json'])\n"
            "print('torch' in sys.modules, file=sys.stderr)\n")
    done = run_python(code)
    assert done.returncode == 0 and done.stderr.strip() == "False", done.stderr


def test_help_takes_a_fraction_of_the_time_of_importing_torch():
    import time

    def fastest(argv: list[str]) -> float:
        times = []
        for _ in range(2):
            started = time.perf_counter()
            subprocess.run(argv, capture_output=True, timeout=120, check=True)
            times.append(time.perf_counter() - started)
        return min(times)

    torch_import = fastest([sys.executable, "-c", "import torch"])
    help_time = fastest([sys.executable, "-m", "offload_adamw", "--help"])
    assert help_time < 0.6 * torch_import, (help_time, torch_import)


# ----------------------------------------------------------------------------- inputs and outputs it cannot use


def _fifo(tmp_path, name: str = "fifo"):
    path = tmp_path / name
    os.mkfifo(path)
    return path


def _big(tmp_path):
    """A regular file one byte over the input limit (sparse: no disk used)."""
    path = tmp_path / "big.json"
    with open(path, "wb") as f:
        f.truncate(16 * 2**20 + 1)
    return path


@pytest.mark.parametrize("clauses", ["", ",", " , "])
def test_check_refuses_an_empty_clause_list(clauses):
    assert_usage_error(run_cli("check", "torch.optim:AdamW", "--clauses", clauses), "--clauses", "no clause")


@pytest.mark.parametrize("timeout", ["1e10", "nan", "inf", "-inf", "0", "-5", "1e300"])
def test_check_refuses_a_timeout_out_of_range(timeout):
    # "--timeout=V": argparse reads "-inf" after a space as an option of its own
    assert_usage_error(run_cli("check", "torch.optim:AdamW", f"--timeout={timeout}"), "--timeout", timeout)


@pytest.mark.parametrize("entry, culprit", [({"clauses": []}, "no clause"), ({"clauses": ""}, "no clause"),
                                             ({"timeout": 1e10}, "timeout")])
def test_check_refuses_the_same_in_a_batch_entry(tmp_path, entry, culprit):
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps([{"candidate": "torch.optim:AdamW", **entry}]))
    assert_usage_error(run_cli("check", "--batch", str(batch)), "entry 0", culprit)


FULL = "/dev/full"


@pytest.mark.skipif(not os.path.exists(FULL), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["check", "torch.optim:AdamW", "--json", FULL], ["audit", "opt.pt", "--json", FULL],
                                  ["demo", "--steps", "2", "--json", FULL], ["plan", "--preset", "llama-3-8b", "--json", FULL],
                                  ["plan", "--preset", "llama-3-8b", "--plot", FULL],
                                  ["bench", "--quick", "--json", FULL]], ids=" ".join)
def test_an_output_that_accepts_no_bytes_is_refused_before_any_work(tmp_path, argv):
    argv = [str(tmp_path / a) if a == "opt.pt" else a for a in argv]
    (tmp_path / "opt.pt").write_bytes(b"")
    started = time.perf_counter()
    done = run_cli(*argv, "--out", str(tmp_path / "demo")) if argv[0] == "demo" else run_cli(*argv)
    assert_usage_error(done, FULL, "No space left on device")
    assert time.perf_counter() - started < 60  # demo, bench and check take minutes: none of them ran


def test_an_output_fifo_without_a_reader_is_refused_before_any_work(tmp_path):
    fifo = _fifo(tmp_path)
    assert_usage_error(run_cli("plan", "--preset", "llama-3-8b", "--json", str(fifo), timeout=60), str(fifo), "FIFO")


def _limited_file_size(limit: int):
    """In the child: files of at most ``limit`` bytes, and a write past it fails (EFBIG) instead of killing it."""

    def apply() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize("argv", [["plan", "--preset", "llama-3-8b"], ["check", "torch.optim:AdamW", "--clauses", "12"]],
                         ids=lambda a: " ".join(a[:2]))
def test_a_write_that_fails_at_the_end_is_one_line_and_a_status_of_its_own(tmp_path, argv):
    target = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "offload_adamw", *argv, "--json", str(target)], capture_output=True,
                          text=True, timeout=300, preexec_fn=_limited_file_size(64))
    assert done.returncode == 74, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"offload-adamw {argv[0]}: --json {target}: could not write") and "File too large" in last, last
    assert done.stdout  # the work was done and its tables printed: only the file is missing


@pytest.mark.parametrize("kind", ["character device", "FIFO", "too large"])
@pytest.mark.parametrize("argv", [["plan", "--config", "{}"], ["check", "--batch", "{}"],
                                  ["check", "torch.optim:AdamW", "--kwargs", "@{}"],
                                  ["check", "torch.optim:AdamW", "--map", "@{}"]], ids=lambda a: " ".join(a[:2]))
def test_an_input_file_is_a_regular_file_of_at_most_16_mib(tmp_path, argv, kind):
    source = {"character device": "/dev/zero", "FIFO": None, "too large": None}[kind]
    if kind == "FIFO":
        source = str(_fifo(tmp_path))
    elif kind == "too large":
        source = str(_big(tmp_path))
    done = run_cli(*[a.replace("{}", source) for a in argv], timeout=60)
    assert_usage_error(done, source, "16 MiB" if kind == "too large" else kind)


def test_plan_config_directory_whose_config_json_is_a_fifo(tmp_path):
    _fifo(tmp_path, "config.json")
    assert_usage_error(run_cli("plan", "--config", str(tmp_path), timeout=60), "config.json", "FIFO")


@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_audit_says_what_its_input_is_when_it_is_not_a_file(tmp_path, kind):
    path = _fifo(tmp_path) if kind == "FIFO" else tmp_path
    done = run_cli("audit", str(path), timeout=60)
    assert_usage_error(done, str(path), kind)
    assert "no such file" not in done.stderr


@pytest.mark.parametrize("flag", ["--sizes", "--bandwidth-elements", "--scaling-size"])
def test_bench_refuses_sizes_beyond_the_memory_of_this_machine(flag):
    done = run_cli("bench", flag, "999G", "--repeats", "1", timeout=120)
    assert_usage_error(done, flag, "999G", "memory")


@pytest.mark.parametrize("argv", [["demo", "--out", "afile/sub"], ["plan", "--preset", "llama-3-8b", "--json", "afile/x/p.json"],
                                  ["check", "torch.optim:AdamW", "--json", "afile/x.json"]], ids=" ".join)
def test_an_output_under_a_file_names_the_file(tmp_path, argv):
    (tmp_path / "afile").write_text("")
    done = run_cli(*[str(tmp_path / a) if a.startswith("afile") else a for a in argv])
    assert_usage_error(done, f"{tmp_path / 'afile'} is a file, not a directory")


def test_bench_memory_figure_is_what_a_workload_holds():
    from offload_adamw.benchmarking.workload import make_workload
    from offload_adamw.cli.bench import WORKLOAD_BYTES_PER_ELEMENT

    w = make_workload(4096)
    arrays = w.master + w.exp_avg + w.exp_avg_sq + w.grad32 + w.grad16 + w.model16
    assert sum(t.numel() * t.element_size() for t in arrays) == WORKLOAD_BYTES_PER_ELEMENT * w.elements


@pytest.mark.skipif(not os.path.exists(FULL), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["plan", "--preset", "llama-3-8b"], ["plan", "--preset", "llama-3-8b", "--json"],
                                  ["check", "torch.optim:AdamW", "--json"]], ids=" ".join)
def test_a_stdout_that_accepts_no_bytes_is_refused_before_any_work(argv):
    with open(FULL, "w") as full:
        done = subprocess.run([sys.executable, "-m", "offload_adamw", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [f"offload-adamw {argv[0]}: stdout: cannot be written (No space left on device)"]


def test_a_stdout_write_that_fails_at_the_end_is_one_line_and_a_status_of_its_own(tmp_path):
    with open(tmp_path / "out.txt", "w") as out:
        done = subprocess.run([sys.executable, "-m", "offload_adamw", "plan", "--preset", "llama-3-8b"], stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=_limited_file_size(64))
    assert done.returncode == 74 and "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offload-adamw plan: stdout: could not write (File too large)"), lines
