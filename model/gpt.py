"""The GPT-2 decoder (``model.family: gpt2``): pure PyTorch, no framework, readable top to bottom.

Pre-LayerNorm blocks (LayerNorm with bias), learned absolute positions, bias-free linear
layers, a GELU MLP of width 4d, and a token embedding tied to the LM head. Rows may pack
several documents: ``positions`` restart at 0 where a document starts, and attention never
crosses that boundary (``model.kernels.attention``). What both families share (kernels, the compiled
trunk, the loss) is ``model.decoder``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.kernels import attention
from model.kernels.attention import DocumentLayout
from model.decoder import Decoder, ModelConfig
from model.kernels import ComputeConfig, Target


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.attend = attention.kernel("sdpa")  # the attention kernel the model chose when it was built

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3 * self.n_head, d // self.n_head)  # q, k, v heads side by side, as split(d) gives
        return self.proj(self.attend(qkv, self.n_head, layout).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        # The fused MLP the model chose when it was built (model.kernels.fused_mlp), or None: these modules
        self.kernel: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return self.proj(F.gelu(self.fc(x)))
        return self.kernel(x, self.fc.weight, self.proj.weight)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), layout)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(Decoder):
    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None, target: Target | None = None) -> None:
        if config.family != "gpt2":
            raise ValueError(f"GPT is built from model.family gpt2, not {config.family!r}")
        super().__init__(config, compute)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.max_seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.reset_parameters()
        self.use_target(target)

    def embed(self, input_ids: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        b, t = input_ids.shape
        positions = layout.positions
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        return self.wte(input_ids) + self.wpe(positions)

    @property
    def final_norm(self) -> nn.Module:
        return self.ln_f

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.wte.weight

    def embeddings(self) -> list[nn.Parameter]:
        return [self.wte.weight, self.wpe.weight]
