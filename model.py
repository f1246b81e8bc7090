"""The GPT-style decoder: pure PyTorch, no framework, readable top to bottom.

Pre-LayerNorm blocks (LayerNorm with bias), learned absolute positions, bias-free linear
layers, a GELU MLP of width 4d, and a token embedding tied to the LM head. Rows may pack
several documents: ``positions`` restart at 0 where a document starts, and attention never
crosses that boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    max_seq_len: int = 4096
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, 1, T, T]: token i sees token j iff j <= i and both lie in one document.

    A document starts wherever ``positions`` is 0, so segment ids are a running count of starts.
    """
    segment = torch.cumsum(positions == 0, dim=-1)
    same_document = segment[:, :, None] == segment[:, None, :]
    t = positions.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    return (same_document & causal).unsqueeze(1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal attention over [B, H, T, hd]; ``mask`` (from document_causal_mask) keeps documents apart.

    The one place attention is computed, so a faster kernel can replace it behind this signature.
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = attend(q, k, v, mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.max_seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation; residual output projections scaled by 1/sqrt(2 * n_layer)."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            scale = 1 / math.sqrt(2 * self.config.n_layer) if name.endswith("proj.weight") else 1.0
            nn.init.normal_(p, mean=0.0, std=std * scale)
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.wte.weight

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final-LayerNorm hidden states [B, T, d]. ``positions`` None means one document per row."""
        b, t = input_ids.shape
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
        mask = None
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        else:
            mask = document_causal_mask(positions)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            if self.config.activation_checkpointing and self.training:
                x = checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask)
        return self.ln_f(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab_size]."""
        return F.linear(self.hidden_states(input_ids, positions), self.lm_head_weight)


def token_loss_sum(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over targets != IGNORE_INDEX, in fp32.

    Returning the sum lets the caller divide by the whole optimizer update's target count.
    """
    logits = F.linear(hidden, head_weight).float()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (the tied embedding/head counted once)."""
    return sum(p.numel() for p in model.parameters())
