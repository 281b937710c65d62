"""Host memory of a step: no temporary beyond one chunk per thread.

Measured, not assumed: a fresh Python process builds a bf16 model's parameters
and gradients, runs OffloadAdamW steps, and reads the kernel's high-water mark
of its resident memory (/proc/self/status VmHWM, reset through
/proc/self/clear_refs) around each step. Bounds:

* first step (allocates the state): peak - RSS before <= host_state_bytes + 64 MiB
  (after a first step of a tiny model: numba's one-off runtime is not the step's);
* later steps (the default: the numba loop, the chunk loop for tails): <= 8 MiB;
* the chunk loop alone (the fallback): <= 64 MiB, and in fact <= the chunk buffers + 8 MiB;
* the naive three-pass path, measured the same way, shows its full-size float32
  gradient temporary, so the measurement is able to fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MIB = 2**20

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from offload_adamw import OffloadAdamW
    from offload_adamw.kernels.adamw import StepHyper
    from offload_adamw.kernels.blocked import DEFAULT_CONFIG, BlockConfig, blocked_adamw_, naive_mixed_adamw_

    def kib(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024

    def measured(fn):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = kib("VmRSS")
        fn()
        return kib("VmHWM") - before

    torch.manual_seed(0)
    # A process's first mixed step also compiles the numba loop (or loads it from numba's cache):
    # a one-off of numba's runtime (about 70 MiB here) that does not grow with the model, kept out
    # of the bounds below by a first step on a tiny model.
    tiny = torch.nn.Parameter(torch.randn(256).to(torch.bfloat16))
    tiny.grad = torch.randn(256).to(torch.bfloat16)
    runtime = measured(OffloadAdamW([tiny], lr=1e-3, pin_memory=False).step)
    shapes = [(2048, 2048), (1536, 2048), (1001,), (1024, 1024 + 13)]
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape).to(torch.bfloat16)
    elements = sum(p.numel() for p in params)
    opt = OffloadAdamW(params, lr=1e-3, pin_memory=False)
    first = measured(opt.step)
    state = opt.host_state_bytes()
    later = max(measured(opt.step) for _ in range(3))

    masters = [opt.state[p]["master_param"] for p in params]
    m = [opt.state[p]["exp_avg"] for p in params]
    v = [opt.state[p]["exp_avg_sq"] for p in params]
    steps = [opt.state[p]["step"] for p in params]
    hp = StepHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    naive = measured(lambda: naive_mixed_adamw_(masters, [p.grad for p in params], m, v, [], steps,
                                                 [p.data for p in params], hp))
    # The chunk loop alone (the fallback where numba is unavailable): one buffer per worker thread.
    chunked = BlockConfig(numba_loop=False)
    grads = [p.grad for p in params]
    outs = [p.data for p in params]
    chunk_later = max(measured(lambda: blocked_adamw_(masters, grads, m, v, [], steps, outs, hp, config=chunked))
                      for _ in range(3))
    print(json.dumps(dict(first=first, later=later, naive=naive, state=state, elements=elements,
                          chunk_later=chunk_later, runtime=runtime,
                          threads=torch.get_num_threads(), chunk=DEFAULT_CONFIG.chunk_elements)))
    """
)


@pytest.fixture(scope="module")
def measurement():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_first_step_allocates_only_the_state_plus_64_mib(measurement):
    assert measurement["first"] <= measurement["state"] + 64 * MIB, measurement


def test_later_steps_allocate_nothing(measurement):
    # the numba loop reads and writes the tensors in place (8 MiB: allocator noise, the tails' chunk buffers)
    assert measurement["later"] <= 8 * MIB, measurement


def test_the_chunk_loop_allocates_at_most_one_chunk_per_thread(measurement):
    buffers = measurement["threads"] * measurement["chunk"] * 4
    assert measurement["chunk_later"] <= 64 * MIB, measurement
    assert measurement["chunk_later"] <= buffers + 8 * MIB, measurement


def test_the_measurement_sees_the_naive_paths_temporary(measurement):
    # the widened gradients of every tensor at once: 4 bytes per element
    assert measurement["naive"] >= 0.9 * 4 * measurement["elements"], measurement
