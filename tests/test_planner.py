"""The planner's arithmetic against docs/contract.md#memory-bill and the cited activation formula, and the CLI.

Expected values are written out from the contract's per-element bills and the
formula's terms, not taken from the planner.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_adamw import cli
from offload_adamw.cli.plan import measured_host_bandwidth, parse_count
from offload_adamw.planning import models, planner
from offload_adamw.planning.models import PRESETS, ModelConfig, ParamCountModel, ParamSpec, model_from_hf_config
from offload_adamw.planning.planner import (
    GB,
    HardwareConfig,
    TrainingConfig,
    activation_bytes,
    fsdp_rank_host_bytes,
    plan,
    predict_host_optimizer_bytes,
)

ONE_GPU = HardwareConfig(gpus_per_node=1, nodes=1)
SMALL = ModelConfig(
    name="small", hidden_size=64, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
)

# (dtype, bytes of param + grad + master + m + v per element): docs/contract.md#memory-bill
CONTRACT_BILLS = [("bfloat16", 2 + 2 + 4 + 4 + 4), ("float16", 2 + 2 + 4 + 4 + 4), ("float32", 4 + 4 + 0 + 4 + 4)]


# ----------------------------------------------------------------------------- host-state prediction


@pytest.mark.parametrize(
    "spec, amsgrad, expected",
    [
        # step 4 + (master, m, v) * 4 bytes * 12 elements
        (ParamSpec(name="w", shape=(3, 4), dtype="bfloat16"), False, 4 + 3 * 4 * 12),
        (ParamSpec(name="w", shape=(3, 4), dtype="bfloat16"), True, 4 + 4 * 4 * 12),
        # an fp32 host tensor is its own master: m, v only
        (ParamSpec(name="w", shape=(3, 4), dtype="float32", on_host=True), False, 4 + 2 * 4 * 12),
        (ParamSpec(name="w", shape=(3, 4), dtype="float32", on_host=True), True, 4 + 3 * 4 * 12),
        # an fp32 GPU tensor gets a host master
        (ParamSpec(name="w", shape=(3, 4), dtype="float32", on_host=False), False, 4 + 3 * 4 * 12),
        # float64 state for float64 parameters
        (ParamSpec(name="w", shape=(5,), dtype="torch.float64", on_host=True), False, 4 + 2 * 8 * 5),
        # bf16 on the host still needs a master; a 0-dim tensor has one element
        (ParamSpec(name="s", shape=(), dtype="bf16", on_host=True), False, 4 + 3 * 4 * 1),
        (ParamSpec(name="e", shape=(0, 7), dtype="float16"), False, 4),
    ],
)
def test_predict_host_optimizer_bytes_by_hand(spec, amsgrad, expected):
    assert predict_host_optimizer_bytes([spec], amsgrad=amsgrad) == expected


@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 9), max_size=3), st.sampled_from(["bf16", "fp16", "fp32"]), st.booleans()), max_size=6
    ),
    st.booleans(),
)
def test_predict_host_bytes_is_additive(items, amsgrad):
    specs = [ParamSpec(name=str(i), shape=tuple(s), dtype=d, on_host=h) for i, (s, d, h) in enumerate(items)]
    whole = predict_host_optimizer_bytes(specs, amsgrad=amsgrad)
    assert whole == sum(predict_host_optimizer_bytes([s], amsgrad=amsgrad) for s in specs)
    assert whole >= 4 * len(specs)


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="int8"):
        predict_host_optimizer_bytes([ParamSpec(name="w", shape=(2,), dtype="int8")])


# ----------------------------------------------------------------------------- bills per strategy


@pytest.mark.parametrize("dtype, per_element", CONTRACT_BILLS)
@pytest.mark.parametrize("model", [PRESETS["llama-2-7b"], PRESETS["llama-3-8b"], SMALL], ids=lambda m: m.name)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_unsharded_bill_is_the_contract_bill(model, dtype, per_element, amsgrad):
    result = plan(model, ONE_GPU, TrainingConfig(param_dtype=dtype, amsgrad=amsgrad))
    n = model.num_parameters()
    gpu = result.strategy("single-gpu").gpu
    state = gpu.parameters + gpu.gradients + gpu.master + gpu.exp_avg + gpu.exp_avg_sq + gpu.max_exp_avg_sq
    assert state == (per_element + (4 if amsgrad else 0)) * n
    alone = planner.memory_bill(n, param_dtype=dtype, amsgrad=amsgrad)
    assert alone.total == state and replace(gpu, activations=0, reserved=0) == alone
    # DDP adds exactly one gradient copy (its buckets)
    assert result.strategy("ddp").gpu.total - gpu.total == (4 if dtype == "float32" else 2) * n


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_gpu_offload_traffic_is_the_contract_single_pass(dtype):
    # world 1: the shard is the whole model, so traffic is per element times n
    n = SMALL.num_parameters()
    p = models.dtype_bytes(dtype)
    result = plan(SMALL, ONE_GPU, TrainingConfig(param_dtype=dtype))
    s = result.strategy("fsdp+offload-adamw")
    assert (s.pcie_d2h_bytes, s.pcie_h2d_bytes) == (p * n, p * n)
    # gradient DMA in + 28-byte single-pass update + parameter DMA out
    assert s.host_memory_traffic_bytes == (p + 28 + p) * n
    # host: master, m, v (fp32) + gradient landing buffers + staging copies sent back + one step count per tensor
    n_tensors = len(SMALL.parameter_shapes())
    assert s.host.total - s.host.reserved == 12 * n + p * n + p * n + 4 * n_tensors
    assert s.host_per_rank is not None and s.host.total - s.host.reserved == s.host_per_rank.total
    bound = max(p * n / ONE_GPU.pcie_bytes_per_s, (2 * p + 28) * n / ONE_GPU.host_memory_bytes_per_s)
    assert s.step_time_lower_bound_s == pytest.approx(bound, rel=1e-12)
    gpu_step = result.strategy("fsdp")
    assert gpu_step.gpu_memory_traffic_bytes == 28 * n and gpu_step.pcie_h2d_bytes == 0


def test_offload_adamw_host_bill_equals_the_prediction_for_the_shards():
    hardware = HardwareConfig(gpus_per_node=4, nodes=2)
    result = plan(SMALL, hardware, TrainingConfig())
    shards = [
        ParamSpec(name=name, shape=(math.ceil(shape[0] / 8), *shape[1:]), dtype="bfloat16")
        for name, shape in SMALL.parameter_shapes()
    ]
    host = result.strategy("fsdp+offload-adamw").host
    state = host.master + host.exp_avg + host.exp_avg_sq + host.step_counts
    assert state == 4 * predict_host_optimizer_bytes(shards)  # four ranks per node


@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_every_host_placement_bills_per_rank_what_fsdp_rank_host_bytes_says(accumulation, amsgrad):
    # The strategies with every group on the host are priced through the placement model; what they bill per
    # rank must be what one rank's OffloadAdamW allocates (fsdp_rank_host_bytes, measured in test_integrations_fsdp).
    hardware = HardwareConfig(gpus_per_node=4, nodes=1)
    result = plan(SMALL, hardware, TrainingConfig(grad_accumulation=accumulation, amsgrad=amsgrad))
    full = [shape for _, shape in SMALL.parameter_shapes()]
    for name, host_accumulation in (("fsdp+offload-adamw", False),
                                    ("fsdp+offload-adamw+offload-grads", accumulation > 1)):
        s = result.strategy(name)
        expected = fsdp_rank_host_bytes(full, world=4, amsgrad=amsgrad, host_accumulation=host_accumulation)
        assert s.host_per_rank == expected, name
        assert s.host.total - s.host.reserved == 4 * expected.total, name


def test_accumulation_costs_offload_grads_traffic_but_not_plain_offload():
    one = plan(SMALL, ONE_GPU, TrainingConfig(grad_accumulation=1))
    four = plan(SMALL, ONE_GPU, TrainingConfig(grad_accumulation=4))
    n = SMALL.num_parameters()
    assert four.strategy("fsdp+offload-adamw").pcie_d2h_bytes == one.strategy("fsdp+offload-adamw").pcie_d2h_bytes
    assert four.strategy("fsdp+offload-adamw+offload-grads").pcie_d2h_bytes == 4 * 2 * n
    extra = four.strategy("fsdp+offload-adamw+offload-grads").host_memory_traffic_bytes
    extra -= one.strategy("fsdp+offload-adamw+offload-grads").host_memory_traffic_bytes
    assert extra == 3 * 4 * 2 * n  # 3 extra micro-batches, 4 passes over 2-byte gradients


SHARDED = ["fsdp", "fsdp+offload-adamw", "fsdp+offload-adamw+offload-grads", "fsdp+streamed-state", "fsdp+cpu-offload"]


@settings(max_examples=25, deadline=None)
@given(
    per_node=st.integers(1, 16), nodes=st.integers(1, 8),
    dtype=st.sampled_from(["bfloat16", "float32"]), amsgrad=st.booleans(),
)
def test_sharding_laws(per_node, nodes, dtype, amsgrad):
    training = TrainingConfig(param_dtype=dtype, amsgrad=amsgrad)
    small = plan(SMALL, HardwareConfig(gpus_per_node=per_node, nodes=nodes), training)
    double = plan(SMALL, HardwareConfig(gpus_per_node=per_node, nodes=2 * nodes), training)
    n = SMALL.num_parameters()
    world = per_node * nodes
    for name in SHARDED:
        a, b = small.strategy(name), double.strategy(name)
        # twice the nodes never costs a GPU or a node more memory or traffic
        assert b.gpu.total <= a.gpu.total and b.host.total <= a.host.total
        assert b.pcie_h2d_bytes <= a.pcie_h2d_bytes and b.host_memory_traffic_bytes <= a.host_memory_traffic_bytes
    # all ranks together hold at least the whole state, and at most one padded row per tensor more
    fsdp = small.strategy("fsdp").gpu
    per_element = dict(CONTRACT_BILLS)[dtype] + (4 if amsgrad else 0)
    held = world * (fsdp.parameters + fsdp.gradients + fsdp.master + fsdp.exp_avg + fsdp.exp_avg_sq + fsdp.max_exp_avg_sq)
    padding = sum(math.prod(s[1:]) for _, s in SMALL.parameter_shapes()) * world
    assert per_element * n <= held <= per_element * (n + padding)


# ----------------------------------------------------------------------------- activations


def test_activation_formula_terms():
    s, b, h, a, layers, v = 16, 2, 64, 4, 3, 1000
    sbh = s * b * h
    full = TrainingConfig(seq_len=s, micro_batch=b, activation_checkpointing=False, flash_attention=False)
    # Korthikanti et al. 2022: sbh(34 + 5as/h) per layer; outside: 4sbh + 4sbv
    assert activation_bytes(SMALL, full) == layers * (34 * sbh + 5 * a * s * s * b) + 4 * sbh + 4 * s * b * v
    flash = TrainingConfig(seq_len=s, micro_batch=b, activation_checkpointing=False, flash_attention=True)
    assert activation_bytes(SMALL, flash) == layers * 34 * sbh + 4 * sbh + 4 * s * b * v
    ckpt = TrainingConfig(seq_len=s, micro_batch=b, activation_checkpointing=True, flash_attention=True)
    assert activation_bytes(SMALL, ckpt) == layers * 2 * sbh + 34 * sbh + 4 * sbh + 4 * s * b * v
    assert activation_bytes(ParamCountModel(name="n", params=10**9), full) == 0


@given(seq=st.integers(1, 8192), batch=st.integers(1, 8))
def test_activations_order(seq, batch):
    model = PRESETS["llama-2-13b"]
    kwargs = dict(seq_len=seq, micro_batch=batch)
    eager = activation_bytes(model, TrainingConfig(**kwargs, activation_checkpointing=False, flash_attention=False))
    flash = activation_bytes(model, TrainingConfig(**kwargs, activation_checkpointing=False, flash_attention=True))
    ckpt = activation_bytes(model, TrainingConfig(**kwargs, activation_checkpointing=True, flash_attention=True))
    assert ckpt < flash <= eager


# ----------------------------------------------------------------------------- recommendation


def test_70b_on_8x80gb():
    result = plan(PRESETS["llama-3-70b"], HardwareConfig(), TrainingConfig())
    fitting = [s for s in result.strategies if s.fits and s.name != "single-gpu" and not s.comparison]
    # 16 bytes/element of 70.6e9 elements over 8 GPUs is 141 GB: GPU-resident strategies cannot fit in 80 GB
    for name in ("single-gpu", "ddp", "fsdp"):
        assert result.strategy(name).gpu_margin < 0
    assert result.recommendation in {s.name for s in fitting}
    best = min(s.step_time_lower_bound_s for s in fitting)
    assert result.strategy(result.recommendation).step_time_lower_bound_s <= best * 1.05
    assert result.recommendation in result.reason and "fsdp (" in result.reason


def test_70b_is_told_the_mix_of_placements_and_the_param_groups_to_pass(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # wide enough that no strategy name is wrapped
    result = plan(PRESETS["llama-3-70b"], HardwareConfig(), TrainingConfig())
    streamed, mixed = result.strategy("fsdp+streamed-state"), result.strategy(planner.MIX)
    host = result.strategy("fsdp+offload-adamw+offload-grads")
    assert streamed.fits and not streamed.comparison and mixed.fits and not mixed.comparison
    # some groups resident, the rest streamed: below every single placement's bound, within the GPU
    assert mixed.mix.count("device") > 0 and mixed.mix.count("stream") > 0
    assert mixed.step_time_lower_bound_s < streamed.step_time_lower_bound_s < host.step_time_lower_bound_s
    assert mixed.gpu.total <= 80 * GB and result.recommendation == planner.MIX
    assert cli.main(["plan", "--preset", "llama-3-70b"]) == 0
    out = capsys.readouterr().out
    assert "fsdp+cpu-offload (comparison)" in out and "fsdp+streamed-state (comparison)" not in out
    assert f"Recommendation: {planner.MIX}" in out and "Chosen mix of the 83 groups: " in out
    assert f"bound {mixed.step_time_lower_bound_s:.2f} s" in out and f"{host.step_time_lower_bound_s:.2f} s" in out
    assert "rules = [" in out and 'default = {"update_on": "stream"}' in out
    assert "named_param_groups(model, rules, default=default)" in out
    assert "OffloadAdamWTrainer(model=model, args=args, param_group_rules=rules, param_group_default=default" in out


@settings(max_examples=40, deadline=None)
@given(
    preset=st.sampled_from(sorted(PRESETS)), per_node=st.integers(1, 8), nodes=st.integers(1, 4),
    host_gb=st.sampled_from([128, 512, 2000, 8000]), gpu_gb=st.sampled_from([24, 80, 141]),
)
def test_a_comparison_is_never_recommended(preset, per_node, nodes, host_gb, gpu_gb):
    hardware = HardwareConfig(gpus_per_node=per_node, nodes=nodes, host_memory_bytes=host_gb * GB,
                              gpu_memory_bytes=gpu_gb * GB)
    result = plan(PRESETS[preset], hardware, TrainingConfig())
    assert {s.name for s in result.strategies if s.comparison} == set(planner.COMPARISONS)
    if result.recommendation is not None:
        assert result.recommendation not in planner.COMPARISONS
        assert result.strategy(result.recommendation).fits
    else:
        usable = [s for s in result.strategies if not s.comparison and (s.name != "single-gpu" or per_node * nodes == 1)]
        assert not any(s.fits for s in usable)


def test_small_model_stays_on_the_gpu():
    result = plan(PRESETS["llama-2-7b"], HardwareConfig(), TrainingConfig())
    assert result.recommendation in ("fsdp", "ddp")
    assert result.strategy(result.recommendation).bottleneck == "gpu memory"


def test_nothing_fits_names_the_closest():
    result = plan(PRESETS["llama-3.1-405b"], HardwareConfig(gpus_per_node=1, host_memory_bytes=256 * GB), TrainingConfig())
    assert result.recommendation is None
    assert result.reason.startswith("nothing fits; the closest is")


def test_host_too_small_rules_out_offload():
    result = plan(PRESETS["llama-3-70b"], HardwareConfig(host_memory_bytes=512 * GB), TrainingConfig())
    for name in ("fsdp+offload-adamw", "fsdp+streamed-state", "fsdp+cpu-offload"):
        assert result.strategy(name).host_margin < 0 and not result.strategy(name).fits


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: HardwareConfig(nodes=0), "nodes"),
        (lambda: HardwareConfig(pcie_bytes_per_s=0), "pcie_bytes_per_s"),
        (lambda: TrainingConfig(seq_len=0), "seq_len"),
        (lambda: TrainingConfig(param_dtype="float64"), "float64"),
        (lambda: ModelConfig(name="x", hidden_size=10, intermediate_size=1, num_hidden_layers=1,
                             num_attention_heads=3, num_key_value_heads=1, vocab_size=1), "divisible"),
        (lambda: ParamCountModel(name="x", params=0), "params"),
    ],
)
def test_bad_configs_name_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----------------------------------------------------------------------------- config.json errors


def test_hf_config_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"config\.json: missing 'intermediate_size', 'num_attention_heads', 'vocab_size'"):
        model_from_hf_config(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        model_from_hf_config(path)


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    "text, value", [("7e9", 7 * 10**9), ("70B", 70 * 10**9), ("6.7b", 6_700_000_000), ("125M", 125 * 10**6), ("1000", 1000)]
)
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["seven", "0.5", "-3", "1e-3"])
def test_parse_count_rejects(text):
    with pytest.raises(Exception, match="parameter count"):
        parse_count(text)


def test_cli_json(capsys):
    assert cli.main(["plan", "--preset", "llama-3-70b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_parameters"] == 70_553_706_496
    assert [s["name"] for s in data["strategies"]] == list(planner.STRATEGIES)
    by_name = {s["name"]: s for s in data["strategies"]}
    assert by_name["fsdp"]["fits"] is False and by_name[data["recommendation"]]["fits"] is True
    gpu = by_name["fsdp"]["gpu_bytes"]
    assert gpu["total"] == sum(v for k, v in gpu.items() if k != "total")


def test_cli_table_and_exit_status(capsys):
    assert cli.main(["plan", "--params", "70B", "--gpus-per-node", "2", "--host-memory-gb", "100"]) == 1
    out = capsys.readouterr().out
    for name in planner.STRATEGIES:
        assert name in out
    assert "Recommendation: none fits" in out and "not estimated" in out


def test_cli_config_file_and_bad_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "mistral", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
    }))
    assert cli.main(["plan", "--config", str(path), "--gpus-per-node", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_parameters"] == SMALL.num_parameters()
    assert cli.main(["plan", "--config", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


MIXTRAL_8X7B = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
    "num_experts_per_tok": 2, "tie_word_embeddings": False,
}


def test_a_mixtral_config_directory_is_counted_with_its_experts(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    assert cli.main(["plan", "--config", str(tmp_path), "--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert data["num_parameters"] == PRESETS["mixtral-8x7b"].num_parameters() == 46_702_792_704
    assert data["schema_version"] == 1 and data["command"] == "plan"


@pytest.mark.parametrize(
    "fields, key",
    [
        ({**MIXTRAL_8X7B, "model_type": "llama"}, "num_local_experts"),  # experts in a dense type: refused
        ({**MIXTRAL_8X7B, "model_type": ""}, "num_local_experts"),
        ({**MIXTRAL_8X7B, "model_type": "qwen2_moe"}, "moe_intermediate_size"),  # the type's keys are required
        ({**MIXTRAL_8X7B, "model_type": "deepseek_v3", "n_routed_experts": 8}, "n_shared_experts"),
        ({**MIXTRAL_8X7B, "model_type": "mixtral", "num_local_experts": None}, "num_local_experts"),
        ({**MIXTRAL_8X7B, "model_type": "olmoe"}, "olmoe"),
    ],
)
def test_configs_the_planner_would_count_wrong_are_refused_naming_the_key(tmp_path, fields, key):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=key):
        models.model_from_hf_config(path)


def test_an_unknown_architecture_without_transformers_is_refused_on_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL_8X7B, "model_type": "olmoe"}))
    code = ("import sys; sys.modules['transformers'] = None\n"
            f"from offload_adamw.cli.main import main; sys.exit(main(['plan', '--config', {str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "model_type 'olmoe'" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_directory_without_config_json_is_named(tmp_path, capsys):
    assert cli.main(["plan", "--config", str(tmp_path)]) == 2
    assert "without config.json" in capsys.readouterr().err


def test_cli_plot_writes_a_png(tmp_path):
    out = tmp_path / "plan.png"
    assert cli.main(["plan", "--preset", "llama-2-70b", "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 800 and height > 400


def test_measure_without_the_probe_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "offload_adamw.benchmarking.bandwidth", None)  # the import now fails as if absent
    value, message = measured_host_bandwidth()
    assert value is None and "not available" in message
    assert cli.main(["plan", "--params", "7B", "--measure", "--json"]) == 0
    captured = capsys.readouterr()
    assert "offload_adamw.benchmarking.bandwidth is not available" in captured.err
    assert json.loads(captured.out)["hardware"]["host_memory_bytes_per_s"] == HardwareConfig().host_memory_bytes_per_s


def test_measure_with_the_probe():
    pytest.importorskip("offload_adamw.benchmarking.bandwidth")
    value, message = measured_host_bandwidth(elements=1 << 18, repeats=2)
    assert value is not None and 1e8 < value < 1e13, message


def test_console_entry_point_runs_in_a_subprocess():
    done = subprocess.run(
        [sys.executable, "-m", "offload_adamw", "plan", "--preset", "llama-3-8b", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["num_parameters"] == 8_030_261_248


@pytest.mark.parametrize("content", [bytes(range(256)), b"\xff\xfe{\x00}\x00", b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 40,
                                     b"[" * 100_000], ids=["all_bytes", "utf16", "elf_header", "nested_deeply"])
def test_cli_on_a_binary_or_unreadable_config_names_the_file(tmp_path, capsys, content):
    path = tmp_path / "weights.bin"
    path.write_bytes(content)
    assert cli.main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith(f"offload-adamw plan: {path}: not "), err


def test_the_70b_document_shows_what_the_command_prints(capsys, monkeypatch):
    from pathlib import Path

    monkeypatch.setenv("COLUMNS", "100")  # the width docs/plan-70b.md was produced at
    assert cli.main(["plan", "--preset", "llama-3-70b"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "plan-70b.md").read_text(encoding="utf-8")
    block = doc.split("```text\n", 1)[1].split("```", 1)[0].rstrip("\n")
    assert block == printed, "docs/plan-70b.md is stale: regenerate it with COLUMNS=100 offload-adamw plan --preset llama-3-70b"
