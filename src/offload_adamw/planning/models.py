"""The models the planner counts: parameter names and shapes from presets, Hugging Face configs, or a count.

Contract:

* Pure computation on plain numbers: no torch import, no I/O except :func:`read_hf_config` (and
  :func:`model_from_hf_config`), which read one ``config.json``.
* A model is a :class:`ModelConfig` (a Llama-style decoder, optionally mixture-of-experts or latent
  attention, described by Hugging Face config fields), a :class:`ParamShapesModel` (names and shapes read
  from a model built elsewhere) or a :class:`ParamCountModel` (a parameter count only). Each gives
  ``parameter_shapes()`` (in the order transformers' ``named_parameters()`` lists them, for a ModelConfig),
  ``num_parameters()`` and ``largest_unit_parameters()`` (the largest FSDP unit).
* :func:`model_from_hf_dict` counts exactly what transformers builds for the model types it names, and
  raises :class:`UnsupportedConfig` naming the model_type or key for any other: a wrong count is worse than
  none. A config file that cannot be read raises ValueError naming the file.
* :class:`ParamSpec` is one tensor as the optimizer sees it (shape, dtype, placement), for the state bills.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

__all__ = [
    "ParamSpec",
    "ModelConfig",
    "ParamCountModel",
    "ParamShapesModel",
    "Model",
    "PRESETS",
    "DENSE_MODEL_TYPES",
    "MOE_MODEL_TYPES",
    "UnsupportedConfig",
    "dtype_name",
    "dtype_bytes",
    "param_specs_from_tensors",
    "read_hf_config",
    "model_from_hf_config",
    "model_from_hf_dict",
]

_DTYPE_ALIASES = {
    "float64": "float64", "fp64": "float64", "double": "float64",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(dtype: Any) -> str:
    """Canonical name of a floating dtype given as a string ("bf16", "torch.bfloat16") or a torch.dtype."""
    text = str(dtype).removeprefix("torch.").lower()
    if text not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(set(_DTYPE_ALIASES.values()))}")
    return _DTYPE_ALIASES[text]


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a floating dtype."""
    return _DTYPE_BYTES[dtype_name(dtype)]


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One parameter tensor as the optimizer sees it."""

    name: str
    """Fully qualified name (for messages)."""
    shape: tuple[int, ...]
    """Shape of the tensor the optimizer updates (the local shard under FSDP)."""
    dtype: str = "bfloat16"
    """The parameter's dtype (any spelling :func:`dtype_name` accepts)."""
    on_host: bool = False
    """Whether the parameter itself lives in host memory (CPU tensor)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_specs_from_tensors(named_tensors: Iterable[Any]) -> list[ParamSpec]:
    """ParamSpecs of tensors or (name, tensor) pairs, by duck typing (no torch import)."""
    specs = []
    for index, item in enumerate(named_tensors):
        name, tensor = item if isinstance(item, tuple) else (str(index), item)
        specs.append(
            ParamSpec(
                name=name,
                shape=tuple(int(d) for d in tensor.shape),
                dtype=dtype_name(tensor.dtype),
                on_host=tensor.device.type == "cpu",
            )
        )
    return specs


# --------------------------------------------------------------------------- models


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-style decoder (Llama, Mistral, Qwen2), optionally with mixture-of-experts MLPs (Mixtral,
    Qwen2-MoE, DeepSeek-V3) and multi-head latent attention (DeepSeek-V3), described by Hugging Face
    config fields. Parameter names and shapes are those of the transformers models."""

    name: str
    """Label shown in the plan."""
    hidden_size: int
    """Width h of the residual stream."""
    intermediate_size: int
    """Width of the dense SwiGLU MLP (gate, up and down projections); Mixtral's experts have this width."""
    num_hidden_layers: int
    """Number of decoder layers L."""
    num_attention_heads: int
    """Query heads a."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention when fewer than the query heads)."""
    vocab_size: int
    """Vocabulary size v (rows of the embedding and of the output projection)."""
    tie_word_embeddings: bool = False
    """Whether the output projection shares the embedding's weight (one tensor, counted once)."""
    head_dim: int | None = None
    """Width of one head; None means hidden_size // num_attention_heads."""
    qkv_bias: bool = False
    """Biases on the q, k, v projections (Llama's attention_bias; Qwen2's default)."""
    o_bias: bool = False
    """Bias on the attention output projection (Llama's attention_bias)."""
    mlp_bias: bool = False
    """Biases on the MLP projections (Llama's mlp_bias)."""
    num_experts: int = 0
    """Routed experts of a mixture-of-experts MLP (Mixtral num_local_experts, Qwen2-MoE num_experts, DeepSeek
    n_routed_experts); 0: every MLP is dense."""
    expert_intermediate_size: int | None = None
    """Width of one routed expert (moe_intermediate_size); None means intermediate_size (Mixtral)."""
    shared_expert_intermediate_size: int = 0
    """Width of the always-active shared-expert MLP of a MoE layer (Qwen2-MoE shared_expert_intermediate_size;
    DeepSeek n_shared_experts * moe_intermediate_size); 0: none."""
    shared_expert_gate: bool = False
    """Qwen2-MoE's sigmoid gate on the shared expert (a 1 x h weight)."""
    shared_expert_module: str = "shared_expert"
    """Module name of the shared expert in the transformers model ("shared_experts" in DeepSeek-V3)."""
    dense_layers: tuple[int, ...] = ()
    """Layers whose MLP stays dense in a MoE model (DeepSeek first_k_dense_replace, Qwen2-MoE mlp_only_layers and
    decoder_sparse_step)."""
    kv_lora_rank: int | None = None
    """Multi-head latent attention (DeepSeek-V3): rank of the compressed key/value; None: ordinary attention."""
    q_lora_rank: int | None = None
    """Latent attention: rank of the compressed query; None: a full q_proj."""
    qk_rope_head_dim: int = 0
    """Latent attention: per-head width of the rotary part of queries and keys."""
    qk_nope_head_dim: int = 0
    """Latent attention: per-head width of the non-rotary part of queries and keys."""
    v_head_dim: int = 0
    """Latent attention: per-head width of the values."""

    def __post_init__(self) -> None:
        for f in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        ):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be a positive integer, got {value!r}")
        for f in ("num_experts", "shared_expert_intermediate_size", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model {self.name!r}: {f} must be a non-negative integer, got {value!r}")
        for f in ("expert_intermediate_size", "kv_lora_rank", "q_lora_rank"):
            value = getattr(self, f)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"model {self.name!r}: {f} must be a positive integer or None, got {value!r}")
        if self.kv_lora_rank is None and self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}; give head_dim"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model {self.name!r}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.kv_lora_rank is not None and not (self.qk_rope_head_dim and self.qk_nope_head_dim and self.v_head_dim):
            raise ValueError(f"model {self.name!r}: latent attention (kv_lora_rank) needs qk_rope_head_dim, "
                             "qk_nope_head_dim and v_head_dim")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def _is_moe_layer(self, index: int) -> bool:
        return self.is_moe and index not in self.dense_layers

    def _attention_shapes(self, p: str, linear: Any) -> None:
        h, heads = self.hidden_size, self.num_attention_heads
        if self.kv_lora_rank is None:
            d = self.resolved_head_dim
            q, kv = heads * d, self.num_key_value_heads * d
            linear("self_attn.q_proj", q, h, self.qkv_bias)
            linear("self_attn.k_proj", kv, h, self.qkv_bias)
            linear("self_attn.v_proj", kv, h, self.qkv_bias)
            linear("self_attn.o_proj", h, q, self.o_bias)
            return
        # DeepSeek-V3's multi-head latent attention, in transformers' order; attention_bias covers q_a, kv_a and o.
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            linear("self_attn.q_proj", heads * qk, h, False)
        else:
            linear("self_attn.q_a_proj", self.q_lora_rank, h, self.qkv_bias)
            linear("self_attn.q_a_layernorm", None, self.q_lora_rank, False)
            linear("self_attn.q_b_proj", heads * qk, self.q_lora_rank, False)
        linear("self_attn.kv_a_proj_with_mqa", self.kv_lora_rank + self.qk_rope_head_dim, h, self.qkv_bias)
        linear("self_attn.kv_a_layernorm", None, self.kv_lora_rank, False)
        linear("self_attn.kv_b_proj", heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank, False)
        linear("self_attn.o_proj", h, heads * self.v_head_dim, self.o_bias)

    def layer_parameter_shapes(self, index: int) -> list[tuple[str, tuple[int, ...]]]:
        """Named shapes of decoder layer ``index``, in the order transformers registers them."""
        h, i = self.hidden_size, self.intermediate_size
        p = f"model.layers.{index}."
        shapes: list[tuple[str, tuple[int, ...]]] = []

        def linear(name: str, out_features: int | None, in_features: int, bias: bool) -> None:
            if out_features is None:  # a norm: one weight vector
                shapes.append((f"{p}{name}.weight", (in_features,)))
                return
            shapes.append((f"{p}{name}.weight", (out_features, in_features)))
            if bias:
                shapes.append((f"{p}{name}.bias", (out_features,)))

        def mlp(prefix: str, width: int, bias: bool) -> None:
            linear(f"{prefix}.gate_proj", width, h, bias)
            linear(f"{prefix}.up_proj", width, h, bias)
            linear(f"{prefix}.down_proj", h, width, bias)

        self._attention_shapes(p, linear)
        if not self._is_moe_layer(index):
            mlp("mlp", i, self.mlp_bias)
        else:
            e = self.num_experts
            width = self.expert_intermediate_size or i
            router: list[tuple[str, tuple[int, ...]]] = [(f"{p}mlp.gate.weight", (e, h))]
            experts: list[tuple[str, tuple[int, ...]]] = [
                (f"{p}mlp.experts.gate_up_proj", (e, 2 * width, h)),
                (f"{p}mlp.experts.down_proj", (e, h, width)),
            ]
            # transformers registers the router first (Mixtral, Qwen2-MoE) or after the experts (DeepSeek-V3)
            shapes.extend(experts + router if self.shared_expert_module == "shared_experts" else router + experts)
            if self.shared_expert_intermediate_size:
                mlp(f"mlp.{self.shared_expert_module}", self.shared_expert_intermediate_size, False)
            if self.shared_expert_gate:
                linear("mlp.shared_expert_gate", 1, h, False)
        shapes.append((f"{p}input_layernorm.weight", (h,)))
        shapes.append((f"{p}post_attention_layernorm.weight", (h,)))
        return shapes

    def parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Named shapes of every trainable tensor, as ``named_parameters()`` of the transformers model lists them."""
        shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab_size, self.hidden_size))]
        for index in range(self.num_hidden_layers):
            shapes.extend(self.layer_parameter_shapes(index))
        shapes.append(("model.norm.weight", (self.hidden_size,)))
        if not self.tie_word_embeddings:
            shapes.append(("lm_head.weight", (self.vocab_size, self.hidden_size)))
        return shapes

    def num_parameters(self) -> int:
        return sum(math.prod(shape) for _, shape in self.parameter_shapes())

    def largest_unit_parameters(self) -> int:
        """Elements of the largest FSDP unit (one decoder layer, the embedding or the output projection)."""
        kinds = {0, self.num_hidden_layers - 1, *(k for k in range(self.num_hidden_layers) if k in self.dense_layers)}
        if self.is_moe:
            kinds.add(next((k for k in range(self.num_hidden_layers) if self._is_moe_layer(k)), 0))
        layer = max(sum(math.prod(s) for _, s in self.layer_parameter_shapes(k)) for k in kinds)
        return max(layer, self.vocab_size * self.hidden_size)


@dataclass(frozen=True, kw_only=True)
class ParamCountModel:
    """A model known only by its parameter count (``--params N``): one flat tensor, no architecture."""

    name: str
    """Label shown in the plan."""
    params: int
    """Number of trainable elements."""

    def __post_init__(self) -> None:
        if not isinstance(self.params, int) or self.params <= 0:
            raise ValueError(f"model {self.name!r}: params must be a positive integer, got {self.params!r}")

    def parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("params", (self.params,))]

    def num_parameters(self) -> int:
        return self.params

    def largest_unit_parameters(self) -> int:
        return 0  # unknown without an architecture: FSDP gather buffers are not estimated


Model = Union["ModelConfig", "ParamCountModel", "ParamShapesModel"]

PRESETS: dict[str, ModelConfig] = {
    "llama-2-7b": ModelConfig(
        name="llama-2-7b", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
    ),
    "llama-2-13b": ModelConfig(
        name="llama-2-13b", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
    ),
    "llama-2-70b": ModelConfig(
        name="llama-2-70b", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
    ),
    "llama-3-8b": ModelConfig(
        name="llama-3-8b", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    ),
    "llama-3-70b": ModelConfig(
        name="llama-3-70b", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
    ),
    "llama-3.1-405b": ModelConfig(
        name="llama-3.1-405b", hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
        num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
    ),
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_experts=8,
    ),
}

_HF_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

# model_type -> how its config.json is read; the dense types are Llama-style decoders
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "deepseek_v3")
# keys that make a decoder something this planner would count wrong as a dense Llama
_FOREIGN_KEYS = (
    "num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
    "shared_expert_intermediate_size", "first_k_dense_replace", "moe_layer_freq", "kv_lora_rank", "q_lora_rank",
)


class UnsupportedConfig(ValueError):
    """A config this planner cannot count exactly; the message names the key or model_type."""


def read_hf_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """The JSON object of a Hugging Face config (a ``config.json`` or a directory holding one), and a label."""
    file = os.fspath(path)
    if os.path.isdir(file):
        file = os.path.join(file, "config.json")
        if not os.path.isfile(file):
            raise ValueError(f"{path}: a directory without config.json")
    try:
        with open(file, encoding="utf-8") as fh:
            raw = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file}: not a JSON text file (byte {exc.start} is not UTF-8; a config.json is text)") from None
    except RecursionError:
        raise ValueError(f"{file}: not a config (JSON nested too deeply to read)") from None
    except OSError as exc:
        raise ValueError(f"{file}: cannot read ({exc.strerror or exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return raw, os.path.basename(os.path.dirname(os.path.abspath(file))) or file


def model_from_hf_config(path: str | os.PathLike[str]) -> ModelConfig:
    """A ModelConfig from a Hugging Face ``config.json`` (or a directory holding one); see :func:`model_from_hf_dict`."""
    raw, name = read_hf_config(path)
    return model_from_hf_dict(raw, name=name, source=str(path))


def _require(raw: dict[str, Any], source: str, keys: Sequence[str], what: str, nullable: Sequence[str] = ()) -> None:
    missing = [key for key in keys if key not in raw or (raw[key] is None and key not in nullable)]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(repr(k) for k in missing)} ({what})")


def model_from_hf_dict(raw: dict[str, Any], *, name: str, source: str | None = None) -> ModelConfig:
    """A ModelConfig from the fields of a Hugging Face config.

    Dense decoders (model_type llama, mistral, qwen2, or none given) and mixture-of-experts ones
    (mixtral: num_local_experts; qwen2_moe: num_experts, moe_intermediate_size,
    shared_expert_intermediate_size, decoder_sparse_step, mlp_only_layers; deepseek_v3:
    n_routed_experts, n_shared_experts, first_k_dense_replace, moe_intermediate_size and latent
    attention). Any other model_type, or a dense type carrying expert or latent-attention keys, raises
    :class:`UnsupportedConfig` naming it: a wrong count is worse than none.
    """
    source = source or name
    model_type = str(raw.get("model_type", ""))
    if model_type and model_type not in DENSE_MODEL_TYPES + MOE_MODEL_TYPES:
        raise UnsupportedConfig(f"{source}: model_type {model_type!r} is not one this planner counts "
                                f"(it counts {', '.join(DENSE_MODEL_TYPES + MOE_MODEL_TYPES)})")
    if model_type not in MOE_MODEL_TYPES:
        foreign = [key for key in _FOREIGN_KEYS if raw.get(key)]
        if foreign:
            raise UnsupportedConfig(f"{source}: key {foreign[0]!r} (mixture of experts or latent attention) in a "
                                    f"{model_type or 'untyped'} config; give its model_type ({', '.join(MOE_MODEL_TYPES)})")
    _require(raw, source, _HF_REQUIRED, "needs a Llama-style decoder config")
    attention_bias = bool(raw.get("attention_bias", False))
    layers = raw["num_hidden_layers"]
    common: dict[str, Any] = dict(
        name=name,
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=raw["num_attention_heads"],
        # transformers' default when the field is absent: multi-head attention
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        vocab_size=raw["vocab_size"],
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        head_dim=raw.get("head_dim"),
    )
    if model_type in ("qwen2", "qwen2_moe"):
        # Qwen2 always has q/k/v biases and no o_proj bias (Qwen2-MoE: its qkv_bias, default on)
        qkv = bool(raw.get("qkv_bias", True)) if model_type == "qwen2_moe" else True
        common.update(qkv_bias=qkv, o_bias=False)
    elif model_type == "deepseek_v3":
        common.update(qkv_bias=attention_bias, o_bias=attention_bias)  # q_a, kv_a and o projections
    else:
        common.update(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(raw.get("mlp_bias", False)))
    if model_type == "mixtral":
        _require(raw, source, ("num_local_experts",), "Mixtral's experts per layer")
        return ModelConfig(**common, num_experts=raw["num_local_experts"])
    if model_type == "qwen2_moe":
        keys: tuple[str, ...] = ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")
        _require(raw, source, keys, "Qwen2-MoE's experts")
        step = raw.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"{source}: decoder_sparse_step must be a positive integer, got {step!r}")
        mlp_only = set(raw.get("mlp_only_layers") or ())
        experts = raw["num_experts"]
        dense = tuple(k for k in range(layers) if k in mlp_only or experts <= 0 or (k + 1) % step)
        return ModelConfig(**common, num_experts=experts, expert_intermediate_size=raw["moe_intermediate_size"],
                           shared_expert_intermediate_size=raw["shared_expert_intermediate_size"], shared_expert_gate=True,
                           dense_layers=dense)
    if model_type == "deepseek_v3":
        keys = ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "moe_intermediate_size",
                "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        _require(raw, source, keys, "DeepSeek-V3's experts and latent attention", nullable=("q_lora_rank",))
        width = raw["moe_intermediate_size"]
        first_dense = raw["first_k_dense_replace"] or 0
        return ModelConfig(**common, num_experts=raw["n_routed_experts"], expert_intermediate_size=width,
                           shared_expert_intermediate_size=width * (raw["n_shared_experts"] or 0),
                           shared_expert_module="shared_experts", dense_layers=tuple(range(min(first_dense, layers))),
                           kv_lora_rank=raw["kv_lora_rank"], q_lora_rank=raw["q_lora_rank"],
                           qk_rope_head_dim=raw["qk_rope_head_dim"], qk_nope_head_dim=raw["qk_nope_head_dim"],
                           v_head_dim=raw["v_head_dim"])
    return ModelConfig(**common)


@dataclass(frozen=True, kw_only=True)
class ParamShapesModel:
    """A model known by its parameters' names and shapes only (read from a model built on the meta device)."""

    name: str
    """Label shown in the plan."""
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """(name, shape) of every trainable tensor."""

    def parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(self.shapes)

    def num_parameters(self) -> int:
        return sum(math.prod(s) for _, s in self.shapes)

    def largest_unit_parameters(self) -> int:
        """The largest block of tensors named ``...layers.N.`` (one decoder layer), or the largest tensor."""
        units: dict[str, int] = {}
        for name, shape in self.shapes:
            parts = name.split(".")
            key = name
            for k in range(len(parts) - 1):
                if parts[k] in ("layers", "h", "blocks") and parts[k + 1].isdigit():
                    key = ".".join(parts[: k + 2])
                    break
            units[key] = units.get(key, 0) + math.prod(shape)
        return max(units.values(), default=0)
