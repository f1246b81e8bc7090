"""Model size and training FLOPs, as the training lab counts them (for MFU)."""

from __future__ import annotations

from torch import nn


def training_flops(config, tokens: int, attention_pairs: int) -> float:
    """The training lab's estimate of forward+backward matrix FLOPs for ``config`` (a GPTConfig).

    6 * (12 L d^2 + V d) per token for the dense layers and LM head, plus 12 L d per causal
    attention pair counted as sum(s^2) over independent document segments s.
    """
    dense = 6 * (12 * config.n_layer * config.n_embd**2 + config.vocab_size * config.n_embd) * tokens
    return dense + 12 * config.n_layer * config.n_embd * attention_pairs


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (the tied embedding/head counted once)."""
    return sum(p.numel() for p in model.parameters())
