"""Packaging: the licence, the typing marker, one version source, and an import that works off POSIX."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


PINS = REPO / "requirements" / "pins.txt"


def _pins() -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in PINS.read_text().splitlines()]
    return {canonicalize_name(name): version for name, _, version in (line.partition("==") for line in lines if line)}


def test_the_pins_fix_every_requirement_of_the_test_and_docs_extras():
    # a requirement of an extra that is not pinned would be taken at whatever version the registry serves that day
    pins = _pins()
    assert pins["torch"] == "2.13.0"  # the build the Makefile installs
    assert all(version and "*" not in version for version in pins.values())
    wanted = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["test"] + \
        PYPROJECT["project"]["optional-dependencies"]["docs"]
    missing = [r for r in wanted if canonicalize_name(Requirement(r).name) not in pins]
    assert not missing, f"requirements/pins.txt pins none of {missing}: run `make pins`"
    outside = [r for r in wanted if not Requirement(r).specifier.contains(pins[canonicalize_name(Requirement(r).name)],
                                                                       prereleases=True)]
    assert not outside, f"requirements/pins.txt pins versions these requirements exclude: {outside}"


@pytest.mark.skipif(os.environ.get("PIP_CONSTRAINT") != str(PINS),
                    reason="the environment was not installed with requirements/pins.txt (make test-latest, or no make)")
def test_the_environment_is_the_pinned_one():
    # make test installs through the pins: every distribution in the venv is the pinned version, so a clean clone
    # tests what this one tested; a package the pins do not name came in by another route
    pins = _pins()
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    installed.pop("offload-adamw", None)
    differ = {n: (v, pins.get(n)) for n, v in installed.items() if pins.get(n) != v.split("+")[0]}
    assert not differ, f"installed (version, pinned): {differ}; run `make pins` to move the pins"
