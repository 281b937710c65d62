"""param_groups: ordered name rules -> groups; real transformers models (tied and untied) and random module trees.

Properties checked on every configuration: each trainable tensor is in exactly one group, frozen tensors in
none, a tensor goes to the first rule matching any of its names, ``param_names`` holds the canonical name,
``tied_names`` every name; a rule that takes nothing raises naming the rule. State dicts of torch.optim.AdamW
and OffloadAdamW built on these groups are keyed by name and load across model instances.
"""

from __future__ import annotations

import fnmatch
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_adamw import OffloadAdamW, ParamGroupError, Rule, param_groups

transformers = pytest.importorskip("transformers")

from _models import tiny_gpt2, tiny_llama  # noqa: E402

MODELS = {"llama_tied": lambda: tiny_llama(True), "llama_untied": lambda: tiny_llama(False), "gpt2_tied": tiny_gpt2}
GPT2_NO_DECAY = [("*.bias", {"weight_decay": 0.0}), ("*.ln_*", {"weight_decay": 0.0})]
LLAMA_NO_DECAY = [("*norm*", {"weight_decay": 0.0})]
NO_DECAY = {"llama_tied": LLAMA_NO_DECAY, "llama_untied": LLAMA_NO_DECAY, "gpt2_tied": GPT2_NO_DECAY}

# (model, rules, default, expected {rule text: set of canonical names}) -- names written out by hand.
LLAMA_NORMS = {f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")} | {
    "model.norm.weight"
}
GPT2_LN = {f"transformer.h.{i}.{n}.weight" for i in range(2) for n in ("ln_1", "ln_2")} | {"transformer.ln_f.weight"}
GPT2_BIAS = {
    f"transformer.h.{i}.{m}.bias"
    for i in range(2)
    for m in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
} | {"transformer.ln_f.bias"}
CASES = [
    pytest.param(
        "llama_tied",
        [("*norm*", {"weight_decay": 0.0}), ("re:embed_tokens", {"weight_decay": 0.0, "lr": 1e-4})],
        {"weight_decay": 0.1},
        {"*norm*": LLAMA_NORMS, "re:embed_tokens": {"model.embed_tokens.weight"}},
        id="llama_tied-norms-embedding",
    ),
    pytest.param(
        "llama_tied",  # the tied tensor is matched through its second name, lm_head.weight
        [("lm_head.*", {"lr": 1e-4})],
        {},
        {"lm_head.*": {"model.embed_tokens.weight"}},
        id="llama_tied-by-alias",
    ),
    pytest.param(
        "llama_untied",
        [("lm_head.*", {"lr": 1e-4}), (re.compile(r"embed"), {"weight_decay": 0.0})],
        {},
        {"lm_head.*": {"lm_head.weight"}, "re:embed": {"model.embed_tokens.weight"}},
        id="llama_untied-compiled-regex",
    ),
    pytest.param(
        "gpt2_tied",
        GPT2_NO_DECAY,
        {"weight_decay": 0.1},
        {"*.bias": GPT2_BIAS, "*.ln_*": GPT2_LN},
        id="gpt2-no-decay-rules",
    ),
    pytest.param(
        "gpt2_tied",
        [Rule(pattern="re:^transformer\\.w[tp]e\\.", hyper={"weight_decay": 0.0})],
        {"weight_decay": 0.1},
        {"re:^transformer\\.w[tp]e\\.": {"transformer.wte.weight", "transformer.wpe.weight"}},
        id="gpt2-embeddings-Rule",
    ),
]


def first_rule_index(rules, names: list[str]) -> int | None:
    """Oracle: the first rule matching any name (glob: fnmatchcase on the whole name; regex: search)."""
    for index, rule in enumerate(rules):
        pattern = rule.pattern if isinstance(rule, Rule) else rule[0]
        for name in names:
            if isinstance(pattern, re.Pattern):
                hit = pattern.search(name) is not None
            elif pattern.startswith("re:"):
                hit = re.search(pattern[3:], name) is not None
            else:
                hit = fnmatch.fnmatchcase(name, pattern)
            if hit:
                return index
    return None


def all_names(model: torch.nn.Module) -> dict[torch.Tensor, list[str]]:
    out: dict[torch.Tensor, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(p, []).append(name)
    return out


def check_partition(model: torch.nn.Module, rules, default, groups) -> None:
    names = all_names(model)
    seen: dict[torch.Tensor, int] = {}
    for gi, group in enumerate(groups):
        assert group["params"], f"group {gi} is empty"
        assert len(group["param_names"]) == len(group["params"])
        for p, name in zip(group["params"], group["param_names"]):
            assert p not in seen, f"{name} is in groups {seen[p]} and {gi}"
            seen[p] = gi
            assert name == names[p][0]
            if len(names[p]) > 1:
                assert group["tied_names"][name] == names[p]
            else:
                assert name not in group["tied_names"]
    trainable = {p for p in names if p.requires_grad}
    assert set(seen) == trainable
    for p in trainable:
        index = first_rule_index(rules, names[p])
        expected = len(rules) if index is None else index
        assert seen[p] == expected, names[p]
    if default is not None and len(groups) > len(rules):
        assert groups[-1]["rule"] == "<default>"
        for key, value in default.items():
            assert groups[-1][key] == value


@pytest.mark.parametrize("model_name, rules, default, expected", CASES)
def test_groups_of_real_models(model_name, rules, default, expected):
    model = MODELS[model_name]()
    groups = param_groups(model, rules, default)
    check_partition(model, rules, default, groups)
    by_rule = {g["rule"]: set(g["param_names"]) for g in groups}
    for rule_text, names in expected.items():
        assert by_rule[rule_text] == names
    for rule, group in zip(rules, groups):
        hyper = rule.hyper if isinstance(rule, Rule) else rule[1]
        assert {k: group[k] for k in hyper} == dict(hyper)


def test_tied_tensor_appears_once_under_all_its_names():
    model = tiny_gpt2()
    groups = param_groups(model, [("lm_head.weight", {"weight_decay": 0.0})])
    assert groups[0]["param_names"] == ["transformer.wte.weight"]
    assert groups[0]["params"] == [model.lm_head.weight]
    assert groups[0]["tied_names"] == {"transformer.wte.weight": ["transformer.wte.weight", "lm_head.weight"]}
    flat = [p for g in groups for p in g["params"]]
    assert len(flat) == len({id(p) for p in flat}) == len(list(model.parameters()))


@pytest.mark.parametrize("model_name", ["llama_tied", "gpt2_tied"])
def test_frozen_parameters_are_left_out(model_name):
    model = MODELS[model_name]()
    for name, p in model.named_parameters():
        if ".0." in name:
            p.requires_grad_(False)
    groups = param_groups(model, NO_DECAY[model_name], {})
    check_partition(model, NO_DECAY[model_name], {}, groups)
    assert not any(".0." in n for g in groups for n in g["param_names"])


# ------------------------------------------------------------------ errors name the culprit

ERROR_CASES = [
    ("gpt2_tied", [("*.bias", {}), ("*.nothing", {})], {}, ["rule 1", "'*.nothing'", "matches no parameter name"]),
    ("gpt2_tied", [("bias", {})], {}, ["rule 0", "'bias'", "matches no parameter name"]),  # glob is the whole name
    (
        "gpt2_tied",
        [("*.bias", {}), ("re:ln_1\\.bias$", {})],
        {},
        ["rule 1", "taken by an earlier rule", "transformer.h.0.ln_1.bias"],
    ),
    (  # the tied alias: lm_head.weight is transformer.wte.weight, already taken
        "gpt2_tied",
        [("transformer.wte.weight", {}), ("lm_head.weight", {})],
        {},
        ["rule 1", "'lm_head.weight'", "taken by an earlier rule", "transformer.wte.weight"],
    ),
    ("gpt2_tied", [("*.bias", {"weight_decy": 0.0})], {}, ["rule 0", "weight_decy", "unknown hyperparameter"]),
    ("gpt2_tied", [("*.bias", {"params": []})], {}, ["rule 0", "params"]),
    ("gpt2_tied", [("re:(unclosed", {})], {}, ["rule 0", "invalid regular expression"]),
    ("gpt2_tied", [("*.bias", {})], {"weight_decy": 0.1}, ["default", "weight_decy"]),
    (
        "llama_untied",
        [("*norm*", {}), ("*proj*", {})],
        None,
        ["2 trainable parameter(s) match no rule", "model.embed_tokens.weight", "lm_head.weight"],
    ),
]


@pytest.mark.parametrize("model_name, rules, default, words", ERROR_CASES)
def test_bad_rules_raise_naming_the_culprit(model_name, rules, default, words):
    model = MODELS[model_name]()
    with pytest.raises(ParamGroupError) as info:
        param_groups(model, rules, default)
    for word in words:
        assert word in str(info.value)


def test_rule_matching_only_frozen_parameters_raises():
    model = tiny_llama(False)
    model.lm_head.weight.requires_grad_(False)
    with pytest.raises(
        ParamGroupError, match=r"rule 0 'lm_head\.\*' takes no parameter: it matches only frozen parameters \('lm_head.weight'\)"
    ):
        param_groups(model, [("lm_head.*", {})])


def test_other_optimizers_keys_with_known_keys_none():
    model = tiny_llama(False)
    groups = param_groups(model, [("*norm*", {"momentum": 0.0})], {"momentum": 0.9}, known_keys=None)
    optimizer = torch.optim.SGD(groups, lr=0.1)
    assert [g["momentum"] for g in optimizer.param_groups] == [0.0, 0.9]


# ------------------------------------------------------------ state_dicts keyed by name


@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, OffloadAdamW])
@pytest.mark.parametrize("model_name", ["llama_tied", "gpt2_tied"])
def test_state_dict_is_keyed_by_name_and_loads_into_a_new_instance(optimizer_cls, model_name):
    rules = NO_DECAY[model_name]
    model = MODELS[model_name]()
    optimizer = optimizer_cls(param_groups(model, rules, {"weight_decay": 0.1}), lr=1e-2)
    model(torch.arange(8).reshape(1, 8)).logits.sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    names = [n for g in saved["param_groups"] for n in g["param_names"]]
    assert len(names) == len(set(names)) == len(list(model.parameters()))

    twin = MODELS[model_name]()  # a fresh instance: other tensor objects, same names
    loaded = OffloadAdamW(param_groups(twin, rules, {"weight_decay": 0.1}), lr=1e-2)
    loaded.load_state_dict(saved)
    own = dict(twin.named_parameters())
    src = dict(model.named_parameters())
    for name in names:
        assert torch.equal(loaded.state[own[name]]["exp_avg"], optimizer.state[src[name]]["exp_avg"].float())
    assert [g["tied_names"] for g in loaded.param_groups] == [g["tied_names"] for g in saved["param_groups"]]


# ------------------------------------------------------------ random module trees


@st.composite
def module_trees(draw):
    """A module with random dotted names, random ties and frozen tensors, and random glob/regex rules."""
    pieces = ["attn", "mlp", "norm", "bias", "weight", "embed", "head"]
    root = torch.nn.Module()
    tensors: list[torch.nn.Parameter] = []
    count = draw(st.integers(1, 8))
    for i in range(count):
        path = draw(st.lists(st.sampled_from(pieces), min_size=1, max_size=3))
        owner = root
        for part in path[:-1]:
            key = f"{part}{i}"
            if not hasattr(owner, key):
                owner.add_module(key, torch.nn.Module())
            owner = getattr(owner, key)
        if tensors and draw(st.booleans()) and draw(st.booleans()):
            p = draw(st.sampled_from(tensors))  # a tie: the same Parameter under another name
        else:
            p = torch.nn.Parameter(torch.zeros(2), requires_grad=draw(st.integers(0, 4)) > 0)
            tensors.append(p)
        owner.register_parameter(f"{path[-1]}_{i}", p)
    rules = []
    for _ in range(draw(st.integers(0, 4))):
        piece = draw(st.sampled_from(pieces))
        pattern = draw(st.sampled_from([f"*{piece}*", f"re:{piece}\\d", f"*.{piece}_*", f"{piece}*"]))
        rules.append((pattern, {"lr": draw(st.sampled_from([0.1, 0.01]))}))
    default = draw(st.sampled_from([{}, None]))
    return root, rules, default


@settings(max_examples=60, deadline=None)
@given(module_trees())
def test_partition_law_on_random_trees(tree):
    model, rules, default = tree
    names = all_names(model)
    trainable = [p for p in names if p.requires_grad]
    # Oracle: rule k takes the trainable tensors whose first matching rule is k.
    takes = {k: [p for p in trainable if first_rule_index(rules, names[p]) == k] for k in range(len(rules))}
    dead = [k for k in range(len(rules)) if not takes[k]]
    unmatched = [p for p in trainable if first_rule_index(rules, names[p]) is None]
    try:
        groups = param_groups(model, rules, default)
    except ParamGroupError as exc:
        if dead:
            assert str(exc).startswith(f"rule {dead[0]} {rules[dead[0]][0]!r} takes no parameter")
        elif unmatched and default is None:
            assert "match no rule" in str(exc) and names[unmatched[0]][0] in str(exc)
        else:
            assert not trainable and "no trainable parameter" in str(exc)
        return
    assert not dead and (default is not None or not unmatched)
    check_partition(model, rules, default, groups)
