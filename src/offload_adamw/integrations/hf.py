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
* The hyperparameters are those ``optim="adamw_torch_fused"`` takes from the arguments:
  ``lr=args.learning_rate``, ``betas=(args.adam_beta1, args.adam_beta2)``,
  ``eps=args.adam_epsilon``; keyword arguments given to :func:`trainer_optimizer` (e.g.
  ``pin_memory=False``, ``offload_gradients=True``) are added or win. With OffloadAdamW's
  default path the training is bitwise that of ``optim="adamw_torch_fused"``.
* :class:`OffloadAdamWTrainer` is a ``Trainer`` that builds its optimizer this way when none
  is passed, for set-ups that only pass ``TrainingArguments`` (its ``offload_adamw_kwargs``
  argument is the keyword arguments above). It builds the groups from the model the Trainer
  hands to ``create_optimizer``, so it is the route when the Trainer wraps the model first
  (FSDP): :func:`trainer_optimizer` holds the parameters of the model it was given.
* transformers is imported when a function here is first called (``TrainerCls`` is built then).
"""

from __future__ import annotations

from collections.abc import Iterable
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
                         trainer: Any = None) -> list[dict[str, Any]]:
    """The Trainer's two groups (decay, no decay) of trainable parameters, with ``param_names``.

    ``decay_names`` defaults to ``Trainer.get_decay_parameter_names(model)`` (of ``trainer`` when given).
    """
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    decay = set(decay_names) if decay_names is not None else _decay_names(model, trainer)
    groups: list[dict[str, Any]] = []
    for wants_decay, value in ((True, weight_decay), (False, 0.0)):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and (n in decay) == wants_decay]
        if named:
            groups.append({"params": [p for _, p in named], "param_names": [n for n, _ in named], "weight_decay": value})
    if not groups:
        raise ValueError("the model has no trainable parameter")
    return groups


def trainer_optimizer(model: torch.nn.Module, args: Any, **optimizer_kwargs: Any) -> tuple[type, dict[str, Any]]:
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
    kwargs["params"] = trainer_param_groups(model, kwargs["weight_decay"], trainer=trainer)
    return OffloadAdamW, kwargs


def __getattr__(name: str) -> Any:
    if name == "OffloadAdamWTrainer":  # built on first use: the class needs transformers
        value = _make_trainer_class()
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_trainer_class() -> type:
    from transformers import Trainer

    class OffloadAdamWTrainer(Trainer):
        """A ``transformers.Trainer`` whose default optimizer is OffloadAdamW over :func:`trainer_optimizer`'s groups."""

        def __init__(self, *args: Any, offload_adamw_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.offload_adamw_kwargs = dict(offload_adamw_kwargs or {})

        def create_optimizer(self, model: Any = None) -> Any:
            if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
                # the Trainer has its model by the time it creates the optimizer (its stubs allow None)
                opt_model = cast("torch.nn.Module", self.model if model is None else model)
                self.optimizer_cls_and_kwargs = trainer_optimizer(opt_model, self.args, trainer=self,
                                                                  **self.offload_adamw_kwargs)
            return super().create_optimizer(model)

    OffloadAdamWTrainer.__module__ = __name__
    return OffloadAdamWTrainer
