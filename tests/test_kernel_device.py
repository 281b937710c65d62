"""The device-side update (kernels/fused_device.py) is torch.optim.AdamW(fused=True), bit for bit, whole or in chunks.

Table: every shape at once (0-dim, 0-element, odd sizes, sizes around CHUNK_ALIGN) x dtypes (float32, float64, bf16/fp16
models over float32 masters) x options (amsgrad, maximize, tensor lr, no weight decay, GradScaler's scale) x
chunkings (whole tensors; chunks of CHUNK_ALIGN elements; a random chunking). Property: after several steps
master, moments, step counts and model copies equal the reference's, where the reference is
``torch.optim.AdamW(fused=True)`` on float32 copies fed the widened gradients, followed by the round-to-nearest
cast. Also: the caller's gradient is never written, and edits of a model copy are taken over as the host kernel
takes them (kernels/edits.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _parity import same_bits
from offload_adamw.kernels import adamw_update_
from offload_adamw.kernels.adamw import StepHyper
from offload_adamw.kernels.fused_device import CHUNK_ALIGN, advance_steps, fused_adamw_

STEPS = 3
SHAPES = {
    "0-dim": ((),),
    "0-element": ((0,), (5,)),
    "odd": ((1,), (17,), (65,), (7, 13)),
    "align": ((CHUNK_ALIGN - 1,), (CHUNK_ALIGN,), (CHUNK_ALIGN + 17,), (3, CHUNK_ALIGN + 5)),
}


@dataclass(frozen=True)
class Options:
    name: str
    amsgrad: bool = False
    maximize: bool = False
    tensor_lr: bool = False
    weight_decay: float = 0.1
    scaled: bool = False

    def hyper(self, lr: float) -> dict:
        return dict(lr=torch.tensor(lr) if self.tensor_lr else lr, betas=(0.9, 0.99), eps=1e-8,
                    weight_decay=self.weight_decay, amsgrad=self.amsgrad, maximize=self.maximize)


OPTIONS = [
    Options("plain"), Options("amsgrad", amsgrad=True), Options("maximize", maximize=True),
    Options("tensor-lr", tensor_lr=True), Options("no-decay", weight_decay=0.0), Options("scaled", scaled=True),
    Options("amsgrad-scaled-maximize", amsgrad=True, scaled=True, maximize=True),
]
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALE = 1024.0


def _chunks(n: int, how: str, rng: torch.Generator) -> list[tuple[int, int]]:
    """[start, end) element ranges that cover a tensor of ``n`` elements, their inner bounds multiples of CHUNK_ALIGN."""
    if how == "whole" or n == 0:
        return [(0, n)] if n else []
    bounds = [0]
    while bounds[-1] < n:
        blocks = 1 if how == "align" else int(torch.randint(1, 3, (), generator=rng))
        bounds.append(min(n, bounds[-1] + blocks * CHUNK_ALIGN))
    return list(zip(bounds, bounds[1:]))


def _run(shapes, dtype: torch.dtype, options: Options, chunking: str, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    master_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    values = [torch.randn(s, generator=gen, dtype=torch.float64).to(master_dtype) for s in shapes]
    model = [v.to(dtype) for v in values]
    # ours: the masters are float32 copies of the (rounded) model, as the optimizer's state starts
    masters = [m.to(master_dtype) for m in model]
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    max_sqs = [torch.zeros_like(m) for m in masters]
    steps = [torch.zeros((), dtype=torch.float32) for _ in masters]
    own = dtype == master_dtype
    # the reference: torch's fused AdamW on float32 copies
    copies = [torch.nn.Parameter(m.to(master_dtype)) for m in model]
    ref = torch.optim.AdamW(copies, fused=True, **options.hyper(1e-2))
    hp = StepHyper(lr=options.hyper(1e-2)["lr"], beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=options.weight_decay,
                   amsgrad=options.amsgrad, maximize=options.maximize)
    for _ in range(STEPS):
        grads = [(torch.randn(s, generator=gen) * (SCALE if options.scaled else 1.0)).to(dtype) for s in shapes]
        before = [g.clone() for g in grads]
        for c, g in zip(copies, grads):
            c.grad = g.to(master_dtype, copy=True)  # torch's CPU fused op writes the unscaled gradient back
        if options.scaled:
            ref.grad_scale = torch.tensor(SCALE)
            ref.found_inf = torch.zeros(())
        ref.step()
        counts = advance_steps(steps, torch.device("cpu"))
        lists: dict[str, list] = {k: [] for k in ("m", "g", "e", "v", "x", "c", "o")}
        for i, n in enumerate(m.numel() for m in masters):
            flat = [t.reshape(-1) for t in (masters[i], grads[i], exp_avgs[i], exp_avg_sqs[i], max_sqs[i])]
            out = None if own else model[i].reshape(-1)
            for a, b in _chunks(n, chunking, gen):
                for key, t in zip("mgevx", flat):
                    lists[key].append(t[a:b])
                lists["c"].append(counts[i])
                lists["o"].append(None if out is None else out[a:b])
        fused_adamw_(lists["m"], lists["g"], lists["e"], lists["v"], lists["x"], lists["c"], hp, model_copies=lists["o"],
                     grad_scale=torch.tensor(SCALE) if options.scaled else None)
        assert all(same_bits(g, b) for g, b in zip(grads, before)), "the caller's gradient was written"
        if own:
            model = masters
    for i, c in enumerate(copies):
        theirs = ref.state[c]
        assert same_bits(masters[i], c.detach()), f"master {i} ({tuple(c.shape)})"
        assert same_bits(exp_avgs[i], theirs["exp_avg"]) and same_bits(exp_avg_sqs[i], theirs["exp_avg_sq"]), i
        if options.amsgrad:
            assert same_bits(max_sqs[i], theirs["max_exp_avg_sq"]), i
        assert same_bits(steps[i], theirs["step"]), i
        assert same_bits(model[i], c.detach().to(dtype)), f"model copy {i}"


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_whole_tensors_are_torch_fused(dtype, options) -> None:
    _run([s for shapes in SHAPES.values() for s in shapes], dtype, options, "whole")


@pytest.mark.parametrize("chunking", ["align", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("options", [OPTIONS[0], OPTIONS[-1]], ids=lambda o: o.name)
def test_chunks_are_torch_fused(options, dtype, chunking) -> None:
    _run(SHAPES["align"] + SHAPES["odd"], dtype, options, chunking)


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * CHUNK_ALIGN + 70), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_any_chunking_at_aligned_bounds_gives_the_same_bits(sizes, seed) -> None:
    """The law: chunk boundaries on multiples of CHUNK_ALIGN change no bit (bf16 model, float32 masters)."""
    _run([(n,) for n in sizes], torch.bfloat16, OPTIONS[0], "random", seed=seed)


def test_edits_of_the_model_copy_are_taken_as_the_host_kernel_takes_them() -> None:
    gen = torch.Generator().manual_seed(3)
    n = CHUNK_ALIGN + 9
    hp = StepHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    runs = []
    for device_side in (True, False):
        gen.manual_seed(3)
        master = torch.randn(n, generator=gen)
        model = master.to(torch.bfloat16)
        m, v, step = torch.zeros(n), torch.zeros(n), torch.zeros(())
        grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        model[::5] = 0.125  # edited between two updates
        if device_side:
            counts = advance_steps([step], torch.device("cpu"))
            fused_adamw_([master[:CHUNK_ALIGN], master[CHUNK_ALIGN:]], [grad[:CHUNK_ALIGN], grad[CHUNK_ALIGN:]],
                         [m[:CHUNK_ALIGN], m[CHUNK_ALIGN:]], [v[:CHUNK_ALIGN], v[CHUNK_ALIGN:]], [], counts * 2, hp,
                         model_copies=[model[:CHUNK_ALIGN], model[CHUNK_ALIGN:]], take_edits=[True, True])
        else:
            adamw_update_([master], [grad], [m], [v], [], [step], hp, model_params=[model], take_model_edits=[True])
        runs.append((master, model, m, v, step))
    for ours, host in zip(*runs):
        assert same_bits(ours, host)


def test_widened_buffers_receive_the_gradient_and_lengths_are_checked() -> None:
    master, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    grad = torch.ones(8, dtype=torch.bfloat16)
    buffer = torch.full((8,), float("nan"))
    hp = StepHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    fused_adamw_([master], [grad], [m], [v], [], advance_steps([torch.zeros(())], torch.device("cpu")), hp,
                 widened=[buffer])
    assert torch.equal(buffer, torch.ones(8)) and bool((master < 0).all())
    with pytest.raises(ValueError, match="counts has 0 tensors, masters has 1"):
        fused_adamw_([master], [grad], [m], [v], [], [], hp)
