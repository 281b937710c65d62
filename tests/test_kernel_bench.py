"""The benchmark's plumbing (not its numbers): workload shapes, the bandwidth probe, the CLI end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_adamw import cli
from offload_adamw.benchmarking.bandwidth import measure_host_bandwidth
from offload_adamw.benchmarking.host_step import ALL_CASES
from offload_adamw.benchmarking.timing import rotations
from offload_adamw.benchmarking.workload import transformer_shapes
from offload_adamw.cli.bench import parse_size


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 2**31))
def test_transformer_shapes_sum_to_the_requested_size(total):
    shapes = transformer_shapes(total)
    assert sum(math.prod(s) for s in shapes) == total
    assert all(math.prod(s) > 0 for s in shapes)


def test_transformer_shapes_are_a_mix():
    shapes = transformer_shapes(16 * 2**20)
    assert len(shapes) > 30
    assert any(len(s) == 1 for s in shapes) and any(len(s) == 2 for s in shapes)
    assert any(math.prod(s) % 16 for s in shapes)  # some tensor has a ragged SIMD tail


@pytest.mark.parametrize("text,value", [("16M", 16 * 2**20), ("64K", 65536), ("1G", 2**30), ("1000", 1000), ("1.5M", 3 * 2**19)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["abc", "0", "-5M"])
def test_parse_size_rejects(text):
    with pytest.raises(Exception, match="size"):
        parse_size(text)


def test_bandwidth_probe_reports_gbps():
    result = measure_host_bandwidth(elements=2**20, repeats=2)
    for key in ("triad_gbps", "inplace_triad_gbps", "triad_gbps_median", "inplace_triad_gbps_median"):
        assert 0.1 < result[key] < 10_000, (key, result[key])
    assert result["triad_gbps"] >= result["triad_gbps_median"]
    assert result["bytes_per_array"] == 4 * 2**20


def test_bandwidth_probe_restores_thread_count():
    import torch

    before = torch.get_num_threads()
    measure_host_bandwidth(elements=2**16, repeats=1, threads=1)
    assert torch.get_num_threads() == before


def test_bench_cli_end_to_end(tmp_path, capsys):
    """The `offload-adamw bench` entry point, in process (a subprocess would spend its time importing torch)."""
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    cases = "ours-bf16,ours-fp32,torch-fused-fp32,torch-naive-bf16"
    status = cli.main(["bench", "--sizes", "64K", "--repeats", "3", "--warmup", "1", "--cases", cases,
                       "--bandwidth-elements", "1M", "--scaling-size", "64K", "--scaling-threads", "1,2",
                       "--mixes", "none", "--json", str(json_path), "--plot", str(png_path)])
    out = capsys.readouterr().out
    assert status == 0
    assert "targets:" in out and "in-place triad" in out and "thread scaling" in out
    assert not re.search(r"#\d", out), "no issue numbers in the output"
    result = json.loads(json_path.read_text())
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (size,) = result["sizes"]
    assert size["elements"] == 65536 and set(size["cases"]) == set(cases.split(","))
    for row in size["cases"].values():
        assert len(row["ms_all"]) == 3 and row["ms_min"] <= row["ms_per_step"] <= row["ms_max"]
        assert row["effective_gbps"] == pytest.approx(28 * 65536 / (row["ms_per_step"] / 1e3) / 1e9)
        assert row["step_extra_mib"] is None or row["step_extra_mib"] >= 0
    scaling = result["thread_scaling"]
    assert scaling["threads"] == [1, 2]
    assert set(scaling["cases"]) == {"ours-bf16", "torch-fused-fp32", "torch-naive-bf16", "inplace-triad"}
    assert result["parity"]["bitwise_equal"], result["parity"]
    targets = {t["target"] for t in result["targets"]}
    assert any("torch fused float32" in t for t in targets) and any("naive" in t for t in targets)


def test_rotations_give_every_case_every_position():
    orders = rotations(["a", "b", "c"], 6)
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for position in range(3):
        assert {order[position] for order in orders} == {"a", "b", "c"}


def test_the_naive_path_is_preallocated_and_deepspeed_is_skipped_with_a_reason():
    """The naive case allocates no full-size gradient per step (its peak extra memory is small), and
    a DeepSpeed case that cannot run here is absent with its reason, not silently dropped."""
    import torch

    from offload_adamw.benchmarking.host_step import build_cases
    from offload_adamw.benchmarking.timing import measure_step
    from offload_adamw.benchmarking.workload import make_workload

    w = make_workload(4 * 2**20)
    info = {"deepspeed_unavailable": "ModuleNotFoundError: No module named 'deepspeed'"}
    cases = build_cases(w, ("torch-naive-bf16", "deepspeed-fp32"), info)
    assert "deepspeed-fp32" not in cases and "deepspeed" in info["skipped"]["deepspeed-fp32"]
    cases["torch-naive-bf16"]()
    _, extra = measure_step(cases["torch-naive-bf16"])
    if extra is not None:
        assert extra < 4 * w.elements / 4  # a fresh float32 gradient would be 4 bytes per element
    assert torch.get_num_threads() >= 1


def test_bench_cli_rejects_an_unknown_case(capsys):
    assert cli.main(["bench", "--cases", "nope"]) == 2  # a usage error, like every other
    err = capsys.readouterr().err
    assert "nope" in err and ALL_CASES[0] in err and len(err.strip().splitlines()) == 1


def test_bench_script_is_the_same_command(capsys):
    """benchmarks/step_bench.py parses the same options and runs the same code."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "step_bench.py"
    spec = importlib.util.spec_from_file_location("step_bench", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--sizes", "--repeats", "--json", "--plot", "--quick", "--cases"):
        assert option in out
    assert module.bench_cli is importlib.import_module("offload_adamw.cli.bench")


def test_bitwise_comparison_sees_signed_zeros_and_nans_and_counts_elements():
    import torch

    from offload_adamw.benchmarking.bitwise import differing_elements, max_abs_difference, same_bits

    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        a = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=dtype)
        b = a.clone()
        assert same_bits(a, b) and differing_elements(a, b) == 0
        b[0] = -0.0  # equal as numbers, not as bits
        assert not same_bits(a, b) and differing_elements(a, b) == 1
        assert max_abs_difference(a[:2], b[:2]) == 0.0 and max_abs_difference(a[1:2], a[3:]) == 1.0
        assert not same_bits(a, a.to(torch.float32 if dtype != torch.float32 else torch.float64))
    wide = torch.arange(12.0).reshape(3, 4)
    assert same_bits(wide.t(), wide.t().contiguous())  # compared by value, whatever the layout
    with pytest.raises(ValueError, match="cannot compare"):
        differing_elements(wide, wide.t())


def test_the_llama_layer_mix_is_thirty_tensors_of_a_llama_layers_shapes():
    from offload_adamw.benchmarking.workload import MIXES, llama_layer_mix

    shapes = llama_layer_mix()
    assert MIXES["llama-layers"] == shapes and len(shapes) == 30
    assert sum(math.prod(s) for s in shapes) == 50_512_896  # 50.5 M elements
    assert set(shapes) == {(4096, 4096), (1024, 4096), (11008,), (4096,)}
    assert sum(len(s) == 1 for s in shapes) == 24  # most tensors are small vectors ...
    assert sum(math.prod(s) for s in shapes if len(s) == 2) > 0.99 * 50_512_896  # ... most elements are in matrices


def test_the_host_model_and_staging_cases_compute_the_parity_bits():
    """One step of each, from the workload's state: the bits of torch's fused step on float32 copies, then
    the round-to-nearest copy (the host model into its parameters, the staging case into the staging buffers)."""
    import torch

    from configs import assert_bitwise_equal
    from offload_adamw.benchmarking.host_step import HOST_MODEL, STAGING, build_cases
    from offload_adamw.benchmarking.workload import HYPER, make_workload

    shapes = [(64, 48), (1001,), (4096,)]
    ref = make_workload(0, seed=3, shapes=shapes)
    params = [torch.nn.Parameter(m.clone()) for m in ref.master]
    opt = torch.optim.AdamW(params, **HYPER, fused=True)
    for p, g in zip(params, ref.grad16):
        p.grad = g.float()
    opt.step()
    want = [p.detach().to(torch.bfloat16) for p in params]
    for name in (HOST_MODEL, STAGING):
        w = make_workload(0, seed=3, shapes=shapes)
        cases = build_cases(w, (name,), {})
        before = [m.clone() for m in w.model16]
        cases[name]()
        if name == STAGING:  # the staging buffers (the workload's bf16 copy) receive round(master)
            got = w.model16
        else:  # the host model updates its own parameters; the shared copy is left alone
            assert all(torch.equal(a, b) for a, b in zip(before, w.model16))
            opt_step = cases[name]
            got = [p.detach() for p in opt_step.__self__.param_groups[0]["params"]]
        assert_bitwise_equal(got, want, name)


def test_bench_cli_times_a_named_mix_like_a_size(tmp_path, capsys, monkeypatch):
    from offload_adamw.benchmarking import workload

    monkeypatch.setitem(workload.MIXES, "tiny-layers", [(256, 64), (64, 64), (11008,), (4096,), (4096,)])
    json_path = tmp_path / "bench.json"
    cases = "ours-bf16,ours-bf16-host-model,ours-bf16-staging,torch-fused-fp32"
    status = cli.main(["bench", "--sizes", "64K", "--repeats", "2", "--warmup", "1", "--cases", cases,
                       "--bandwidth-elements", "1M", "--scaling-size", "none", "--mixes", "tiny-layers",
                       "--json", str(json_path)])
    out = capsys.readouterr().out
    assert status == 0
    result = json.loads(json_path.read_text())
    plain, mix = result["sizes"]
    assert plain["mix"] is None and mix["mix"] == "tiny-layers" and mix["tensors"] == 5
    assert mix["elements"] == 256 * 64 + 64 * 64 + 11008 + 2 * 4096 and set(mix["cases"]) == set(cases.split(","))
    assert "tiny-layers mix" in out
    assert any(t["mix"] == "tiny-layers" and "torch fused float32" in t["target"] for t in result["targets"])
    assert cli.main(["bench", "--mixes", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize("argv, mixes", [
    ([], ("llama-layers",)),  # the default run times the mix beside the default sizes
    (["--sizes", "64K"], ()),  # chosen sizes: only those
    (["--quick"], ()),  # a smoke run
    (["--sizes", "64K", "--mixes", "llama-layers"], ("llama-layers",)),
    (["--mixes", "none"], ()),
])
def test_which_mixes_a_run_times(argv, mixes):
    import argparse

    from offload_adamw.cli.bench import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(argv))
    assert config.mixes == mixes
    assert config.sizes == ((16 * 2**20, 64 * 2**20, 256 * 2**20) if "--sizes" not in argv and "--quick" not in argv
                            else config.sizes)
