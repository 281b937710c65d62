"""OffloadAdamW inside the real transformers Trainer (CPU, a tiny randomly initialised Llama).

Properties, each against torch.optim.AdamW(fused=True), the implementation OffloadAdamW's default
path is bitwise equal to:

* ``Trainer(optimizers=(OffloadAdamW(...), scheduler))`` trains and gives bitwise the parameters
  torch's AdamW gives, with and without ``max_grad_norm`` clipping (and clipping changes them);
* ``optimizer_cls_and_kwargs=(OffloadAdamW, kwargs)`` gives bitwise what ``optim="adamw_torch_fused"``
  gives (same decay/no-decay groups built by the Trainer);
* ``optimizer_cls_and_kwargs=trainer_optimizer(model, args)`` and ``OffloadAdamWTrainer`` give bitwise
  what ``optim="adamw_torch_fused"`` gives, with the Trainer's own decay split and the parameter names
  in the optimizer's groups and state_dict;
* a run interrupted at a checkpoint and continued with ``resume_from_checkpoint`` ends bitwise where
  the uninterrupted run ends, for float32 and bf16 parameters (the bf16 case needs the float32
  master to travel through optimizer.pt).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

from configs import assert_bitwise_equal  # noqa: E402
from offload_adamw import OffloadAdamW  # noqa: E402

SEQ = 16
LR = 1e-2
WD = 0.1


class TokenWindows(torch.utils.data.Dataset):
    """Fixed random byte windows: causal LM examples with labels = inputs (the model shifts)."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def training_args(out: Path, **overrides) -> TrainingArguments:
    kwargs = dict(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=LR, weight_decay=WD,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, lr_scheduler_type="linear", warmup_steps=2,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert_bitwise_equal(a, b, "parameters")


def train_with(optimizer_cls, tmp_path: Path, tag: str, max_grad_norm: float, **opt_kwargs):
    model = tiny_llama()
    optimizer = optimizer_cls(model.parameters(), lr=LR, weight_decay=WD, **opt_kwargs)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=6)
    trainer = Trainer(
        model=model, args=training_args(tmp_path / tag, max_grad_norm=max_grad_norm),
        train_dataset=TokenWindows(), optimizers=(optimizer, scheduler),
    )
    trainer.train()
    assert trainer.optimizer.optimizer is optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer is optimizer
    return params_of(model), trainer


_RUNS: dict[tuple[str, float], tuple[dict[str, torch.Tensor], Trainer]] = {}


def offload_run(tmp_path_factory, max_grad_norm: float):
    """OffloadAdamW's run for ``max_grad_norm``, trained once per test session (two tests compare it)."""
    key = ("offload", max_grad_norm)
    if key not in _RUNS:
        _RUNS[key] = train_with(OffloadAdamW, tmp_path_factory.mktemp("offload"), "run", max_grad_norm)
    return _RUNS[key]


@pytest.mark.parametrize("max_grad_norm", [0.05, 0.0], ids=["clipped", "unclipped"])
def test_trainer_optimizers_tuple_matches_torch_adamw_bitwise(tmp_path, tmp_path_factory, max_grad_norm):
    ours, trainer = offload_run(tmp_path_factory, max_grad_norm)
    theirs, _ = train_with(torch.optim.AdamW, tmp_path, "torch", max_grad_norm, fused=True)
    assert_bitwise(ours, theirs)
    start = params_of(tiny_llama())
    assert any(not torch.equal(ours[n], start[n]) for n in ours), "training did not move the parameters"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    if max_grad_norm:
        # Clipping was really exercised: the pre-clip norm is above the threshold at every step.
        assert min(grad_norms) > max_grad_norm


def test_clipping_changes_the_trajectory(tmp_path_factory):
    clipped, _ = offload_run(tmp_path_factory, 0.05)
    unclipped, _ = offload_run(tmp_path_factory, 0.0)
    assert any(not torch.equal(clipped[n], unclipped[n]) for n in clipped)


def test_optimizer_cls_and_kwargs_matches_adamw_torch_fused(tmp_path):
    kwargs = {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8}
    model = tiny_llama()
    trainer = Trainer(
        model=model, args=training_args(tmp_path / "ours"), train_dataset=TokenWindows(),
        optimizer_cls_and_kwargs=(OffloadAdamW, kwargs),
    )
    trainer.train()
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(inner, OffloadAdamW)
    # The Trainer's decay / no-decay split arrived as two groups with their own weight decay.
    assert sorted(g["weight_decay"] for g in inner.param_groups) == [0.0, WD]

    reference = tiny_llama()
    Trainer(
        model=reference, args=training_args(tmp_path / "torch", optim="adamw_torch_fused"), train_dataset=TokenWindows(),
    ).train()
    assert_bitwise(params_of(model), params_of(reference))


def test_trainer_optimizer_keeps_the_trainers_split_and_the_names(tmp_path):
    from offload_adamw.integrations.hf import OffloadAdamWTrainer, trainer_optimizer

    reference = tiny_llama()
    Trainer(
        model=reference, args=training_args(tmp_path / "torch", optim="adamw_torch_fused"), train_dataset=TokenWindows(),
    ).train()

    model = tiny_llama()
    args = training_args(tmp_path / "helper")
    trainer = Trainer(model=model, args=args, train_dataset=TokenWindows(),
                      optimizer_cls_and_kwargs=trainer_optimizer(model, args, pin_memory=False))
    trainer.train()
    assert_bitwise(params_of(model), params_of(reference))
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(inner, OffloadAdamW)
    decay = set(trainer.get_decay_parameter_names(model))
    by_decay = {g["weight_decay"]: set(g["param_names"]) for g in inner.param_groups}
    assert by_decay == {WD: decay, 0.0: {n for n, _ in model.named_parameters()} - decay}
    assert any("norm" in n for n in by_decay[0.0]) and all("norm" not in n for n in by_decay[WD])
    saved = inner.state_dict()
    assert [g["param_names"] for g in saved["param_groups"]] == [g["param_names"] for g in inner.param_groups]

    subclassed = tiny_llama()
    trainer = OffloadAdamWTrainer(model=subclassed, args=training_args(tmp_path / "subclass"), train_dataset=TokenWindows(),
                                  offload_adamw_kwargs={"pin_memory": False})
    trainer.train()
    assert isinstance(getattr(trainer.optimizer, "optimizer", trainer.optimizer), OffloadAdamW)
    assert_bitwise(params_of(subclassed), params_of(reference))


def test_trainer_optimizer_takes_the_hyperparameters_of_the_arguments(tmp_path):
    from offload_adamw.integrations.hf import trainer_optimizer

    model = tiny_llama()
    args = training_args(tmp_path, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, learning_rate=3e-3)
    cls, kwargs = trainer_optimizer(model, args, offload_gradients=False)
    assert cls is OffloadAdamW
    assert (kwargs["lr"], kwargs["betas"], kwargs["eps"], kwargs["offload_gradients"]) == (3e-3, (0.8, 0.95), 1e-6, False)
    assert sum(len(g["params"]) for g in kwargs["params"]) == len(list(model.parameters()))


class StopAt(TrainerCallback):
    """Save a checkpoint at ``step`` and stop there, as a preempted job would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True
        return control


def run_trainer(model, out: Path, callbacks=(), resume=None) -> Trainer:
    optimizer = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WD)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=8)
    trainer = Trainer(
        model=model, args=training_args(out, max_steps=8, save_strategy="steps", save_steps=1000),
        train_dataset=TokenWindows(), optimizers=(optimizer, scheduler), callbacks=list(callbacks),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_resume_from_checkpoint_continues_bitwise(tmp_path, dtype):
    straight = tiny_llama(dtype)
    straight_trainer = run_trainer(straight, tmp_path / "straight")

    first = tiny_llama(dtype)
    run_trainer(first, tmp_path / "interrupted", callbacks=[StopAt(4)])
    checkpoint = tmp_path / "interrupted" / "checkpoint-4"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "scheduler.pt").is_file()
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    has_master = ["master_param" in s for s in saved["state"].values()]
    # A bf16 model's float32 master travels in the checkpoint; a float32 host parameter is its own master.
    assert all(has_master) if dtype == torch.bfloat16 else not any(has_master)

    resumed = tiny_llama(dtype)  # a fresh process would start from a fresh model and optimizer
    resumed_trainer = run_trainer(resumed, tmp_path / "interrupted", resume=str(checkpoint))
    assert resumed_trainer.state.global_step == 8
    assert_bitwise(params_of(straight), params_of(resumed))

    a = getattr(straight_trainer.optimizer, "optimizer", straight_trainer.optimizer)
    b = getattr(resumed_trainer.optimizer, "optimizer", resumed_trainer.optimizer)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a.master_param(p), b.master_param(q))
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.state[p][key], b.state[q][key]), key
            assert b.state[q][key].dtype == torch.float32


# ------------------------------------------------------------------------------------ updates during backward


class EarlyUpdates(TrainerCallback):
    """Before each optimizer step: whether this step's updates could start in backward (the pipeline armed, and with
    clipping the gate opened when backward ended)."""

    def __init__(self) -> None:
        self.armed: list[bool] = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        pipeline = getattr(optimizer, "optimizer", optimizer).transfer_pipeline
        self.armed.append(pipeline.armed() and (args.max_grad_norm == 0 or pipeline.gate_taken()))


@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("max_grad_norm", [0.05, 0.0], ids=["clipped", "unclipped"])
def test_updates_during_backward_through_the_trainer_route_match_adamw_torch_fused(tmp_path, max_grad_norm, accumulation):
    """OffloadAdamWTrainer with update_in_backward: the optimizer clips in the Trainer's place, with its max_grad_norm
    in the model's order, micro-batches that only accumulate run inside opt.no_sync(), and the logged grad_norm is
    torch's; parameters and logged norms bitwise those of optim="adamw_torch_fused"."""
    from offload_adamw.integrations.hf import OffloadAdamWTrainer

    overrides = dict(max_grad_norm=max_grad_norm, gradient_accumulation_steps=accumulation)
    data = TokenWindows(n=4 * accumulation * 6)
    reference = tiny_llama()
    theirs = Trainer(model=reference, args=training_args(tmp_path / "torch", optim="adamw_torch_fused", **overrides),
                     train_dataset=data)
    theirs.train()
    model = tiny_llama()
    early = EarlyUpdates()
    ours = OffloadAdamWTrainer(
        model=model, args=training_args(tmp_path / "ours", **overrides), train_dataset=data, callbacks=[early],
        offload_adamw_kwargs={"offload_gradients": True, "update_in_backward": True, "bucket_bytes": 4096},
    )
    ours.train()
    assert_bitwise(params_of(model), params_of(reference))
    norms = [h["grad_norm"] for h in ours.state.log_history if "grad_norm" in h]
    assert norms == [h["grad_norm"] for h in theirs.state.log_history if "grad_norm" in h] and len(norms) == 6
    if max_grad_norm:
        assert min(norms) > max_grad_norm, "clipping was not exercised at every step"
    assert early.armed == [False] + [True] * 5, f"updates did not start before step(): {early.armed}"


def test_the_trainer_route_refuses_a_second_max_grad_norm_with_updates_during_backward(tmp_path):
    from offload_adamw.integrations.hf import OffloadAdamWTrainer

    trainer = OffloadAdamWTrainer(
        model=tiny_llama(), args=training_args(tmp_path, max_grad_norm=1.0), train_dataset=TokenWindows(),
        offload_adamw_kwargs={"offload_gradients": True, "update_in_backward": True, "max_grad_norm": 0.5},
    )
    with pytest.raises(ValueError, match=r"max_grad_norm=0\.5 differs from the Trainer's max_grad_norm=1\.0"):
        trainer.train()


MIX_RULES = [(r"re:(?:^|\.)model\.layers\.0\.", {"update_on": "device"}), ("lm_head.weight", {"update_on": "stream"})]


def test_a_placement_mix_by_name_rules_keeps_the_trainers_split_and_matches_adamw_torch_fused(tmp_path):
    from offload_adamw.integrations.hf import OffloadAdamWTrainer

    reference = tiny_llama()
    Trainer(
        model=reference, args=training_args(tmp_path / "torch", optim="adamw_torch_fused"), train_dataset=TokenWindows(),
    ).train()
    model = tiny_llama()
    trainer = OffloadAdamWTrainer(model=model, args=training_args(tmp_path / "mix"), train_dataset=TokenWindows(),
                                  param_group_rules=MIX_RULES, param_group_default={"update_on": "host"},
                                  offload_adamw_kwargs={"pin_memory": False})
    trainer.train()
    assert_bitwise(params_of(model), params_of(reference))

    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    decay = set(trainer.get_decay_parameter_names(model))
    seen = [(g["rule"], g["update_on"], g["weight_decay"]) for g in inner.param_groups]
    # rule by rule, each split the Trainer's way (the lm_head has no norm or bias: no group without decay)
    assert seen == [(MIX_RULES[0][0], "device", WD), (MIX_RULES[0][0], "device", 0.0), ("lm_head.weight", "stream", WD),
                    ("<default>", "host", WD), ("<default>", "host", 0.0)]
    for g in inner.param_groups:
        assert all((n in decay) == (g["weight_decay"] == WD) for n in g["param_names"]), g["rule"]
    names = [n for g in inner.param_groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("rules, default, culprit", [
    ([("lm_head.weight", {"update_on": "stream", "weight_decay": 0.0})], None, "param_group_rules[0] 'lm_head.weight'"),
    (MIX_RULES, {"weight_decay": 0.5}, "param_group_default"),
    ([("no.such.*", {"update_on": "device"})], None, "rule 0 'no.such.*' takes no parameter"),
])
def test_a_rule_that_sets_weight_decay_or_takes_nothing_is_refused_by_name_before_any_update(tmp_path, rules, default,
                                                                                            culprit):
    from offload_adamw import ParamGroupError
    from offload_adamw.integrations.hf import OffloadAdamWTrainer

    model = tiny_llama()
    before = params_of(model)
    trainer = OffloadAdamWTrainer(model=model, args=training_args(tmp_path), train_dataset=TokenWindows(),
                                  param_group_rules=rules, param_group_default=default)
    with pytest.raises(ParamGroupError, match=culprit.replace("*", r"\*").replace("[", r"\[").replace("]", r"\]")):
        trainer.train()
    assert_bitwise(params_of(model), before)


def test_an_optimizer_the_trainer_creates_again_keeps_the_rules_and_the_names(tmp_path):
    # With model_init every train() (and every hyperparameter-search trial) builds a fresh model and a fresh
    # optimizer: each must get the rule groups (here an lr of its own) and the names again, not the Trainer's
    # own unnamed groups with the rules dropped.
    from offload_adamw.integrations.hf import OffloadAdamWTrainer

    trainer = OffloadAdamWTrainer(model_init=tiny_llama, args=training_args(tmp_path), train_dataset=TokenWindows(),
                                  param_group_rules=[("lm_head.weight", {"lr": LR / 10})],
                                  offload_adamw_kwargs={"pin_memory": False})
    runs = []
    for _ in range(2):
        trainer.train()
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        runs.append((params_of(trainer.model), [(g.get("rule"), g["initial_lr"], g.get("param_names"))
                                                 for g in inner.param_groups]))
    assert runs[1][1] == runs[0][1] and runs[0][1][0][:2] == ("lm_head.weight", LR / 10)
    assert_bitwise(runs[1][0], runs[0][0])
