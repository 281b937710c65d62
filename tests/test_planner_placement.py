"""Where each group's update runs (planning/placement.py): the costs by hand, the chosen mix against a
brute force over every assignment, its laws, and the param_groups rules it prints against real names.

Laws: the chosen mix fits device and host memory; its bound is within the stated tolerance of the
smallest bound of all fitting assignments (so of every single placement), and among those it is the
simplest; moving a group from the host to the device never raises the PCIe or host-memory terms and
raises the bound only through the device-memory term; the printed rules give every parameter its
group's placement.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_adamw import cli
from offload_adamw.planning import placement, planner
from offload_adamw.planning.models import PRESETS, ModelConfig, ParamCountModel, ParamShapesModel
from offload_adamw.planning.placement import PLACEMENTS, Limits, evaluate, index_range_regex, placement_costs
from offload_adamw.planning.planner import GB, HardwareConfig, TrainingConfig, plan

SMALL = ModelConfig(
    name="small", hidden_size=64, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
)
ONE_GPU = HardwareConfig(gpus_per_node=1, nodes=1)


# ----------------------------------------------------------------------------- costs by hand


@pytest.mark.parametrize("amsgrad, state", [(False, 12), (True, 16)])
@pytest.mark.parametrize("accum", [1, 4])
def test_placement_costs_by_hand(amsgrad, state, accum):
    update = 28 + (8 if amsgrad else 0)  # docs/contract.md#traffic-bill
    kept = placement_costs(param_bytes=2, grad_bytes=2, amsgrad=amsgrad, grad_accumulation=accum, offload_gradients=False)
    freed = placement_costs(param_bytes=2, grad_bytes=2, amsgrad=amsgrad, grad_accumulation=accum, offload_gradients=True)
    # host bytes of a host group: the state, the gradient buffer (and its accumulation buffer), the staging copy
    assert kept["host"] == placement.PlacementCost(gpu_bytes=2, host_bytes=state + 2 + 2, h2d=2, d2h=2,
                                                   host_traffic=2 + update + 2, gpu_traffic=0)
    assert freed["host"] == placement.PlacementCost(gpu_bytes=0, host_bytes=state + (4 if accum > 1 else 2) + 2, h2d=2,
                                                    d2h=2 * accum, host_traffic=2 + (accum - 1) * 8 + update + 2,
                                                    gpu_traffic=0)
    for costs in (kept, freed):  # the gradient never leaves the device where the update runs there
        assert costs["stream"] == placement.PlacementCost(gpu_bytes=2, host_bytes=state, h2d=state, d2h=state,
                                                          host_traffic=2 * state, gpu_traffic=update + 2 * state)
        assert costs["device"] == placement.PlacementCost(gpu_bytes=2 + state, host_bytes=0, h2d=0, d2h=0,
                                                          host_traffic=0, gpu_traffic=update)


@pytest.mark.parametrize("dtype, amsgrad", [("bfloat16", False), ("bfloat16", True), ("float32", False)])
def test_the_streamed_strategy_by_hand(dtype, amsgrad):
    training = TrainingConfig(param_dtype=dtype, amsgrad=amsgrad, stream_chunk_bytes=2**20, stream_buffers=2)
    result = plan(SMALL, ONE_GPU, training)
    s = result.strategy("fsdp+streamed-state")
    n, tensors = SMALL.num_parameters(), len(SMALL.parameter_shapes())
    p = 4 if dtype == "float32" else 2
    state = 16 if amsgrad else 12  # a float32 master even for float32 parameters: they are not in host memory
    assert (s.pcie_h2d_bytes, s.pcie_d2h_bytes) == (state * n, state * n)
    assert s.host_memory_traffic_bytes == 2 * state * n and s.gpu_memory_traffic_bytes == (28 + 8 * amsgrad + 2 * state) * n
    assert s.host.total - s.host.reserved == state * n + 4 * tensors
    assert s.gpu.gradients == p * n and s.gpu.master == 0
    assert s.gpu.buffers - result.strategy("fsdp+offload-adamw").gpu.buffers == 2 * 2**20  # the ring
    assert s.step_time_lower_bound_s == pytest.approx(max(state * n / ONE_GPU.pcie_bytes_per_s,
                                                          2 * state * n / ONE_GPU.host_memory_bytes_per_s,
                                                          s.gpu_memory_traffic_bytes / ONE_GPU.gpu_memory_bytes_per_s))


def test_planning_groups_partition_the_parameters_into_layers_and_other_tensors():
    shapes = SMALL.parameter_shapes()
    groups = placement.planning_groups(shapes, 4)
    assert [g.label for g in groups] == ["model.embed_tokens.weight", *(f"model.layers.{i}" for i in range(3)),
                                         "model.norm.weight", "lm_head.weight"]
    assert sorted(n for g in groups for n in g.names) == sorted(n for n, _ in shapes)
    assert sum(g.elements for g in groups) == sum(placement.shard_numel(s, 4) for _, s in shapes)
    assert [g.layer for g in groups[1:4]] == [("model.layers", i) for i in range(3)]
    assert placement.shard_numel((), 8) == 1 and placement.shard_numel((10, 3), 4) == 9


# ----------------------------------------------------------------------------- the range patterns


@settings(max_examples=200, deadline=None)
@given(low=st.integers(0, 1200), width=st.integers(0, 1200))
def test_index_range_regex_matches_exactly_the_range(low, width):
    high = low + width
    pattern = re.compile(f"(?:{index_range_regex(low, high)})")
    for n in range(0, 2500):
        assert bool(pattern.fullmatch(str(n))) == (low <= n <= high), (low, high, n)
    assert not pattern.fullmatch(f"0{low}")  # no leading zeros


def test_index_range_regex_refuses_an_empty_range():
    with pytest.raises(ValueError, match="empty"):
        index_range_regex(5, 4)


# ----------------------------------------------------------------------------- the chosen mix


def _limits(gpu_fraction: float, host_fraction: float, per_node: int, pcie: float, host_bw: float, gpu_bw: float,
            groups, costs, ring: int) -> Limits:
    total = sum(g.elements for g in groups)
    tensors = sum(g.tensors for g in groups)
    widest_gpu = max(c["device"].gpu_bytes for c in costs.values()) * total + 4 * tensors + ring
    widest_host = max(c["host"].host_bytes for c in costs.values()) * total + 4 * tensors
    return Limits(gpu_fixed_bytes=1000, gpu_capacity=1000 + gpu_fraction * widest_gpu, host_fixed_bytes=500,
                  host_capacity=500 + host_fraction * per_node * widest_host, ranks_per_node=per_node, ring_bytes=ring,
                  pcie_bytes_per_s=pcie, host_memory_bytes_per_s=host_bw, gpu_memory_bytes_per_s=gpu_bw)


def _all_assignments(groups, costs_by_flag, limits):
    """(flag, placements, totals) of every assignment of a placement to each group."""
    for flag, choice in itertools.product(sorted(costs_by_flag), itertools.product(PLACEMENTS, repeat=len(groups))):
        elements = dict.fromkeys(PLACEMENTS, 0)
        tensors = dict.fromkeys(PLACEMENTS, 0)
        for group, x in zip(groups, choice):
            elements[x] += group.elements
            tensors[x] += group.tensors
        yield flag, choice, evaluate(elements, tensors, costs_by_flag[flag], limits)


bandwidth = st.sampled_from([1e6, 1e7, 1e8, 1e9])
any_bandwidth = st.integers(0, 60).map(lambda k: 1e6 * 10 ** (k / 20))  # 1e6 to 1e9, 20 steps a decade
fraction = st.sampled_from([0.0, 0.05, 0.2, 0.4, 0.7, 1.0, 1.5])

MODELS = {
    "small": SMALL.parameter_shapes(),
    "tied": ModelConfig(name="tied", hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                        num_key_value_heads=2, vocab_size=200, tie_word_embeddings=True).parameter_shapes(),
    "count": ParamCountModel(name="n", params=12345).parameter_shapes(),
}


@settings(max_examples=60, deadline=None)
@given(model=st.sampled_from(sorted(MODELS)), world=st.sampled_from([1, 2, 8]), per_node=st.sampled_from([1, 4]),
       gpu=fraction, host=fraction, pcie=bandwidth, host_bw=bandwidth, gpu_bw=bandwidth, amsgrad=st.booleans(),
       accum=st.sampled_from([1, 3]), ring=st.sampled_from([0, 4096]))
def test_the_chosen_mix_is_the_simplest_of_the_best_by_brute_force(model, world, per_node, gpu, host, pcie, host_bw,
                                                                   gpu_bw, amsgrad, accum, ring):
    groups = placement.planning_groups(MODELS[model], world)
    costs = {flag: placement_costs(param_bytes=2, grad_bytes=2, amsgrad=amsgrad, grad_accumulation=accum,
                                   offload_gradients=flag) for flag in (False, True)}
    limits = _limits(gpu, host, per_node, pcie, host_bw, gpu_bw, groups, costs, ring)
    chosen = placement.choose_mix(groups, costs, limits)
    fitting = [(flag, choice, t) for flag, choice, t in _all_assignments(groups, costs, limits) if t.fits]
    if not fitting:
        assert chosen is None
        return
    assert chosen is not None and chosen.totals.fits
    assert chosen.totals.gpu_bytes <= limits.gpu_capacity and chosen.totals.host_bytes <= limits.host_capacity
    best = min(t.bound_s for _, _, t in fitting)
    threshold = best * (1 + placement.BOUND_TOLERANCE)
    assert chosen.totals.bound_s <= threshold * (1 + 1e-12)
    # simplest among the near-best: offload_gradients off if possible, fewest elements on the host, most resident
    simplest = min((flag, t.elements["host"], -t.elements["device"]) for flag, _, t in fitting
                   if t.bound_s <= threshold)
    assert (chosen.offload_gradients, chosen.totals.elements["host"], -chosen.totals.elements["device"]) == simplest
    # the totals are those of the assignment it reports
    placed = {x: sum(g.elements for g, y in chosen.assignment if y == x) for x in PLACEMENTS}
    assert placed == chosen.totals.elements and [g.label for g, _ in chosen.assignment] == [g.label for g in groups]


DEEP = ModelConfig(name="deep", hidden_size=32, intermediate_size=64, num_hidden_layers=12, num_attention_heads=2,
                   num_key_value_heads=2, vocab_size=200)


@settings(max_examples=30, deadline=None)
@given(per_node=st.sampled_from([1, 4]), gpu=fraction, host=fraction, pcie=any_bandwidth, host_bw=any_bandwidth,
       gpu_bw=any_bandwidth, accum=st.sampled_from([1, 3]), tolerance=st.sampled_from([0.0, 0.01, 0.1, 0.3]))
def test_the_chosen_mix_matches_a_brute_force_over_how_many_of_each_kind_take_each_placement(
        per_node, gpu, host, pcie, host_bw, gpu_bw, accum, tolerance):
    # 12 layers: groups of one size are interchangeable, so trying every count of each kind per placement is
    # exhaustive; wider tolerances put many mixes into the band, where the simplest must be the one chosen.
    # The tolerance is patched for one example only: a later test must see the module's own.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(placement, "BOUND_TOLERANCE", tolerance)
        _chosen_is_the_brute_force_simplest(per_node, gpu, host, pcie, host_bw, gpu_bw, accum)


def _chosen_is_the_brute_force_simplest(per_node, gpu, host, pcie, host_bw, gpu_bw, accum):
    groups = placement.planning_groups(DEEP.parameter_shapes(), 2)
    costs = {flag: placement_costs(param_bytes=2, grad_bytes=2, amsgrad=False, grad_accumulation=accum,
                                   offload_gradients=flag) for flag in (False, True)}
    limits = _limits(gpu, host, per_node, pcie, host_bw, gpu_bw, groups, costs, 512)
    kinds: dict[tuple[int, int], int] = {}
    for g in groups:
        kinds[(g.elements, g.tensors)] = kinds.get((g.elements, g.tensors), 0) + 1
    splits = [[(d, s_) for d in range(c + 1) for s_ in range(c + 1 - d)] for c in kinds.values()]
    fitting = []
    for flag in (False, True):
        for split in itertools.product(*splits):
            elements, tensors = dict.fromkeys(PLACEMENTS, 0), dict.fromkeys(PLACEMENTS, 0)
            for ((e, t), count), (d, s_) in zip(kinds.items(), split):
                for x, k in (("device", d), ("stream", s_), ("host", count - d - s_)):
                    elements[x] += k * e
                    tensors[x] += k * t
            totals = evaluate(elements, tensors, costs[flag], limits)
            if totals.fits:
                fitting.append((flag, totals))
    chosen = placement.choose_mix(groups, costs, limits)
    if not fitting:
        assert chosen is None
        return
    threshold = min(t.bound_s for _, t in fitting) * (1 + placement.BOUND_TOLERANCE)
    simplest = min((flag, t.elements["host"], -t.elements["device"]) for flag, t in fitting if t.bound_s <= threshold)
    assert chosen is not None and chosen.totals.fits and chosen.totals.bound_s <= threshold * (1 + 1e-12)
    assert (chosen.offload_gradients, chosen.totals.elements["host"], -chosen.totals.elements["device"]) == simplest


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), per_node=st.sampled_from([1, 8]), pcie=bandwidth, host_bw=bandwidth, gpu_bw=bandwidth,
       flag=st.booleans(), accum=st.sampled_from([1, 4]))
def test_moving_a_group_from_host_to_device_raises_the_bound_only_through_device_memory(seed, per_node, pcie, host_bw,
                                                                                       gpu_bw, flag, accum):
    import random

    rng = random.Random(seed)
    groups = placement.planning_groups(SMALL.parameter_shapes(), 2)
    costs = placement_costs(param_bytes=2, grad_bytes=2, amsgrad=False, grad_accumulation=accum, offload_gradients=flag)
    limits = _limits(1.5, 1.5, per_node, pcie, host_bw, gpu_bw, groups, {flag: costs}, 4096)
    choice = [rng.choice(PLACEMENTS) for _ in groups]
    choice[rng.randrange(len(groups))] = "host"

    def totals(assigned):
        elements, tensors = dict.fromkeys(PLACEMENTS, 0), dict.fromkeys(PLACEMENTS, 0)
        for group, x in zip(groups, assigned):
            elements[x] += group.elements
            tensors[x] += group.tensors
        return evaluate(elements, tensors, costs, limits)

    for k in [i for i, x in enumerate(choice) if x == "host"]:
        before = totals(choice)
        after = totals(choice[:k] + ["device"] + choice[k + 1:])
        if not after.fits:
            continue
        for link in ("pcie h2d", "pcie d2h", "host memory"):
            assert after.times[link] <= before.times[link]
        assert after.bound_s <= max(before.bound_s, after.times["gpu memory"])


@settings(max_examples=30, deadline=None)
@given(preset=st.sampled_from(sorted(PRESETS)), per_node=st.integers(1, 8), nodes=st.integers(1, 2),
       host_gb=st.sampled_from([256, 1000, 2000]), gpu_gb=st.sampled_from([24, 80, 141]), seq=st.sampled_from([2048, 8192]),
       amsgrad=st.booleans(), accum=st.sampled_from([1, 4]))
def test_the_plans_mix_fits_and_is_no_worse_than_any_single_placement(preset, per_node, nodes, host_gb, gpu_gb, seq,
                                                                      amsgrad, accum):
    hardware = HardwareConfig(gpus_per_node=per_node, nodes=nodes, host_memory_bytes=host_gb * GB,
                              gpu_memory_bytes=gpu_gb * GB)
    result = plan(PRESETS[preset], hardware, TrainingConfig(seq_len=seq, amsgrad=amsgrad, grad_accumulation=accum))
    mixed = result.strategy(planner.MIX)
    singles = [result.strategy(name) for name in ("fsdp+offload-adamw", "fsdp+offload-adamw+offload-grads",
                                                  "fsdp+streamed-state")]
    if not mixed.fits:
        assert not any(s.fits for s in singles)
        return
    assert mixed.gpu.total <= mixed.gpu_capacity and mixed.host.total <= mixed.host_capacity
    assert mixed.gpu.total == mixed.mix.totals.gpu_bytes and mixed.host.total == mixed.mix.totals.host_bytes
    for s in singles:
        if s.fits:
            assert mixed.step_time_lower_bound_s <= s.step_time_lower_bound_s * (1 + placement.BOUND_TOLERANCE) + 1e-12
    assert mixed.step_time_overlapped_s <= mixed.step_time_serial_s + 1e-9
    # a mix is recommended only where it beats every other fitting strategy by more than 5%
    if result.recommendation == planner.MIX:
        for s in result.strategies:
            if s.name != planner.MIX and s.fits and not s.comparison and not (s.name == "single-gpu" and per_node * nodes > 1):
                assert mixed.step_time_lower_bound_s * 1.05 < s.step_time_lower_bound_s


def test_a_small_model_keeps_its_state_on_the_gpu():
    result = plan(PRESETS["llama-3-8b"], HardwareConfig(), TrainingConfig())
    mix = result.strategy(planner.MIX).mix
    assert mix.uniform == "device" and not mix.offload_gradients
    assert result.recommendation in ("fsdp", "ddp")  # the same bound as the mix, with torch's own AdamW


def test_host_memory_too_small_for_any_offload_leaves_only_resident_groups():
    # 8 x 141 GB GPUs, 256 GB of host memory: no single placement fits, some layers resident and the rest
    # streamed does not either, so nothing of OffloadAdamW is recommended
    result = plan(PRESETS["llama-3-70b"], HardwareConfig(gpu_memory_bytes=141 * GB, host_memory_bytes=256 * GB))
    mixed = result.strategy(planner.MIX)
    for name in ("fsdp+offload-adamw", "fsdp+streamed-state"):
        assert not result.strategy(name).fits
    if mixed.fits:
        assert mixed.mix.count("device") > 0 and mixed.host.total <= 256 * GB


# ----------------------------------------------------------------------------- the rules against real names


def _named_groups(model, rules, default):
    from offload_adamw import named_param_groups

    # known_keys=None: the rules' only key is OffloadAdamW's update_on
    return named_param_groups(model, rules, default, known_keys=None)


@pytest.fixture(scope="module")
def llama_12_layers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=12, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


@settings(max_examples=40, deadline=None)
@given(choice=st.lists(st.sampled_from(PLACEMENTS), min_size=15, max_size=15), flag=st.booleans())
def test_the_printed_rules_give_every_parameter_its_groups_placement(llama_12_layers, choice, flag):
    shapes = [(name, tuple(p.shape)) for name, p in llama_12_layers.named_parameters()]
    groups = placement.planning_groups(shapes, 1)
    assert len(groups) == 15  # embedding, 12 layers, norm, output projection
    costs = placement_costs(param_bytes=2, grad_bytes=2, amsgrad=False, grad_accumulation=1, offload_gradients=flag)
    elements = {x: sum(g.elements for g, y in zip(groups, choice) if y == x) for x in PLACEMENTS}
    tensors = {x: sum(g.tensors for g, y in zip(groups, choice) if y == x) for x in PLACEMENTS}
    limits = _limits(1.0, 1.0, 1, 1e9, 1e9, 1e9, groups, {flag: costs}, 0)
    mix = placement.Mix(offload_gradients=flag, assignment=tuple(zip(groups, choice)),
                        totals=evaluate(elements, tensors, costs, limits))
    rules, default = mix.param_group_rules()
    built = _named_groups(llama_12_layers, rules, default)
    got = {name: group["update_on"] for group in built for name in group["param_names"]}
    want = {name: x for g, x in zip(groups, choice) for name in g.names}
    assert got == want
    # the same rules through the HF Trainer's route: every parameter keeps its placement, and its group's decay
    from offload_adamw.integrations.hf import trainer_param_groups

    decay = {name for name in want if "norm" not in name}
    split = trainer_param_groups(llama_12_layers, 0.1, decay_names=decay, rules=rules, default=default)
    assert {name: group["update_on"] for group in split for name in group["param_names"]} == want
    assert {name: group["weight_decay"] for group in split for name in group["param_names"]} == {
        name: 0.1 if name in decay else 0.0 for name in want}


def test_a_model_of_many_odd_tensors_puts_the_smallest_kinds_into_the_default_group(llama_12_layers):
    odd = tuple((f"extra.t{i}.weight", (i + 1, 3)) for i in range(12))
    model = ParamShapesModel(name="odd", shapes=(*((f"model.layers.{k}.w", (8, 8)) for k in range(6)), *odd))
    result = plan(model, HardwareConfig(gpus_per_node=1, gpu_memory_bytes=6 * GB, gpu_reserved_bytes=6 * GB - 2000,
                                        host_memory_bytes=100 * GB))
    mix = result.strategy(planner.MIX).mix
    assert mix.default_label is not None and mix.notes
    rules, default = mix.param_group_rules()
    assert default["update_on"] == dict((g.label, x) for g, x in mix.assignment)[mix.default_label]
    # the rules never name a merged tensor: they are what no rule matches
    merged = next(g for g, _ in mix.assignment if g.label == mix.default_label)
    for name in merged.names:
        assert not any(re.search(pattern[3:], name) for pattern, _ in rules)


# ----------------------------------------------------------------------------- the command line


def test_cli_json_carries_each_strategys_placement(capsys):
    assert cli.main(["plan", "--preset", "llama-3-70b", "--json", "--stream-chunk-mib", "32", "--stream-buffers", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema_version"] == 1 and data["training"]["stream_chunk_bytes"] == 32 * 2**20
    by_name = {s["name"]: s for s in data["strategies"]}
    assert by_name["fsdp"]["placement"] is None
    assert by_name["fsdp+streamed-state"]["placement"]["groups_per_placement"] == {"device": 0, "stream": 83, "host": 0}
    chosen = by_name[planner.MIX]["placement"]
    assert data["recommendation"] == planner.MIX and chosen["default_group"] == {"update_on": "stream"}
    assert sum(chosen["groups_per_placement"].values()) == len(chosen["groups"]) == 83
    assert all(hyper["update_on"] in PLACEMENTS for _, hyper in chosen["param_group_rules"])


@pytest.mark.parametrize("argv, culprit", [
    (["--stream-chunk-mib", "0"], "--stream-chunk-mib"),
    (["--stream-chunk-mib", "nan"], "--stream-chunk-mib"),
    (["--stream-buffers", "4"], "--stream-buffers"),
])
def test_cli_refuses_a_bad_ring_naming_the_option(capsys, argv, culprit):
    assert cli.main(["plan", "--preset", "llama-3-8b", *argv]) == 2
    assert culprit in capsys.readouterr().err


@pytest.mark.parametrize("make, match", [
    (lambda: TrainingConfig(stream_buffers=4), "stream_buffers"),
    (lambda: TrainingConfig(stream_chunk_bytes=0), "stream_chunk_bytes"),
    (lambda: TrainingConfig(stream_chunk_bytes=1.5), "stream_chunk_bytes"),
])
def test_bad_ring_configs_name_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()
