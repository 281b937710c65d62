"""The 2-process half of test_integrations_fsdp.py: the real HF Trainer and accelerate on FSDP2 (gloo, the CPU).

Run as ``python tests/support/_integrations_fsdp_worker.py --out DIR [--only CASE ...]``: two ranks run the cases of
``CASES`` in turn and write ``DIR/fsdp_rank{r}.json`` = ``{case: {"ok": bool, "error": str, "measured": {...}}}``.
A case trains a tiny Llama with ``transformers.Trainer`` (accelerate prepares and shards it with FSDP2) and
compares every local shard bitwise with the same Trainer run with ``optim="adamw_torch_fused"`` (cached per
configuration), or checks a refusal.

accelerate enables FSDP only for accelerator devices (its ``AcceleratorState`` sets ``DistributedType.FSDP`` for
MULTI_GPU and the like, not MULTI_CPU). :func:`allow_fsdp_on_cpu` is the one test-only patch: after
``AcceleratorState`` has initialised a CPU process group, it takes the FSDP plugin it was given and records the
distributed type FSDP where accelerate itself records it (also in ``PartialState``'s shared state, which every
``AcceleratorState()`` copies from), as it would on GPUs. Everything else (FSDP2's ``fully_shard`` over gloo, the
optimizer swap, accelerate's ``no_sync``, the Trainer's loop) runs unpatched.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the Trainer tests' dataset and arguments
from _distributed_common import CaseResults, worker_main

WORLD = 2
STEPS = 4
CLIP = 0.05


def allow_fsdp_on_cpu() -> None:
    """Test only: let accelerate use the FSDP plugin on a CPU (gloo) process group (see the module docstring)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def patched(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = patched  # type: ignore[method-assign]


def fresh_accelerate_state() -> None:
    """Each Trainer its own AcceleratorState (another FSDP plugin); the process group stays."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    if PartialState._shared_state.get("distributed_type") == DistributedType.FSDP:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU  # as the process group was set up


# ------------------------------------------------------------------------------------------------- one run


def tiny_llama() -> torch.nn.Module:
    """test_integrations_trainer.py's Llama with an odd vocabulary: FSDP2 gives the two ranks unequal embedding and head
    shards (129 and 128 rows), so the per-rank host bill is checked where the ranks differ."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class FirstStepFreed:
    """A TrainerCallback: whether every gradient of the first step was in host memory before the step."""

    def __init__(self) -> None:
        self.freed: bool | None = None

    def callback(self) -> Any:
        from transformers import TrainerCallback

        from offload_adamw import is_host_resident

        outer = self

        class Check(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
                if outer.freed is None and model is not None:
                    outer.freed = all(is_host_resident(p.grad) for p in model.parameters() if p.grad is not None)

        return Check()


class Run:
    """One Trainer run's outcome on this rank."""

    def __init__(self, trainer: Any, model: torch.nn.Module, alive_originals: int, shapes: list[tuple[int, ...]]):
        self.trainer = trainer
        self.alive_originals = alive_originals
        self.shapes = shapes
        self.local = {n: p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
                      for n, p in trainer.model.named_parameters()}
        self.grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        self.optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def run(tmp: Path, tag: str, *, route: str, max_grad_norm: float = 0.0, accumulation: int = 1,
        offload_kwargs: dict[str, Any] | None = None, fsdp_version: int = 2, use_orig_params: bool = True,
        steps: int = STEPS, callbacks: tuple = (), save_steps: int = 0, resume: str | None = None,
        state_dict_type: str | None = None, stop_at: int = 0) -> Run:
    """Train the tiny Llama of test_integrations_trainer.py with the Trainer on FSDP (``route``: how the optimizer is
    given: ``torch`` = optim="adamw_torch_fused", ``trainer_class`` = OffloadAdamWTrainer, ``cls_and_kwargs`` =
    optimizer_cls_and_kwargs=(OffloadAdamW, kwargs), ``trainer_optimizer`` = trainer_optimizer(model, args))."""
    from transformers import Trainer

    from offload_adamw import OffloadAdamW
    from offload_adamw.integrations.hf import OffloadAdamWTrainer, trainer_optimizer
    from test_integrations_trainer import TokenWindows, training_args

    fresh_accelerate_state()
    model = tiny_llama()
    shapes = [tuple(p.shape) for p in model.parameters()]
    originals = [weakref.ref(p) for p in model.parameters()]
    fsdp_config: dict[str, Any] = {"version": fsdp_version, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    if fsdp_version == 1:
        fsdp_config["use_orig_params"] = use_orig_params
    if state_dict_type is not None:
        fsdp_config["state_dict_type"] = state_dict_type
    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    args = training_args(tmp / tag, max_steps=steps, max_grad_norm=max_grad_norm, gradient_accumulation_steps=accumulation,
                         fsdp=True, fsdp_config=fsdp_config, optim="adamw_torch_fused", **saving)
    kwargs = dict(offload_kwargs or {})
    data = TokenWindows(n=WORLD * 4 * accumulation * steps)
    if stop_at:
        from test_integrations_trainer import StopAt

        callbacks = (*callbacks, StopAt(stop_at))  # saves a checkpoint there and stops, as a preempted job would
    common = {"model": model, "args": args, "train_dataset": data, "callbacks": list(callbacks)}
    if route == "torch":
        trainer = Trainer(**common)
    elif route == "trainer_class":
        trainer = OffloadAdamWTrainer(**common, offload_adamw_kwargs=kwargs)
    elif route == "trainer_optimizer":
        trainer = Trainer(**common, optimizer_cls_and_kwargs=trainer_optimizer(model, args, **kwargs))
    elif route == "cls_and_kwargs":
        kwargs.update(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        trainer = Trainer(**common, optimizer_cls_and_kwargs=(OffloadAdamW, kwargs))
    else:
        raise ValueError(route)
    del model
    trainer.train(resume_from_checkpoint=resume)
    gc.collect()
    return Run(trainer, trainer.model, sum(r() is not None for r in originals), shapes)


def differing(ours: Run, theirs: Run) -> list[str]:
    out = []
    for name, a in ours.local.items():
        b = theirs.local[name]
        if a.shape != b.shape or not torch.equal(a, b):
            out.append(f"{name}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}")
    if ours.grad_norms != theirs.grad_norms:
        out.append(f"logged grad_norm {ours.grad_norms} != torch's {theirs.grad_norms}")
    return out


_REFERENCES: dict[tuple, Run] = {}


def reference(tmp: Path, *, max_grad_norm: float = 0.0, accumulation: int = 1, fsdp_version: int = 2) -> Run:
    key = (max_grad_norm, accumulation, fsdp_version)
    if key not in _REFERENCES:
        _REFERENCES[key] = run(tmp, f"torch-{key}", route="torch", max_grad_norm=max_grad_norm, accumulation=accumulation,
                               fsdp_version=fsdp_version)
    return _REFERENCES[key]


def host_bill(ours: Run, measured: dict, *, host_accumulation: bool = False) -> list[str]:
    """OffloadAdamW's host bytes on this rank against the planner's per-rank formula for this rank's shards."""
    from offload_adamw.planning.planner import fsdp_rank_host_bytes

    opt = ours.optimizer
    bill = fsdp_rank_host_bytes(ours.shapes, world=WORLD, rank=dist.get_rank(), param_dtype="float32", on_host=True,
                                host_accumulation=host_accumulation)
    measured.update(buffers=opt.host_buffer_bytes(), state=opt.host_state_bytes(), bill=bill.as_dict(),
                    alive_originals=ours.alive_originals)
    out = []
    if opt.host_buffer_bytes() != bill.buffers():
        out.append(f"host buffers {opt.host_buffer_bytes()} != the planner's {bill.buffers()} for this rank's shards")
    if opt.host_state_bytes() != bill.state:
        out.append(f"host state {opt.host_state_bytes()} != the planner's {bill.state}")
    if ours.alive_originals:
        out.append(f"{ours.alive_originals} parameters of the unsharded model are still alive after training")
    return out


# ----------------------------------------------------------------------------------------------- the cases


def case_swap_releases_the_unsharded_model(tmp: Path, measured: dict) -> list[str]:
    theirs = reference(tmp)
    if theirs.alive_originals:
        return [f"torch's run keeps {theirs.alive_originals} original parameters alive: the check cannot tell"]
    first = FirstStepFreed()
    ours = run(tmp, "freed", route="trainer_class", offload_kwargs={"offload_gradients": True},
               callbacks=(first.callback(),))
    measured["first_step_freed"] = first.freed
    freed = [] if first.freed else ["the first step's gradients were not in host memory before the step"]
    return differing(ours, theirs) + host_bill(ours, measured) + freed


def case_kept_gradients_release_the_unsharded_model(tmp: Path, measured: dict) -> list[str]:
    ours = run(tmp, "kept", route="trainer_class", offload_kwargs={"transfer_pipeline": True})
    return differing(ours, reference(tmp)) + host_bill(ours, measured)


def case_freed_trainer_clips_with_accumulation(tmp: Path, measured: dict) -> list[str]:
    """The Trainer's own clipping (torch's clip_grad_norm_ on the DTensor stand-ins) and accumulation 4 (accelerate's
    no_sync: FSDP2 reduces once, so no host accumulation buffer)."""
    ours = run(tmp, "freed-clip-acc4", route="trainer_class", max_grad_norm=CLIP, accumulation=4,
               offload_kwargs={"offload_gradients": True})
    return differing(ours, reference(tmp, max_grad_norm=CLIP, accumulation=4)) + host_bill(ours, measured)


def updates_in_backward(max_grad_norm: float, accumulation: int) -> Callable[[Path, dict], list[str]]:
    """OffloadAdamWTrainer with update_in_backward: the optimizer clips with the Trainer's max_grad_norm in the model's
    order, the logged grad_norm is the norm the hooks took (a DTensor reduced over the ranks), every micro-batch but
    the last inside opt.no_sync(); updates start before step() from the second step on."""

    def case(tmp: Path, measured: dict) -> list[str]:
        armed: list[bool] = []

        from transformers import TrainerCallback

        class Armed(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
                pipeline = getattr(optimizer, "optimizer", optimizer).transfer_pipeline
                armed.append(pipeline.armed() and (not max_grad_norm or pipeline.gate_taken()))

        ours = run(tmp, f"uib-{max_grad_norm}-{accumulation}", route="trainer_class", max_grad_norm=max_grad_norm,
                   accumulation=accumulation, callbacks=(Armed(),),
                   offload_kwargs={"offload_gradients": True, "update_in_backward": True})
        measured["armed"] = armed
        out = differing(ours, reference(tmp, max_grad_norm=max_grad_norm, accumulation=accumulation))
        if armed != [False] + [True] * (STEPS - 1):
            out.append(f"the updates did not start before step() from the second step on: {armed}")
        if max_grad_norm and min(ours.grad_norms) <= max_grad_norm:
            out.append(f"clipping was not exercised: grad norms {ours.grad_norms}")
        return out + host_bill(ours, measured)

    return case


def optimizer_clips(pipeline: dict[str, Any]) -> Callable[[Path, dict], list[str]]:
    """OffloadAdamW(max_grad_norm=CLIP) given as optimizer_cls_and_kwargs: the Trainer builds its decay / no-decay groups
    (not the model's order) and only logs the norm (max_grad_norm=0); the optimizer finds the model and clips in its
    order, which is the Trainer's own clipping with torch's AdamW (max_grad_norm=CLIP), bitwise."""

    def case(tmp: Path, measured: dict) -> list[str]:
        from transformers import TrainerCallback

        differ: list[bool] = []
        clipped_at: list[float] = []

        class Orders(TrainerCallback):
            """Before each step: whether the groups' order and the model's give different total-norm bits; after it, the
            norm the optimizer clipped with (the Trainer logs torch's, in the model's order)."""

            def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
                inner = getattr(optimizer, "optimizer", optimizer)
                totals = []
                for params in ([p for g in inner.param_groups for p in g["params"]], list(model.parameters())):
                    with torch.no_grad():
                        totals.append(torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor())
                differ.append(not torch.equal(*totals))

            def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
                clipped_at.append(getattr(optimizer, "optimizer", optimizer).last_grad_norm.full_tensor().item())

        ours = run(tmp, f"cls-{sorted(pipeline)}", route="cls_and_kwargs", offload_kwargs={"max_grad_norm": CLIP, **pipeline},
                   callbacks=(Orders(),))
        measured.update(orders_differ=differ, clipped_at=clipped_at)
        out = [] if any(differ) else ["the groups' order and the model's give the same norm bits here: the case cannot fail"]
        if clipped_at != ours.grad_norms:
            out.append(f"the optimizer clipped with norms {clipped_at}, torch's clipping of the model has {ours.grad_norms}")
        return out + differing(ours, reference(tmp, max_grad_norm=CLIP)) + host_bill(ours, measured)

    return case


def fsdp1_llama(use_orig_params: bool) -> torch.nn.Module:
    """The tiny Llama under FSDP1 (torch's FullyShardedDataParallel, one unit per decoder layer), on the CPU.

    accelerate's FSDP1 path on the CPU stops at FSDP1's device check (its device_id is "cpu:0"), so FSDP1 is wrapped
    here the way accelerate wraps it on GPUs, without accelerate."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FullyShardedDataParallel(tiny_llama(), auto_wrap_policy=policy, use_orig_params=use_orig_params,
                                    device_id=torch.device("cpu"))


def fsdp1_train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = STEPS, seen: list | None = None) -> None:
    from offload_adamw import is_host_resident

    for step in range(steps):
        ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        model(input_ids=ids, labels=ids).loss.backward()
        if seen is not None:
            seen.append(sum(is_host_resident(p.grad) for p in model.parameters()))
        model.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()


def case_fsdp1_orig_params(tmp: Path, measured: dict) -> list[str]:
    """FSDP1 with use_orig_params=True: the optimizer holds the original parameters (views of the flat shard);
    freed gradients and FSDP1's own clipping give torch's AdamW bitwise."""
    from offload_adamw import OffloadAdamW

    reference, model = fsdp1_llama(True), fsdp1_llama(True)
    fsdp1_train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True))
    freed: list[int] = []
    fsdp1_train(model, OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload_gradients=True), seen=freed)
    measured["freed_in_backward"] = freed
    out = []
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        if not torch.equal(p, q):
            out.append(f"{name}: max |diff| {(p - q).abs().max().item():.3g}")
    return out


def case_fsdp1_flat_params_refused(tmp: Path, measured: dict) -> list[str]:
    """FSDP1 with use_orig_params=False hands the optimizer FlatParameters, whose gradient in backward has the
    unsharded size: the pipeline refuses them by name when it is built; the plain step works (torch's)."""
    from offload_adamw import OffloadAdamW

    model = fsdp1_llama(False)
    try:
        OffloadAdamW(model.parameters(), lr=1e-2, offload_gradients=True)
    except ValueError as exc:
        measured["error"] = str(exc)
        if "use_orig_params" not in str(exc) or "FlatParameter" not in str(exc):
            return [f"refused without naming FlatParameter and use_orig_params: {exc}"]
    else:
        return ["FSDP1 with use_orig_params=False and the transfer pipeline was not refused"]
    reference = fsdp1_llama(False)
    fsdp1_train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True))
    fsdp1_train(model, OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return [f"plain step: {n} differs" for (n, p), q in zip(reference.named_parameters(), model.parameters())
            if not torch.equal(p, q)]


def case_optimizers_tuple_is_refused_by_transformers(tmp: Path, measured: dict) -> list[str]:
    """Trainer(optimizers=(opt, scheduler)) under FSDP: transformers refuses it (the routes that work are
    OffloadAdamWTrainer, trainer_optimizer and optimizer_cls_and_kwargs)."""
    from transformers import Trainer, get_linear_schedule_with_warmup

    from offload_adamw import OffloadAdamW
    from test_integrations_trainer import TokenWindows, training_args

    fresh_accelerate_state()
    model = tiny_llama()
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    args = training_args(tmp / "tuple", max_steps=STEPS, fsdp=True,
                         fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    try:
        Trainer(model=model, args=args, train_dataset=TokenWindows(),
                optimizers=(opt, get_linear_schedule_with_warmup(opt, 0, STEPS)))
    except RuntimeError as exc:
        measured["error"] = str(exc)
        return [] if "Passing `optimizers` is not allowed if PyTorch FSDP is enabled" in str(exc) else [str(exc)]
    return ["transformers accepted optimizers=(opt, scheduler) under FSDP: the docs say it refuses"]


def accelerate_loop(optimizer_factory: Callable, steps: int = STEPS) -> tuple[dict[str, torch.Tensor], list[float], int]:
    """accelerate without the Trainer: prepare(model, optimizer) on FSDP2, backward, clip_grad_norm_, step."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    fresh_accelerate_state()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = tiny_llama()
    originals = [weakref.ref(p) for p in model.parameters()]
    model, opt = accelerator.prepare(model, optimizer_factory(model))
    norms = []
    for step in range(steps):
        ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
        # a DTensor (torch's clip_grad_norm_) from older accelerate; 1.16 reduces it to a plain tensor
        norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
        opt.step()
        opt.zero_grad()
    gc.collect()
    local = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    return local, norms, sum(r() is not None for r in originals)


def case_accelerate_prepare_on_fsdp2(tmp: Path, measured: dict) -> list[str]:
    from offload_adamw import OffloadAdamW
    from offload_adamw.integrations.hf import trainer_param_groups

    theirs, their_norms, _ = accelerate_loop(
        lambda m: torch.optim.AdamW(trainer_param_groups(m, 0.1), lr=1e-2, fused=True))
    ours, our_norms, alive = accelerate_loop(
        lambda m: OffloadAdamW(trainer_param_groups(m, 0.1), lr=1e-2, offload_gradients=True))
    measured.update(norms=our_norms, alive_originals=alive)
    out = [f"{n} differs" for n in ours if not torch.equal(ours[n], theirs[n])]
    if our_norms != their_norms:
        out.append(f"clip norms {our_norms} != torch's {their_norms}")
    if min(our_norms) <= CLIP:
        out.append("clipping was not exercised")
    if alive:
        out.append(f"{alive} parameters of the unsharded model are alive after accelerate's swap")
    return out


def case_a_released_sharded_host_gradient_comes_back_as_a_dtensor(tmp: Path, measured: dict) -> list[str]:
    """FSDP2 by hand: a swap between backward and step gives the released shards their gradients back in p.grad, as
    DTensors over real local tensors, bitwise the host gradients."""
    from torch.distributed.fsdp import fully_shard

    from offload_adamw import OffloadAdamW, is_host_resident

    def sharded(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        fully_shard(net)
        return net

    first, second, reference = sharded(0), sharded(1), sharded(0)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    reference(x).square().mean().backward()
    opt = OffloadAdamW(first.parameters(), lr=1e-2, offload_gradients=True)
    first(x).square().mean().backward()
    held = [opt.gradient(p).clone() for p in first.parameters()]
    if not all(is_host_resident(p.grad) for p in first.parameters()):
        return ["the gradients were not freed"]
    opt.param_groups[0]["params"] = list(second.parameters())
    second(x)  # a forward: the pipeline looks at param_groups
    out = []
    for (name, p), q, h in zip(first.named_parameters(), reference.parameters(), held):
        if is_host_resident(p.grad) or not hasattr(p.grad, "to_local"):
            out.append(f"{name}: p.grad is {type(p.grad).__name__}, not a DTensor over a real shard")
        elif not (torch.equal(p.grad.to_local(), h) and torch.equal(p.grad.to_local(), q.grad.to_local())):
            out.append(f"{name}: the gradient given back differs")
    return out


def resumes(state_dict_type: str) -> Callable[[Path, dict], list[str]]:
    """The Trainer's own FSDP2 checkpoint (accelerate's save_fsdp_model / save_fsdp_optimizer, ``state_dict_type``)
    at step 2 of 4 and resume_from_checkpoint: the resumed run ends bitwise where the uninterrupted one ends."""

    def case(tmp: Path, measured: dict) -> list[str]:
        kwargs = {"offload_gradients": True}
        straight = run(tmp, f"straight-{state_dict_type}", route="trainer_class", offload_kwargs=kwargs,
                       max_grad_norm=CLIP, state_dict_type=state_dict_type)
        tag = f"interrupted-{state_dict_type}"
        run(tmp, tag, route="trainer_class", offload_kwargs=kwargs, max_grad_norm=CLIP, save_steps=1000, stop_at=2,
            state_dict_type=state_dict_type)
        dist.barrier()
        checkpoint = tmp / tag / "checkpoint-2"
        measured["checkpoint"] = sorted(p.name for p in checkpoint.iterdir()) if checkpoint.is_dir() else None
        resumed = run(tmp, tag, route="trainer_class", offload_kwargs=kwargs, max_grad_norm=CLIP, save_steps=1000,
                      resume=str(checkpoint), state_dict_type=state_dict_type)
        out = [f"{n} differs after the resume" for n in straight.local if not torch.equal(straight.local[n], resumed.local[n])]
        return out + differing(straight, reference(tmp, max_grad_norm=CLIP))

    return case


CASES: dict[str, Callable[[Path, dict], list[str]]] = {
    "trainer_fsdp2_checkpoint_sharded_state_dict_resumes_bitwise": resumes("SHARDED_STATE_DICT"),
    "trainer_fsdp2_checkpoint_full_state_dict_resumes_bitwise": resumes("FULL_STATE_DICT"),
    "optimizers_tuple_under_fsdp_is_refused_by_transformers": case_optimizers_tuple_is_refused_by_transformers,
    "accelerate_prepare_fsdp2_freed_clip_is_torch_and_releases_the_unsharded_model": case_accelerate_prepare_on_fsdp2,
    "a_released_sharded_host_gradient_comes_back_as_a_dtensor": case_a_released_sharded_host_gradient_comes_back_as_a_dtensor,
    "fsdp1_use_orig_params_true_freed": case_fsdp1_orig_params,
    "fsdp1_use_orig_params_false_refused_by_name": case_fsdp1_flat_params_refused,
    "freed_trainer_class_releases_the_unsharded_model_and_allocates_the_planners_bill":
        case_swap_releases_the_unsharded_model,
    "kept_trainer_class_releases_the_unsharded_model_and_allocates_the_planners_bill":
        case_kept_gradients_release_the_unsharded_model,
    "freed_trainer_clipping_accumulation_4": case_freed_trainer_clips_with_accumulation,
    "uib_trainer_class_unclipped_acc1": updates_in_backward(0.0, 1),
    "uib_trainer_class_clipped_acc1": updates_in_backward(CLIP, 1),
    "uib_trainer_class_unclipped_acc4": updates_in_backward(0.0, 4),
    "uib_trainer_class_clipped_acc4": updates_in_backward(CLIP, 4),
    "max_grad_norm_in_the_model_order_freed": optimizer_clips({"offload_gradients": True}),
    "max_grad_norm_in_the_model_order_kept": optimizer_clips({"transfer_pipeline": True}),
}


#: what CI runs (one worker start, about a minute on 2 busy cores); the whole table is marked slow
QUICK = [
    "optimizers_tuple_under_fsdp_is_refused_by_transformers",
    "accelerate_prepare_fsdp2_freed_clip_is_torch_and_releases_the_unsharded_model",
    "a_released_sharded_host_gradient_comes_back_as_a_dtensor",
    "fsdp1_use_orig_params_false_refused_by_name",
    "freed_trainer_class_releases_the_unsharded_model_and_allocates_the_planners_bill",
    "uib_trainer_class_clipped_acc4",
    "max_grad_norm_in_the_model_order_freed",
]


def worker(rank: int, port: int, out: str, only: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)  # accelerate's PartialState takes this one
    allow_fsdp_on_cpu()
    tmp = Path(out) / "runs"  # one output directory for both ranks, as on a node (FSDP checkpoints hold every rank's shards)
    cases = CaseResults(Path(out) / f"fsdp_rank{rank}.json", only)
    for name, case in CASES.items():
        cases.judge(name, case, tmp)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def main() -> None:
    worker_main(worker, world=WORLD, quick=QUICK)


if __name__ == "__main__":
    main()
