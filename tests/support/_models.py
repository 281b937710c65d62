"""Tiny transformers models with random init, shared by the tests that need real architectures."""

from __future__ import annotations

import torch


def tiny_llama(tied: bool = True, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A 2-layer LlamaForCausalLM (hidden 16, vocab 64, grouped KV heads), seeded."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def tiny_gpt2() -> torch.nn.Module:
    """A 2-layer GPT2LMHeadModel (tied embeddings), seeded."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)
