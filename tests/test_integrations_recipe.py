"""examples/recipe.yaml, the `_component_`-style recipe, builds OffloadAdamW and its scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

yaml = pytest.importorskip("yaml")

from offload_adamw import OffloadAdamW, named_param_groups  # noqa: E402
from offload_adamw.integrations.recipe import instantiate, resolve  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "recipe.yaml"


def test_the_example_recipe_builds_the_optimizer_and_steps_like_torch_adamw():
    recipe = yaml.safe_load(RECIPE.read_text())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    reference.load_state_dict(model.state_dict())
    rules = [("*.bias", {"weight_decay": 0.0}), ("1.*", {"weight_decay": 0.0})]
    optimizer = instantiate(recipe["optimizer"], named_param_groups(model, rules))
    scheduler = instantiate(recipe["lr_scheduler"], optimizer)
    assert isinstance(optimizer, OffloadAdamW) and isinstance(scheduler, torch.optim.lr_scheduler.LinearLR)
    node = recipe["optimizer"]
    expected = torch.optim.AdamW(named_param_groups(reference, rules), lr=node["lr"], betas=tuple(node["betas"]),
                                 eps=node["eps"], weight_decay=node["weight_decay"], fused=True)
    expected_scheduler = torch.optim.lr_scheduler.LinearLR(expected, start_factor=0.1, total_iters=100)
    x = torch.randn(4, 8)
    for _ in range(3):
        for m, opt, sched in ((model, optimizer, scheduler), (reference, expected, expected_scheduler)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
            sched.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert [g["param_names"] for g in optimizer.param_groups] == [g["param_names"] for g in expected.param_groups]


@pytest.mark.parametrize(
    "node, match",
    [
        ({"lr": 1.0}, "_component_"),
        ({"_component_": "OffloadAdamW"}, "dotted path"),
        ({"_component_": "offload_adamw.NoSuchOptimizer"}, "NoSuchOptimizer"),
        ({"_component_": "no_such_package.Optimizer"}, "no_such_package"),
    ],
)
def test_a_bad_node_is_named(node, match):
    with pytest.raises(ValueError, match=match):
        instantiate(node, [torch.nn.Parameter(torch.ones(1))])


def test_nested_components_are_built_first():
    assert resolve("torch.optim.lr_scheduler.LinearLR") is torch.optim.lr_scheduler.LinearLR
    node = {"_component_": "builtins.dict", "inner": {"_component_": "builtins.list"}, "plain": [1, 2]}
    assert instantiate(node) == {"inner": [], "plain": [1, 2]}
