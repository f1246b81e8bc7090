"""Model size and training FLOPs (for MFU), each family by its own matrix shapes."""

from __future__ import annotations

from torch import nn


def training_flops(config, tokens: int, attention_pairs: int) -> float:
    """Forward+backward matrix FLOPs of ``tokens`` tokens for ``config`` (a model.decoder.ModelConfig): 6 per
    parameter of the blocks' products and the LM head per token, plus 12 L d per causal attention pair, counted as
    sum(s^2) over independent document segments s.

    gpt2 is the training lab's formula, 6 * (12 L d^2 + V d) per token; llama counts its own q, k, v, o and
    SwiGLU products (grouped-query attention has smaller k and v products).
    """
    return 6 * matrix_parameters(config) * tokens + 12 * config.n_layer * config.n_embd * attention_pairs


def matrix_parameters(config) -> int:
    """Parameters of the products every token runs through: the blocks' linear layers and the LM head."""
    d, layers = config.n_embd, config.n_layer
    if config.family == "gpt2":
        return 12 * layers * d**2 + config.vocab_size * d
    qkv = d * (config.n_head + 2 * config.kv_heads) * config.head_dim
    out = config.n_head * config.head_dim * d
    mlp = 3 * d * config.mlp_width
    return layers * (qkv + out + mlp) + config.vocab_size * d


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied embedding/head counted once)."""
    return sum(p.numel() for p in model.parameters())
