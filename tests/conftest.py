"""Every test leaves torch's process-wide settings as it found them.

The suite runs in one process, and some results (bitwise comparisons above all) depend on settings a test
could change and forget: the default dtype, deterministic algorithms, denormal flushing, the grad mode and
the number of threads. A test that leaks one fails here, by name, instead of making a later test fail.

The shared helpers and the scripts that tests run in processes of their own live in ``tests/support``, which
is put on ``sys.path`` here, before any test module imports them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))


def _settings() -> dict:
    return {
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "grad enabled": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        # set_flush_denormal returns whether it is supported; the state is read back by a subnormal's survival
        "denormals kept": bool(torch.tensor(1e-40, dtype=torch.float32).mul(1.0).item() != 0.0),
    }


@pytest.fixture(autouse=True)
def _torch_settings_unchanged():
    before = _settings()
    yield
    after = _settings()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if changed:
        for key, (old, _) in changed.items():  # restored, so that one leak fails one test only
            if key == "default dtype":
                torch.set_default_dtype(old)
            elif key == "deterministic algorithms":
                torch.use_deterministic_algorithms(old)
            elif key == "grad enabled":
                torch.set_grad_enabled(old)
            elif key == "threads":
                torch.set_num_threads(old)
            elif key == "denormals kept":
                torch.set_flush_denormal(not old)
        pytest.fail(f"the test changed torch's process-wide settings: {changed}", pytrace=False)


@pytest.fixture
def simulated_device(request):
    """Pipelines built in the test run the production stream lane on a simulated CUDA device
    (offload_adamw.testing.simulated_cuda), with the seed given by indirect parametrisation (1 by default) and the
    device index 1 (the test's thread has it current, as a rank-1 process would); the test fails on any hazard the
    device recorded (a buffer changed under a pending copy, a missing wait, a stray context, ...)."""
    from offload_adamw.testing.simulated_cuda import simulated_cuda

    seed = getattr(request, "param", 1)
    with simulated_cuda(seed, index=1) as device:
        yield device
    hazards = device.take_hazards()
    assert not hazards, f"the simulated CUDA device recorded hazards: {hazards[:3]}"
