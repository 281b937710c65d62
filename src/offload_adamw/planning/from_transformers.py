"""The model of a ``--config``: a config.json this planner reads itself, or, with transformers, anything else.

Contract: :func:`model_from_config` counts a config.json (or a directory holding one) with
:mod:`offload_adamw.planning.models` (no transformers needed); with transformers installed it also takes
whatever ``AutoConfig.from_pretrained`` reads (a model id, a cached model), and counts a config of an
architecture :mod:`~offload_adamw.planning.models` does not know from the transformers model built on the
meta device (torch and transformers are imported only then). Without transformers such a config is refused,
naming the model_type or key. Anything that cannot be counted raises ValueError naming the file or model id.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from offload_adamw.planning import models

__all__ = ["model_from_config"]


def _transformers_installed() -> bool:
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


def model_from_config(text: str) -> models.Model:
    """The model of ``--config TEXT``: a config.json, a directory holding one, or (with transformers) what
    AutoConfig reads; ValueError naming the file or the model id where none of them counts it."""
    if os.path.exists(text):
        raw, name = models.read_hf_config(text)
        try:
            return models.model_from_hf_dict(raw, name=name, source=text)
        except models.UnsupportedConfig as exc:
            if not _transformers_installed():
                raise ValueError(f"{exc}; with transformers installed it is counted from the model itself") from None
            from transformers import AutoConfig

            config = AutoConfig.for_model(**raw) if "model_type" in raw else None
            if config is None:
                raise
            return _meta_device_model(config, name)
    if not _transformers_installed():
        raise ValueError(f"--config {text!r}: no such file or directory (a model id needs transformers installed)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(text)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--config {text!r}: neither a file nor a directory, and AutoConfig cannot read it: "
                         f"{str(exc).splitlines()[0]}") from None
    name = text.rstrip("/").split("/")[-1]
    try:
        return models.model_from_hf_dict(config.to_dict(), name=name, source=text)
    except models.UnsupportedConfig:
        return _meta_device_model(config, name)


def _meta_device_model(config: Any, name: str) -> models.ParamShapesModel:
    """Names and shapes of the trainable tensors of the transformers model for ``config``, built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"--config: transformers cannot build a causal LM for model_type "
                         f"{getattr(config, 'model_type', '?')!r}: {str(exc).splitlines()[0]}") from None
    shapes = tuple((n, tuple(int(d) for d in p.shape)) for n, p in model.named_parameters() if p.requires_grad)
    return models.ParamShapesModel(name=name, shapes=shapes)
