"""The Llama decoder (``model.family: llama``): RMSNorm, rotary positions, a SwiGLU MLP, grouped-query attention.

Pre-norm blocks as GPT-2's, with RMSNorm (PyTorch's) in place of LayerNorm, no biases anywhere, no learned
positions: q and k turn by their token's position in its document (``model.rope``), which restarts at 0 with
every document of a packed row, and attention never crosses documents (``model.kernels.attention``). ``n_kv_head``
key/value heads each serve n_head / n_kv_head query heads, which every attention kernel takes as they are.
With ``qk_norm`` each head's query and key pass an RMSNorm over the head dimension (one weight for q's heads, one
for k's) before they turn, as Qwen3's attention does.
The head is the token embedding (``tie_embeddings``) or a matrix of its own. Kernels, the compiled trunk and
the loss are ``model.decoder``'s, as GPT-2's.

The modules map one to one onto Hugging Face's ``LlamaForCausalLM`` (``model.hf``), or ``Qwen3ForCausalLM`` with
``qk_norm`` (Llama's modules plus q_norm and k_norm): ``qkv`` holds q_proj, k_proj and v_proj's rows in that order,
``gate_up`` gate_proj's then up_proj's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model import rope
from model.kernels import attention
from model.kernels.attention import DocumentLayout
from model.decoder import Decoder, ModelConfig
from model.kernels import ComputeConfig, Target


class RMSNorm(nn.RMSNorm):
    """PyTorch's RMSNorm, its weight in the input's dtype: its fused kernel takes one dtype (and computes in fp32
    inside), as autocast gives a product its weight in the compute dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class GroupedQueryAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.qkv = nn.Linear(config.n_embd, (self.n_head + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)
        self.attend = attention.kernel("sdpa")  # the attention kernel the model chose when it was built
        self.q_norm = RMSNorm(self.head_dim, eps=config.layer_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=config.layer_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, self.n_head + 2 * self.kv_heads, self.head_dim)
        cos, sin = layout.rotary
        turned = self.n_head + self.kv_heads  # q's and k's heads; v's are not turned
        qk = qkv[:, :, :turned]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :, :self.n_head]), self.k_norm(qkv[:, :, self.n_head:turned])), dim=2)
        qkv = torch.cat((rope.rotate(qk, cos, sin), qkv[:, :, turned:]), dim=2)
        return self.proj(self.attend(qkv, self.kv_heads, layout).reshape(b, t, self.n_head * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.n_embd, 2 * config.mlp_width, bias=False)
        self.proj = nn.Linear(config.mlp_width, config.n_embd, bias=False)
        # The fused MLP the model chose when it was built, or None: these modules (SiLU and product fused by inductor
        # in the compiled trunk), the only kernel for now
        self.kernel: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.gate_up.weight, self.proj.weight)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = GroupedQueryAttention(config)
        self.mlp_norm = RMSNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), layout)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Llama(Decoder):
    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None, target: Target | None = None) -> None:
        if config.family != "llama":
            raise ValueError(f"Llama is built from model.family llama, not {config.family!r}")
        super().__init__(config, compute)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.rotary = rope.RotaryTable(config.head_dim, config.rope_theta, config.max_seq_len)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, eps=config.layer_norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.reset_parameters()
        self.use_target(target)

    def embed(self, input_ids: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        return self.wte(input_ids)

    @property
    def final_norm(self) -> nn.Module:
        return self.norm

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.wte.weight if self.lm_head is None else self.lm_head.weight
