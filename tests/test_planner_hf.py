"""The planner against the real things: transformers models built from the same configs, and the
bytes OffloadAdamW actually allocates in host memory."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from offload_adamw import OffloadAdamW
from offload_adamw.planning.models import PRESETS, ModelConfig, ParamSpec, model_from_hf_config, param_specs_from_tensors
from offload_adamw.planning.planner import HardwareConfig, TrainingConfig, plan, predict_host_optimizer_bytes


def llama_config(model: ModelConfig, **extra) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_hidden_layers, num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads, vocab_size=model.vocab_size,
        tie_word_embeddings=model.tie_word_embeddings, **extra,
    )


def named_shapes(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(p.shape)) for name, p in module.named_parameters()]


def preset_reference(model: ModelConfig) -> torch.nn.Module:
    """The transformers model of a preset, on the meta device."""
    with torch.device("meta"):
        if model.is_moe:  # the only MoE preset is Mixtral's
            config = MixtralConfig(
                hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
                num_hidden_layers=model.num_hidden_layers, num_attention_heads=model.num_attention_heads,
                num_key_value_heads=model.num_key_value_heads, vocab_size=model.vocab_size,
                num_local_experts=model.num_experts, tie_word_embeddings=False,
            )
            return MixtralForCausalLM(config)
        return LlamaForCausalLM(llama_config(model))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_matches_the_transformers_model(preset):
    model = PRESETS[preset]
    reference = preset_reference(model)
    assert model.num_parameters() == sum(p.numel() for p in reference.parameters())
    assert model.parameter_shapes() == named_shapes(reference)  # names, shapes and order


def test_mixtral_8x7b_has_its_46_7b_parameters():
    assert round(PRESETS["mixtral-8x7b"].num_parameters() / 1e9, 1) == 46.7


SMALL_FIELDS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=300)


@pytest.mark.parametrize(
    "fields",
    [
        dict(model_type="llama", **SMALL_FIELDS, tie_word_embeddings=True),
        dict(model_type="llama", **SMALL_FIELDS, attention_bias=True, mlp_bias=True),
        dict(model_type="mistral", **SMALL_FIELDS, head_dim=32),  # head_dim != hidden_size / heads
        dict(model_type="qwen2", **SMALL_FIELDS, tie_word_embeddings=False),  # q, k, v biases
        dict(model_type="qwen2", **{**SMALL_FIELDS, "num_key_value_heads": 4}, tie_word_embeddings=True),
        dict(model_type="mixtral", **SMALL_FIELDS, num_local_experts=4, num_experts_per_tok=2),
        dict(model_type="qwen2_moe", **SMALL_FIELDS, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
             shared_expert_intermediate_size=72, decoder_sparse_step=1, mlp_only_layers=[]),
        dict(model_type="qwen2_moe", **{**SMALL_FIELDS, "num_hidden_layers": 4}, num_experts=6, num_experts_per_tok=2,
             moe_intermediate_size=40, shared_expert_intermediate_size=72, decoder_sparse_step=2, mlp_only_layers=[2],
             qkv_bias=False),
        dict(model_type="deepseek_v3", **{**SMALL_FIELDS, "num_hidden_layers": 3, "num_key_value_heads": 4},
             n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1,
             moe_intermediate_size=24, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16),
        dict(model_type="deepseek_v3", **{**SMALL_FIELDS, "num_hidden_layers": 2, "num_key_value_heads": 4},
             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
             moe_intermediate_size=24, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=12, attention_bias=True),
    ],
    ids=["llama-tied", "llama-biases", "mistral-head-dim", "qwen2", "qwen2-tied-mha", "mixtral", "qwen2-moe",
         "qwen2-moe-sparse-step", "deepseek-v3", "deepseek-v3-full-q-bias"],
)
def test_config_json_matches_the_transformers_model(tmp_path, fields):
    (tmp_path / "config.json").write_text(json.dumps(fields))
    model = model_from_hf_config(tmp_path / "config.json")
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert model.num_parameters() == sum(p.numel() for p in reference.parameters())
    assert dict(model.parameter_shapes()) == dict(named_shapes(reference))
    # a directory holding config.json is read the same
    assert model_from_hf_config(tmp_path) == model


TINY = {
    "untied": ModelConfig(name="tiny", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=97),
    "tied": ModelConfig(name="tiny-tied", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, vocab_size=97, tie_word_embeddings=True),
}


def first_step(model: torch.nn.Module, amsgrad: bool) -> OffloadAdamW:
    torch.manual_seed(0)
    optimizer = OffloadAdamW(model.parameters(), lr=1e-3, amsgrad=amsgrad, pin_memory=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("which", sorted(TINY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_host_bytes_after_the_first_step_equal_the_prediction(which, dtype, amsgrad):
    config = TINY[which]
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(config)).to(dtype)
    optimizer = first_step(model, amsgrad)
    assert all(len(optimizer.state[p]) > 0 for p in model.parameters())  # every tensor has state
    # the prediction comes from the planner's own shapes, not from the model
    specs = [ParamSpec(name=n, shape=s, dtype=str(dtype), on_host=True) for n, s in config.parameter_shapes()]
    predicted = predict_host_optimizer_bytes(specs, amsgrad=amsgrad)
    assert optimizer.host_state_bytes() == predicted
    assert predict_host_optimizer_bytes(param_specs_from_tensors(model.named_parameters()), amsgrad=amsgrad) == predicted
    if dtype == torch.bfloat16:
        # a bf16 parameter has its master in host memory wherever it lives: the plan's one-GPU host bill is this
        host = plan(config, HardwareConfig(gpus_per_node=1), TrainingConfig(param_dtype="bf16", amsgrad=amsgrad)).strategy(
            "fsdp+offload-adamw").host
        assert host.master + host.exp_avg + host.exp_avg_sq + host.max_exp_avg_sq + host.step_counts == predicted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_host_bytes_for_a_gpu_model_equal_the_plan(dtype, amsgrad):
    config = TINY["untied"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(config)).to(device="cuda", dtype=dtype)
    optimizer = OffloadAdamW(model.parameters(), lr=1e-3, amsgrad=amsgrad)
    ids = torch.randint(0, config.vocab_size, (2, 8), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    host = plan(config, HardwareConfig(gpus_per_node=1), TrainingConfig(param_dtype=str(dtype), amsgrad=amsgrad)).strategy(
        "fsdp+offload-adamw").host
    assert optimizer.host_state_bytes() == host.master + host.exp_avg + host.exp_avg_sq + host.max_exp_avg_sq + host.step_counts


def test_another_architecture_is_counted_from_the_meta_device_model(tmp_path, capsys):
    # OLMoE: experts and q/k norms, a layout the planner does not know; transformers builds it on the meta device
    config = AutoConfig.for_model("olmoe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, num_experts=4,
                                  num_experts_per_tok=2)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    from offload_adamw import cli

    assert cli.main(["plan", "--config", str(tmp_path), "--gpus-per-node", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_parameters"] == sum(p.numel() for p in reference.parameters())
    assert any("meta device" in a for a in data["assumptions"])


@pytest.mark.slow  # a process importing transformers (7 s)
def test_a_model_id_is_read_by_autoconfig_from_the_hub_cache(tmp_path):
    import os
    import subprocess
    import sys

    # the layout huggingface_hub keeps in its cache; offline, AutoConfig reads it from there
    repo = tmp_path / "hub" / "models--acme--tiny-moe"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    fields = dict(model_type="qwen2_moe", **SMALL_FIELDS, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                  shared_expert_intermediate_size=72)
    (repo / "snapshots" / "0123abcd" / "config.json").write_text(json.dumps(fields))
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "offload_adamw", "plan", "--config", "acme/tiny-moe", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    assert json.loads(done.stdout)["num_parameters"] == sum(p.numel() for p in reference.parameters())
    done = subprocess.run([sys.executable, "-m", "offload_adamw", "plan", "--config", "acme/absent"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2 and "acme/absent" in done.stderr and "Traceback" not in done.stderr
