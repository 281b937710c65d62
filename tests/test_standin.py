"""The asynchronous stand-in device itself (accel/standin.py): CUDA's ordering semantics on the CPU.

Properties: a copy's destination holds poison until the copy has landed and the data after its wait; a stream
runs its work in order; a completion waits for the work it stands for; the compute stream (the calling thread)
blocks where CUDA would make it wait; a source changed while its copy is pending leaves the destination
poisoned and records a hazard; the engine is chosen by the environment variable or ``use``, and every tensor
it serves counts as a device tensor (the optimizer keeps a master for it). These are what make the stand-in
suites able to fail; tests/test_standin_suites.py runs the pipeline's bitwise suites on it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from offload_adamw.accel import standin
from offload_adamw.accel.transfer import TransferEngine


def _engine(seed: int = 3) -> TransferEngine:
    return standin.engine(seed)


def test_a_copy_lands_late_into_a_poisoned_buffer() -> None:
    engine = _engine()
    src = torch.arange(1000, dtype=torch.float32)
    dst = torch.zeros(1000)
    poisoned = []
    for _ in range(20):  # at least one of twenty copies is still in flight right after it is issued
        done = engine.copy_to_host(src, dst)
        poisoned.append(bool(torch.isnan(dst).all()) and not done.done())
        done.wait()
        assert torch.equal(dst, src), "after its wait the destination holds the source"
    assert any(poisoned), "no copy was ever seen before it landed: the stand-in is not asynchronous"
    engine.close()


def test_work_on_one_stream_completes_in_order() -> None:
    engine = _engine()
    dst = [torch.zeros(10) for _ in range(30)]
    done = [engine.copy_to_host(torch.full((10,), float(i)), d) for i, d in enumerate(dst)]
    done[-1].wait()
    assert all(c.done() for c in done), "the last copy completed before an earlier one on the same stream"
    assert all(torch.equal(d, torch.full((10,), float(i))) for i, d in enumerate(dst))
    engine.close()


def test_the_compute_stream_blocks_where_cuda_would_make_it_wait() -> None:
    engine = _engine()
    device_tensor = torch.zeros(100)
    host = torch.ones(100)
    sent = engine.send_to_device(torch.device("cpu"), [(device_tensor, host)])
    engine.compute_waits(torch.device("cpu"), sent)
    assert sent.done() and torch.equal(device_tensor, host)
    engine.close()


def test_a_source_overwritten_before_its_copy_landed_is_a_hazard() -> None:
    standin.clear_hazards()
    engine = _engine()
    host = torch.ones(100)
    device_tensor = torch.zeros(100)
    for _ in range(20):
        sent = engine.send_to_device(torch.device("cpu"), [(device_tensor, host)])
        host.add_(1)  # the staging buffer written again before the copy out of it has ended
        sent.wait()
        if standin.hazards():
            break
    assert standin.hazards(), "overwriting a buffer a pending copy reads was never noticed"
    assert torch.isnan(device_tensor).all(), "the destination of a hazardous copy must keep its poison"
    standin.clear_hazards()
    engine.close()


def test_every_tensor_the_stand_in_serves_is_a_device_tensor() -> None:
    from offload_adamw import OffloadAdamW

    p = torch.nn.Parameter(torch.randn(4, 4))
    q = torch.nn.Parameter(torch.randn(4))
    with standin.use(5):
        opt = OffloadAdamW([p], transfer_pipeline=True)
    plain = OffloadAdamW([q], transfer_pipeline=True)
    assert standin.is_device_tensor(p) and not standin.is_device_tensor(q)
    assert opt.transfer_pipeline is not None and opt.transfer_pipeline.engine.is_device(p.device)
    assert plain.transfer_pipeline is not None and not plain.transfer_pipeline.engine.is_device(q.device)
    p.grad = torch.ones_like(p)
    opt.step()
    assert "master_param" in opt.state[p], "a float32 parameter on a device has a host master"


@pytest.mark.slow  # fresh processes (7 s); the suites select it with standin.use in CI
def test_the_environment_selects_the_stand_in_and_a_bad_seed_is_refused() -> None:
    code = (
        "import torch\nfrom offload_adamw import OffloadAdamW\nfrom offload_adamw.accel import standin\n"
        "p = torch.nn.Parameter(torch.ones(3))\nOffloadAdamW([p], transfer_pipeline=True)\n"
        "print(standin.is_device_tensor(p))\n"
    )
    env = dict(os.environ, **{standin.ENV: "7"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"
    env[standin.ENV] = "seven"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and standin.ENV in bad.stderr


@pytest.mark.parametrize("seed", [1, 2])
def test_an_early_read_gives_wrong_bits(seed: int) -> None:
    """The reason the stand-in exists: reading a host buffer without waiting for its copy reads poison."""
    engine = _engine(seed)
    src = torch.randn(4096)
    dst = torch.empty(4096)
    wrong = 0
    for _ in range(20):
        done = engine.copy_to_host(src, dst)
        early = dst.clone()  # no wait
        done.wait()
        wrong += int(not torch.equal(early, src))
    assert wrong > 0
    engine.close()
