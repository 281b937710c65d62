"""The `offload-adamw` command line: version, help, and what happens when an optional package is missing."""

from __future__ import annotations

import subprocess
import sys

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
        f"from offload_adamw.cli.main import main; sys.exit(main(['plan', '--preset', 'llama-3-8b', '--plot', r'{tmp_path / 'p.png'}']))"
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs matplotlib" in proc.stderr and "offload-adamw[plot]" in proc.stderr
    assert not (tmp_path / "p.png").exists()
