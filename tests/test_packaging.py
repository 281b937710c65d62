"""Packaging: the licence, the typing marker, one version source, and an import that works off POSIX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

import offload_adamw
from offload_adamw._version import __version__

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_license_file_and_spdx_string():
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0" in (REPO / "LICENSE").read_text()
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert "LICENSE" in project["license-files"]
    requires = " ".join(PYPROJECT["build-system"]["requires"])
    assert "setuptools>=77" in requires  # the first setuptools that reads an SPDX license string


def test_one_version_source():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "offload_adamw._version.__version__"}
    assert offload_adamw.__version__ == __version__


def test_typed_marker_and_classifiers():
    assert (REPO / "src" / "offload_adamw" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["offload_adamw"]
    classifiers = PYPROJECT["project"]["classifiers"]
    assert "Typing :: Typed" in classifiers and any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers)


def test_numpy_is_a_core_dependency():
    # safetensors' torch API imports numpy; the CPU torch wheel does not bring it (tests/test_clean_install.py shows it)
    assert any(d.replace(" ", "").startswith("numpy") for d in PYPROJECT["project"]["dependencies"])


def test_import_and_a_step_work_without_the_resource_module():
    code = (
        "import sys; sys.modules['resource'] = None\n"  # as on Windows: `import resource` raises ImportError
        "import torch, offload_adamw\n"
        "from offload_adamw import OffloadAdamW\n"
        "from offload_adamw.optim.preflight import host_memory\n"
        "assert host_memory().memlock_limit is None\n"
        "p = torch.nn.Parameter(torch.ones(4)); o = OffloadAdamW([p], lr=0.1, pin_memory=False)\n"
        "p.grad = torch.ones(4); o.step(); print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
