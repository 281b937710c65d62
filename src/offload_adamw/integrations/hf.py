"""OffloadAdamW for ``transformers.Trainer``: the Trainer's own decay/no-decay split, with parameter names.

Contract:

* :func:`trainer_optimizer` returns ``(OffloadAdamW, kwargs)`` for
  ``Trainer(optimizer_cls_and_kwargs=...)``. ``kwargs["params"]`` holds the groups
  ``Trainer.create_optimizer`` builds itself: the names that ``get_decay_parameter_names``
  returns with ``args.weight_decay``, every other trainable parameter with 0.0, in
  ``named_parameters()`` order (an empty group is left out). Each group also carries
  ``param_names``, so the optimizer's state_dict is keyed by name (a resume after a
  refactor matches state by name, not by position). The Trainer takes ``params`` from the
  kwargs in place of its own unnamed groups.
* With ``param_group_rules`` (and ``param_group_default``), ordered name rules as
  :func:`~offload_adamw.named_param_groups` takes them (first match wins, a rule that takes no
  parameter is an error naming it), the parameters are first grouped by rule, and each rule's
  group is then split the Trainer's way: its decay names with ``args.weight_decay``, the rest with
  0.0, each with the rule's keys (``update_on``, ``lr``, ...). This is how a placement mix the
  planner prints (``offload-adamw plan``) reaches the Trainer. A rule (or the default) that sets
  ``weight_decay`` is refused, naming it: the Trainer's split sets it. ``param_group_default`` holds
  the keys of the parameters no rule takes; None means none beyond the Trainer's (unlike
  ``named_param_groups(default=None)``, where an unmatched parameter is an error).
* The hyperparameters are those ``optim="adamw_torch_fused"`` takes from the arguments:
  ``lr=args.learning_rate``, ``betas=(args.adam_beta1, args.adam_beta2)``,
  ``eps=args.adam_epsilon``; keyword arguments given to :func:`trainer_optimizer` (e.g.
  ``pin_memory=False``, ``offload_gradients=True``) are added or win. With OffloadAdamW's
  default path the training is bitwise that of ``optim="adamw_torch_fused"``.
* :class:`OffloadAdamWTrainer` is a ``Trainer`` that builds its optimizer this way when none
  is passed (each time the Trainer creates one: with ``model_init``, every ``train()``), for set-ups
  that only pass ``TrainingArguments`` (its ``offload_adamw_kwargs``
  argument is the keyword arguments above). It builds the groups from the model the Trainer
  hands to ``create_optimizer`` and tells the optimizer that model's parameter order for
  clipping (``opt.clip_order(model)``); under FSDP2 accelerate then swaps the optimizer's
  parameters for the shards (accel/swaps.py releases the originals).
* Updates during backward (``offload_adamw_kwargs={"offload_gradients": True,
  "update_in_backward": True}``) run under :class:`OffloadAdamWTrainer` only: the Trainer clips
  (or, with ``max_grad_norm=0``, measures the norm to log it) after backward, when the updates
  may already have consumed the gradients. So the optimizer clips instead: its ``max_grad_norm``
  is the Trainer's ``args.max_grad_norm`` (when positive; a different one given in the kwargs is
  refused), its norms are taken by backward's hooks and reduced in the model's order, which is
  torch's clipping of ``model.parameters()`` bit for bit, and the ``grad_norm`` the Trainer logs
  is the optimizer's ``last_grad_norm`` of that step (filled in when the step has run, before the
  Trainer logs it). A micro-batch that only accumulates (``gradient_accumulation_steps``: the
  Trainer's ``accelerator.sync_gradients`` is False) runs inside ``opt.no_sync()``, so its
  gradients start no update; under FSDP2 accelerate's ``no_sync`` also holds the reduce-scatter
  back. This needs a transformers whose Trainer clips through ``_clip_grad_norm`` and
  ``_get_grad_norm`` (5.x); with another the route is refused when the optimizer is created.
* transformers is imported when a function here is first called (``TrainerCls`` is built then).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["trainer_param_groups", "trainer_optimizer", "OffloadAdamWTrainer"]  # noqa: F822 (module __getattr__)


def _decay_names(model: torch.nn.Module, trainer: Any = None) -> set[str]:
    if trainer is not None:
        return set(trainer.get_decay_parameter_names(model))
    from transformers import Trainer

    # The Trainer's own split; the method reads only the model (no Trainer state), so no Trainer is needed yet.
    return set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # self is unused, see above


def trainer_param_groups(model: torch.nn.Module, weight_decay: float, *, decay_names: Iterable[str] | None = None,
                         trainer: Any = None, rules: Any = None, default: Mapping[str, Any] | None = None,
                         ) -> list[dict[str, Any]]:
    """The Trainer's two groups (decay, no decay) of trainable parameters, with ``param_names``.

    ``decay_names`` defaults to ``Trainer.get_decay_parameter_names(model)`` (of ``trainer`` when given).
    With ``rules`` (and ``default``, as :func:`~offload_adamw.named_param_groups` takes them: the planner
    prints them for a placement mix) each rule's group is split the Trainer's way in turn: see the module
    docstring.
    """
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    decay = set(decay_names) if decay_names is not None else _decay_names(model, trainer)
    named: list[dict[str, Any]]
    if rules is None and default is None:
        named = [{"params": [p for _, p in model.named_parameters() if p.requires_grad],
                  "param_names": [n for n, p in model.named_parameters() if p.requires_grad]}]
    else:
        named = _rule_groups(model, [] if rules is None else rules, default)
    groups: list[dict[str, Any]] = []
    for base in named:
        for wants_decay, value in ((True, weight_decay), (False, 0.0)):
            picked = [i for i, n in enumerate(base["param_names"]) if (n in decay) == wants_decay]
            if not picked:
                continue
            group = {k: v for k, v in base.items() if k not in ("params", "param_names", "tied_names")}
            group["params"] = [base["params"][i] for i in picked]
            group["param_names"] = [base["param_names"][i] for i in picked]
            if "tied_names" in base:
                group["tied_names"] = {n: base["tied_names"][n] for n in group["param_names"] if n in base["tied_names"]}
            group["weight_decay"] = value
            groups.append(group)
    if not groups:
        raise ValueError("the model has no trainable parameter")
    return groups


def _rule_groups(model: torch.nn.Module, rules: Any, default: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """``named_param_groups(model, rules, default)``, refusing a rule that sets what the Trainer's split sets."""
    from offload_adamw.optim.named_groups import ParamGroupError, as_rules, named_param_groups

    parsed = as_rules(rules)  # a malformed rule is named there
    for where, hyper in [*((f"param_group_rules[{i}] {r.text!r}", r.hyper) for i, r in enumerate(parsed)),
                         ("param_group_default", default or {})]:
        if "weight_decay" in hyper:
            raise ParamGroupError(
                f"{where} sets weight_decay, which the Trainer's decay split sets (args.weight_decay for the decay "
                "parameters, 0 for biases and norms): set it in TrainingArguments, or build every group yourself "
                "with named_param_groups and pass optimizer_cls_and_kwargs")
    return named_param_groups(model, parsed, default={} if default is None else default)


def trainer_optimizer(model: torch.nn.Module, args: Any, *, param_group_rules: Any = None,
                      param_group_default: Mapping[str, Any] | None = None,
                      **optimizer_kwargs: Any) -> tuple[type, dict[str, Any]]:
    """``(OffloadAdamW, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``; see the module docstring."""
    from offload_adamw.optim.optimizer import OffloadAdamW

    trainer = optimizer_kwargs.pop("trainer", None)
    kwargs: dict[str, Any] = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
    }
    kwargs.update(optimizer_kwargs)
    kwargs["params"] = trainer_param_groups(model, kwargs["weight_decay"], trainer=trainer, rules=param_group_rules,
                                            default=param_group_default)
    return OffloadAdamW, kwargs


def _offload_adamw(optimizer: Any) -> Any:
    """The OffloadAdamW inside the Trainer's optimizer (accelerate wraps it), or None."""
    from offload_adamw.optim.optimizer import OffloadAdamW

    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, OffloadAdamW) else None


def _updates_in_backward(optimizer: Any) -> bool:
    ours = _offload_adamw(optimizer)
    return ours is not None and ours.update_in_backward


def _clipping_options(trainer: Any, options: dict[str, Any]) -> dict[str, Any]:
    """With updates during backward the optimizer clips in the Trainer's place, with the Trainer's ``max_grad_norm``."""
    if not options.get("update_in_backward"):
        return options
    if not (hasattr(trainer, "_clip_grad_norm") and hasattr(trainer, "_get_grad_norm")):
        raise RuntimeError(
            "OffloadAdamWTrainer with update_in_backward=True needs a transformers Trainer that clips through "
            "_clip_grad_norm and _get_grad_norm (transformers 5); this one clips inline, after the updates ran: "
            "upgrade transformers, or use update_in_backward=False"
        )
    trainer_norm = trainer.args.max_grad_norm
    if trainer_norm is not None and trainer_norm > 0:
        given = options.setdefault("max_grad_norm", float(trainer_norm))
        if given != trainer_norm:
            raise ValueError(
                f"offload_adamw_kwargs max_grad_norm={given!r} differs from the Trainer's max_grad_norm={trainer_norm!r}: "
                "with update_in_backward=True the optimizer clips in the Trainer's place; give one of them"
            )
    return options


def __getattr__(name: str) -> Any:
    if name == "OffloadAdamWTrainer":  # built on first use: the class needs transformers
        value = _make_trainer_class()
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_trainer_class() -> type:
    from transformers import Trainer

    class OffloadAdamWTrainer(Trainer):
        """A ``transformers.Trainer`` whose default optimizer is OffloadAdamW over :func:`trainer_optimizer`'s groups
        (see the module contract, also for updates during backward)."""

        def __init__(self, *args: Any, offload_adamw_kwargs: dict[str, Any] | None = None,
                     param_group_rules: Any = None, param_group_default: Mapping[str, Any] | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.offload_adamw_kwargs = dict(offload_adamw_kwargs or {})
            self.param_group_rules = param_group_rules
            self.param_group_default = param_group_default
            # Whether this Trainer builds the optimizer itself: the Trainer pops ``params`` from the kwargs it is
            # given, so the kwargs of one build cannot build the next (model_init makes one per train() call).
            self._builds_optimizer = self.optimizer_cls_and_kwargs is None
            self._step_norm: Any = None  # the grad_norm handed to the Trainer, filled in after the step

        def create_optimizer(self, model: Any = None) -> Any:
            if self.optimizer is None and self._builds_optimizer:
                # the Trainer has its model by the time it creates the optimizer (its stubs allow None)
                opt_model = cast("torch.nn.Module", self.model if model is None else model)
                options = _clipping_options(self, dict(self.offload_adamw_kwargs))
                self.optimizer_cls_and_kwargs = trainer_optimizer(
                    opt_model, self.args, trainer=self, param_group_rules=self.param_group_rules,
                    param_group_default=self.param_group_default, **options)
                optimizer = super().create_optimizer(model)
                ours = _offload_adamw(optimizer)
                if ours is not None:
                    ours.clip_order(opt_model)
                    ours.register_step_post_hook(lambda opt, args, kwargs: self._fill_step_norm(opt))
                return optimizer
            return super().create_optimizer(model)

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            ours = _offload_adamw(self.optimizer)
            if ours is not None and ours.update_in_backward and not self.accelerator.sync_gradients:
                with ours.no_sync():  # a micro-batch that only accumulates: no update may start in its backward
                    return super().training_step(*args, **kwargs)
            return super().training_step(*args, **kwargs)

        def _clip_grad_norm(self, model: Any) -> Any:
            if _updates_in_backward(self.optimizer):
                return self._norm_after_step()  # the optimizer clipped with args.max_grad_norm (see create_optimizer)
            return super()._clip_grad_norm(model)

        def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
            if grad_norm is None and _updates_in_backward(self.optimizer):
                grad_norm = self._norm_after_step()
            return super()._get_grad_norm(model, grad_norm=grad_norm)

        def _norm_after_step(self) -> Any:
            import torch

            self._step_norm = torch.full((), float("nan"))
            return self._step_norm

        def _fill_step_norm(self, optimizer: Any) -> None:
            held, self._step_norm = self._step_norm, None
            norm = optimizer.last_grad_norm
            if held is not None and norm is not None:
                full = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor, reduced over the ranks as torch's is
                held.copy_((norm if full is None else full()).detach().to(held.device, held.dtype))

    OffloadAdamWTrainer.__module__ = __name__
    return OffloadAdamWTrainer
