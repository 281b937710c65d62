"""Where the update runs (``update_on``: "host", "stream", "device"), with the CPU as device (docs/placement.md).

Table: placements of the parity table's two groups (both streamed, both resident, streamed beside resident, and each
beside a host group) crossed with rows of tests/test_offload_parity.py (float32 and bf16 models, kept and freed
gradients, accumulation 1 and 4, clipping with opt.clip_grad_norm_ against torch's clip_grad_norm_, fp16 GradScaler
with and without unscale_ and a forced skip, amsgrad in one group, a frozen and a later unfrozen layer, a head
without a gradient every third step). Property: parameters, moments, masters and step counts are bitwise
torch.optim.AdamW(fused=True)'s on float32 master copies (with the CPU as device that is also the host
placement's result: the host kernel is that definition, tests/test_kernel.py).

Then, generic properties: the ring (tensors of many chunks, 2 and 3 buffers, amsgrad, bf16) gives the same bits;
the gradient of a streamed or resident group never reaches host memory; every placement gives the host
placement's bits, edits of the parameters between steps included; ``state_dict`` is the same whatever the
placement and a resume may change it (load_state_dict and offload_adamw.checkpoint); a placement changed between
steps moves the state and keeps the bits, one changed between backward and step() is refused; bad values are
refused by name; the pre-flight refuses what does not fit before any update.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_offload_parity as parity
from _parity import same_bits
from offload_adamw import OffloadAdamW, checkpoint, is_host_resident
from offload_adamw.optim.preflight import HostMemoryError

C = {case.id: case for case in parity.CASES}
CHUNK = 1 << 20  # the smallest ring buffer: the ring's tests cut their tensors into many chunks

#: (placement of group 0, of group 1) -> the parity rows it runs (together: every row feature for every placement)
PLACED = {
    ("stream", "stream"): ["fp32-acc1-kept-noclip-scaler_none", "fp32-acc4-freed-clip-scaler_none",
                           "bf16-acc4-kept-clip-scaler_none", "fp32-acc1-freed-noclip-scaler_step"],
    ("device", "device"): ["fp32-acc4-kept-clip-scaler_unscale", "bf16-acc1-freed-noclip-scaler_none",
                           "fp32-acc4-freed-clip-scaler_unscale"],
    ("stream", "device"): ["bf16-acc4-freed-clip-scaler_none", "fp32-acc4-kept-clip-scaler_unscale"],
    ("host", "stream"): ["fp32-acc4-freed-clip-scaler_unscale", "bf16-acc4-kept-clip-scaler_none"],
    ("device", "host"): ["fp32-acc1-freed-noclip-scaler_step", "fp32-acc1-kept-noclip-scaler_none"],
}
ROWS = [(placed, C[name]) for placed, names in PLACED.items() for name in names]


#: CI runs each placement's first row (the others are slow)
FIRST_ROWS = {(placed, names[0]) for placed, names in PLACED.items()}


@pytest.mark.parametrize(("placed", "case"), [
    pytest.param(p, c, id=f"{'+'.join(p)}-{c.id}", marks=() if (p, c.id) in FIRST_ROWS else pytest.mark.slow)
    for p, c in ROWS])
def test_every_placement_is_bitwise_torch_fused(placed, case) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parity.run_case(case, update_on=placed, stream_chunk_bytes=CHUNK)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ the ring, and where gradients go


class Blocks(nn.Module):
    """About 1.2 M parameters: with 1 MiB ring buffers every weight spans several chunks."""

    def __init__(self, width: int = 192, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _blocks_groups(model: Blocks, placements: tuple[str, str], amsgrad: bool) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "update_on": placements[0], "amsgrad": amsgrad},
            {"params": biases, "update_on": placements[1], "weight_decay": 0.0, "lr": 3e-3}]


def _train_against_torch(dtype: torch.dtype, placements: tuple[str, str], *, amsgrad: bool = False, steps: int = 3,
                         **options) -> OffloadAdamW:
    torch.manual_seed(0)
    model = Blocks().to(dtype)
    reference = copy.deepcopy(model)
    copies = {p: nn.Parameter(p.detach().float()) for p in reference.parameters()}
    theirs = torch.optim.AdamW([{**g, "params": [copies[p] for p in g["params"]]}
                                for g in _blocks_groups(reference, ("host", "host"), amsgrad)], lr=1e-3, weight_decay=0.1,
                               fused=True)
    ours = OffloadAdamW(_blocks_groups(model, placements, amsgrad), lr=1e-3, weight_decay=0.1, **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 192, generator=gen).to(dtype)
        for net in (model, reference):
            net(x).float().square().mean().backward()
        for p in reference.parameters():
            copies[p].grad = p.grad.float()
        theirs.step()
        ours.step()
        # The state is whole in host memory when step() returns: read at once, in model order (the tensors backward
        # reached last, so streamed last).
        for p, q in zip(model.parameters(), reference.parameters()):
            assert same_bits(ours.state[p]["exp_avg_sq"], theirs.state[copies[q]]["exp_avg_sq"])
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(copies[p])
        for p in model.parameters():
            on_host = p in set(ours.param_groups[0]["params"]) and placements[0] == "host" or \
                p in set(ours.param_groups[1]["params"]) and placements[1] == "host"
            assert p.grad is not None and (is_host_resident(p.grad) == (on_host and ours.offload_gradients))
        ours.zero_grad()
        reference.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert same_bits(p.detach(), q.detach())
        mine, torchs = ours.state[p], theirs.state[copies[q]]
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in torchs:
                assert same_bits(mine[key], torchs[key]), key
        assert same_bits(ours.master_value(p), copies[q].detach())
    return ours


@pytest.mark.parametrize("buffers", [2, 3])
@pytest.mark.parametrize(("dtype", "amsgrad"), [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-amsgrad"])
def test_the_ring_streams_tensors_of_many_chunks_bitwise(dtype, amsgrad, buffers) -> None:
    ours = _train_against_torch(dtype, ("stream", "stream"), amsgrad=amsgrad, stream_chunk_bytes=CHUNK,
                                stream_buffers=buffers)
    assert ours.device_buffer_bytes() == buffers * CHUNK
    assert "gradients" not in ours.host_buffer_bytes(), "a streamed group's gradient reached a host buffer"


@pytest.mark.parametrize("freed", [False, True], ids=["kept", "freed"])
def test_a_mix_keeps_host_groups_freed_and_the_others_on_the_device(freed) -> None:
    ours = _train_against_torch(torch.bfloat16, ("device", "host"), offload_gradients=freed, stream_chunk_bytes=CHUNK)
    weights = sum(p.numel() for p in ours.param_groups[0]["params"])
    state_bytes = 12 * weights  # master, exp_avg and exp_avg_sq in float32
    assert ours.device_buffer_bytes() == state_bytes + CHUNK // 4096 * 4096
    biases = ours.param_groups[1]["params"]
    assert ours.host_buffer_bytes().get("gradients", 0) == sum(p.numel() * p.element_size() for p in biases)


def test_every_placement_gives_the_host_placements_bits_edits_included() -> None:
    """bf16 host parameters edited between steps through .data (no version counter moves): the host kernel takes the
    edits over at the next update (kernels/edits.py), and so does every placement with the CPU as device."""
    results = []
    for placed in [("host", "host"), ("stream", "stream"), ("device", "stream"), ("host", "device")]:
        torch.manual_seed(0)
        model = Blocks(width=64, blocks=2).to(torch.bfloat16)
        opt = OffloadAdamW(_blocks_groups(model, placed, True), lr=1e-2, transfer_pipeline=True, stream_chunk_bytes=CHUNK)
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            model(torch.randn(8, 64, generator=gen).to(torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                model.blocks[0][0].weight.data[::3].mul_(0.5)
                model.blocks[1][2].bias.data.fill_(0.25)
        results.append([t.clone() for p in model.parameters() for t in (p.detach(), opt.master_value(p))])
    for other in results[1:]:
        assert all(same_bits(a, b) for a, b in zip(results[0], other))


# ------------------------------------------------------------------ state_dict, resume, placement changes


def _run(placed: tuple[str, str], steps: int, model: Blocks | None = None, opt: OffloadAdamW | None = None,
         seed: int = 1) -> tuple[Blocks, OffloadAdamW]:
    if model is None:
        torch.manual_seed(0)
        model = Blocks(width=64, blocks=2).to(torch.bfloat16)
    if opt is None:
        opt = OffloadAdamW(_blocks_groups(model, placed, False), lr=1e-2, transfer_pipeline=True, stream_chunk_bytes=CHUNK)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, 64, generator=gen).to(torch.bfloat16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _same_state_dicts(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid, entry in a["state"].items():
        assert entry.keys() == b["state"][pid].keys()
        for key, value in entry.items():
            assert value.device == b["state"][pid][key].device and same_bits(value, b["state"][pid][key]), (pid, key)


def test_the_state_dict_is_the_same_whatever_the_placement() -> None:
    host = _run(("host", "host"), 3)[1].state_dict()
    assert all("update_on" not in g for g in host["param_groups"])
    for placed in [("stream", "device"), ("device", "device"), ("stream", "host")]:
        _same_state_dicts(host, _run(placed, 3)[1].state_dict())


@pytest.mark.parametrize("to", [("device", "stream"), ("stream", "stream"), ("host", "device")])
def test_a_resume_may_change_placement(to) -> None:
    model, opt = _run(("stream", "host"), 2)
    saved = copy.deepcopy(opt.state_dict())
    resumed_model = copy.deepcopy(model)
    resumed = OffloadAdamW(_blocks_groups(resumed_model, to, False), lr=1e-2, transfer_pipeline=True,
                           stream_chunk_bytes=CHUNK)
    resumed.load_state_dict(saved)
    assert [g["update_on"] for g in resumed.param_groups] == list(to), "the load took the saved placement"
    _run(("stream", "host"), 3, model, opt, seed=2)
    _run(to, 3, resumed_model, resumed, seed=2)
    _same_state_dicts(opt.state_dict(), resumed.state_dict())
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))


def test_a_checkpoint_resumes_in_another_placement(tmp_path) -> None:
    model, opt = _run(("device", "device"), 2)
    path = checkpoint.save(tmp_path / "ckpt", model, opt, step=2)
    torch.manual_seed(5)
    other_model = Blocks(width=64, blocks=2).to(torch.bfloat16)
    other = OffloadAdamW(_blocks_groups(other_model, ("stream", "host"), False), lr=1e-2, transfer_pipeline=True,
                         stream_chunk_bytes=CHUNK)
    report = checkpoint.load(path, other_model, other)
    assert report.optimizer_restored and not report.problems
    _run(("device", "device"), 2, model, opt, seed=3)
    _run(("stream", "host"), 2, other_model, other, seed=3)
    _same_state_dicts(opt.state_dict(), other.state_dict())


def test_a_placement_changed_between_steps_moves_the_state_and_keeps_the_bits() -> None:
    torch.manual_seed(0)
    model = Blocks(width=64, blocks=2)
    reference = copy.deepcopy(model)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    ours = OffloadAdamW(model.parameters(), lr=1e-2, transfer_pipeline=True, stream_chunk_bytes=CHUNK)
    gen = torch.Generator().manual_seed(1)
    for placement in ["host", "device", "stream", "host", "stream", "device"]:
        ours.param_groups[0]["update_on"] = placement
        x = torch.randn(8, 64, generator=gen)
        for net in (model, reference):
            net(x).square().mean().backward()
        ours.step()
        theirs.step()
        ours.zero_grad()
        reference.zero_grad()
        state_bytes = sum(v.numel() * v.element_size() for s in ours.state.values() for k, v in s.items() if k != "step")
        buffers = ours.transfer_pipeline.placements.device_buffer_bytes()  # the ring and widening buffers, once made
        assert ours.device_buffer_bytes() - buffers == (state_bytes if placement == "device" else 0), placement
    for p, q in zip(model.parameters(), reference.parameters()):
        assert same_bits(p, q) and same_bits(ours.state[p]["exp_avg_sq"], theirs.state[q]["exp_avg_sq"])


def test_misplaced_sees_any_state_tensor_of_the_parameters_shape_away_from_its_home() -> None:
    """The pre-flight asks misplaced() of every state at every step, the cheap questions first (is_cpu, then the
    shape): the step count and a tensor of another shape are not the parameter's state; any other is."""
    from offload_adamw.optim.placement import misplaced, shared_home

    host, meta = torch.device("cpu"), torch.device("meta")
    local = torch.zeros(4, 2)
    state = {"step": torch.zeros((), device=meta), "exp_avg": torch.zeros(4, 2), "other": torch.zeros(3, device=meta)}
    assert not misplaced(state, local, host, False)
    assert shared_home("host", pin_default=False) == (host, False) and shared_home("stream", pin_default=False) is None
    assert not misplaced(state, local, *shared_home("host", pin_default=False))
    state["exp_avg_sq"] = torch.zeros(4, 2, device=meta)  # one state tensor away from host memory
    assert misplaced(state, local, host, False) and misplaced(state, local, *shared_home("host", pin_default=False))
    assert misplaced({"exp_avg": torch.zeros(4, 2)}, local, meta, False)  # a home off the host: a host tensor is away
    assert not misplaced({"exp_avg": torch.zeros(4, 2, device=meta)}, local, meta, False)


def test_a_host_gradient_freed_for_the_old_placement_refuses_a_change_before_step() -> None:
    """With offload_gradients a host group's gradient left the device in backward: moving the group off the host before
    step() is refused, naming it, and nothing changes; a device gradient (kept) serves any placement."""
    torch.manual_seed(0)
    model = Blocks(width=64, blocks=2).to(torch.bfloat16)
    opt = OffloadAdamW(_blocks_groups(model, ("host", "stream"), False), lr=1e-2, offload_gradients=True,
                       stream_chunk_bytes=CHUNK)
    _run(("host", "stream"), 1, model, opt)
    model(torch.randn(8, 64).to(torch.bfloat16)).float().square().mean().backward()
    before = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["update_on"] = "stream"
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['update_on'\] changed from 'host' to 'stream' while"):
        opt.step()
    _same_state_dicts(before, opt.state_dict())
    assert all(same_bits(a, p) for a, p in zip(weights, model.parameters()))
    opt.param_groups[0]["update_on"] = "host"
    opt.param_groups[1]["update_on"] = "device"  # its gradient is on the device: the change is taken now
    opt.step()
    assert opt.device_buffer_bytes() > 2 * CHUNK


# ------------------------------------------------------------------ refusals


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))]


BAD = {
    "constructor": (lambda: OffloadAdamW(_params(), update_on="gpu"), ValueError,
                    r"OffloadAdamW\(update_on=\.\.\.\): update_on must be one of \('host', 'stream', 'device'\), got 'gpu'"),
    "group": (lambda: OffloadAdamW([{"params": _params()[:1]}, {"params": _params()[1:], "update_on": "Stream"}]),
              ValueError, r"param_groups\[1\]: update_on must be one of .* got 'Stream'"),
    "not a string": (lambda: OffloadAdamW(_params(), update_on=None), ValueError, "got None"),
    "chunk too small": (lambda: OffloadAdamW(_params(), stream_chunk_bytes=4096),
                        ValueError, "stream_chunk_bytes must be an int of at least 1 MiB"),
    "four buffers": (lambda: OffloadAdamW(_params(), stream_buffers=4), ValueError, "stream_buffers must be 2 or 3"),
    "buffers as bool": (lambda: OffloadAdamW(_params(), stream_buffers=True), ValueError, "stream_buffers must be 2 or 3"),
    "no pipeline": (lambda: OffloadAdamW(_params(), update_on="device", transfer_pipeline=False),
                    ValueError, r"param_groups\[0\] has update_on='device'.*transfer_pipeline=True"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_placement_options_are_refused_by_name(name) -> None:
    build, error, message = BAD[name]
    with pytest.raises(error, match=message):
        build()


def test_a_group_added_off_the_host_without_a_pipeline_or_with_a_typo_is_refused_and_not_added() -> None:
    opt = OffloadAdamW(_params())
    assert opt.transfer_pipeline is None
    with pytest.raises(ValueError, match=r"param_groups\[1\] has update_on='stream'"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "update_on": "stream"})
    with pytest.raises(ValueError, match=r"param_groups\[1\]: update_on must be one of"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "update_on": "hots"})
    assert len(opt.param_groups) == 1
    placed = OffloadAdamW(_params(), update_on="stream")
    placed.add_param_group({"params": [nn.Parameter(torch.randn(3))]})
    assert [g["update_on"] for g in placed.param_groups] == ["stream", "stream"], "the constructor's placement"
    assert "update_on" not in placed.defaults, "defaults stay torch's"


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "plain-step"])
def test_a_typo_between_steps_fails_the_next_step_before_any_update(pipeline) -> None:
    params = _params()
    opt = OffloadAdamW([{"params": params[:1]}, {"params": params[1:]}], transfer_pipeline=pipeline)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    opt.param_groups[1]["update_on"] = "devcie"
    with pytest.raises(ValueError, match=r"param_groups\[1\]: update_on must be one of .* got 'devcie'"):
        opt.step()
    assert all(same_bits(a, p) for a, p in zip(before, params))
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)


def test_the_preflight_refuses_resident_state_that_does_not_fit(monkeypatch) -> None:
    """The CPU as device: a resident group's state is host memory, and the host pre-flight refuses it."""
    params = [nn.Parameter(torch.randn(512, 512).to(torch.bfloat16))]  # 3 MiB of state: master and moments
    opt = OffloadAdamW(params, update_on="device", stream_chunk_bytes=CHUNK)
    params[0].grad = torch.ones_like(params[0])
    before = params[0].detach().clone()
    monkeypatch.setenv("OFFLOAD_ADAMW_HOST_AVAILABLE_BYTES", str(2 * CHUNK))  # the widening buffer fits, the state not
    with pytest.raises(HostMemoryError, match=r"would allocate 3\.0 MiB \(3,145,732 bytes\) of host state"):
        opt.step()
    assert not opt.state.get(params[0]) and same_bits(before, params[0])


def test_the_preflight_refuses_a_ring_that_does_not_fit_before_any_update(monkeypatch) -> None:
    params = [nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(64))]
    opt = OffloadAdamW([{"params": params[:1], "update_on": "host"}, {"params": params[1:], "update_on": "stream"}],
                       transfer_pipeline=True, stream_chunk_bytes=CHUNK, stream_buffers=3)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    monkeypatch.setenv("OFFLOAD_ADAMW_HOST_AVAILABLE_BYTES", str(2 * CHUNK))
    with pytest.raises(MemoryError, match=f"would allocate {3 * CHUNK:,} bytes of host stream ring"):
        opt.step()
    assert all(same_bits(a, p) for a, p in zip(before, params)) and not any(opt.state.get(p) for p in params)
    monkeypatch.delenv("OFFLOAD_ADAMW_HOST_AVAILABLE_BYTES")
    opt.step()
    assert opt.device_buffer_bytes() == 3 * CHUNK


def test_misplaced_sees_a_state_tensor_in_pageable_memory_where_its_home_is_page_locked(simulated_device) -> None:
    """A pinned host home asks for page-locked memory: a state tensor in pageable host memory (a state dict loaded
    with pin_memory off, say) is misplaced there and nowhere else, and one page-locked by the device's backend is
    at home."""
    from offload_adamw.accel.host_memory import PageLocker, page_locked_empty_strided
    from offload_adamw.optim.placement import misplaced, shared_home

    local = torch.zeros(4, 2)
    locked = page_locked_empty_strided((4, 2), (2, 1), torch.float32, PageLocker(simulated_device, 1))
    pinned_home = shared_home("host", pin_default=True)
    assert pinned_home is not None
    assert misplaced({"exp_avg": torch.zeros(4, 2)}, local, *pinned_home)
    assert not misplaced({"exp_avg": torch.zeros(4, 2)}, local, torch.device("cpu"), False)
    assert not misplaced({"exp_avg": locked}, local, *pinned_home)
    assert not misplaced({"exp_avg": locked, "step": torch.zeros(())}, local, *pinned_home)  # the count: not state
