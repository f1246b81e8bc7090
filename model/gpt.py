"""The GPT-style decoder: pure PyTorch, no framework, readable top to bottom.

Pre-LayerNorm blocks (LayerNorm with bias), learned absolute positions, bias-free linear
layers, a GELU MLP of width 4d, and a token embedding tied to the LM head. Rows may pack
several documents: ``positions`` restart at 0 where a document starts, and attention never
crosses that boundary (``model.attention``). The LM head and the loss are ``model.loss``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model import fused_mlp, kernels
from model.attention import DocumentLayout, attend
from model.kernels import ComputeConfig, Kernels
from model.loss import LMHeadLoss

log = logging.getLogger(__name__)


@dataclass
class GPTConfig:
    """The ``model`` section of the config: the decoder's shape (how it computes is the ``compute`` section)."""

    vocab_size: int = 50257
    """Embedding rows; at least the tokenizer's vocabulary"""
    n_layer: int = 12
    """Transformer blocks"""
    n_head: int = 12
    """Attention heads per block; must divide n_embd"""
    n_embd: int = 768
    """Width of the residual stream"""
    max_seq_len: int = 4096
    """Tokens per packed training row, and the number of learned positions"""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon"""
    init_std: float = 0.02
    """Standard deviation of the normal weight init (residual projections are scaled down by depth)"""

    def __post_init__(self) -> None:
        """A model built from a config it cannot run fails here; config.check_config reports all at once."""
        if self.problems():
            raise ValueError("; ".join(self.problems()))

    def problems(self) -> list[str]:
        found = [f"model.{name} must be at least 1, not {getattr(self, name)}"
                 for name in ("vocab_size", "n_layer", "n_head", "n_embd") if getattr(self, name) < 1]
        if self.max_seq_len < 2:  # a row of n tokens trains on n - 1 next-token targets
            found.append(f"model.max_seq_len must be at least 2 (a row needs a token and the next one to predict), "
                         f"not {self.max_seq_len}")
        if self.layer_norm_eps <= 0 or self.init_std <= 0:
            found.append("model.layer_norm_eps and model.init_std must be > 0")
        if self.n_head >= 1 and self.n_embd % self.n_head:
            found.append(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        return found


# Keys the model section had and has no more: what an old config file is told.
MOVED_KEYS = {f"model.{name}": f"compute.{new}" for name, new in (
    ("attention", "attention"), ("mlp_kernel", "mlp"), ("mlp_kept_derivatives", "mlp_kept_derivatives"),
    ("loss_chunk_tokens", "loss_chunk_tokens"), ("residual_in_fp32", "residual_in_fp32"),
    ("activation_checkpointing", "activation_checkpointing"))}
REMOVED_KEYS = {
    "model.fp8": "float8 training of the blocks is no longer offered",
    "model.linear_kernel": "qkv's product is cuBLAS's, and the head's logits follow compute.loss",
    "model.loss_kernel": "the loss is the chunked one; compute.loss chooses its chunk kernel",
    "model.loss_softmax": "compute.loss chooses the chunk kernel",
    "model.compile_scope": "torch.compile takes the whole trunk as one graph",
    "model.activation_memory_budget": "the compiled trunk keeps the partitioner's default; "
                                      "compute.activation_checkpointing trades memory for compute",
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.kernel = "sdpa"  # the attention family (compute.attention), which GPT.use_kernels sets

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head)  # q, k, v side by side, as split(d) gives
        return self.proj(attend(qkv, layout, self.kernel).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.kernel = "torch"  # compiled training's kernel (model.fused_mlp), which GPT.use_kernels sets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # quack's kernels compile once per shape: only inside the compiled trunk, whose shapes are the training rows'
        if self.kernel == "torch" or not torch.compiler.is_compiling():
            return self.proj(F.gelu(self.fc(x)))
        return fused_mlp.gelu_mlp(x, self.fc.weight, self.proj.weight, self.kernel)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), layout)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, compute: ComputeConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.compute = compute or ComputeConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.max_seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.head_loss = LMHeadLoss(self.compute.loss_chunk_tokens)
        self.compiled_trunk: Callable | None = None  # what training calls in place of trunk, once compile_trunk ran
        self.kernels: Kernels | None = None  # what runs each part, chosen for ``kernels_for``
        self.kernels_for: tuple | None = None  # (device, compute dtype, compiled)
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

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final-LayerNorm hidden states [B, T, d], in the compute dtype (autocast's where it is on).

        ``positions`` None means one document per row; ``cu_seqlens`` (document offsets in the
        flattened rows, see attention.document_offsets) may come with the batch to spare a device
        sync, and then also tells, from its shape alone, when every row is one document.
        Training runs the compiled trunk once ``compile_trunk`` was called; evaluation stays eager.
        """
        if input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
        if cu_seqlens is not None and cu_seqlens.shape[0] == input_ids.shape[0] + 1:
            # As many documents as rows, and every row starts one: each row is a single document
            # with positions 0..T-1, plain causal attention, which dense causal kernels do fastest.
            positions = cu_seqlens = None
        dtype = self.compute_dtype(input_ids.device)
        self.use_kernels(input_ids.device, dtype)
        # fp32 keeps the embeddings' dtype (fp32 weights); a half dtype makes every residual add half too.
        residual = None if self.compute.residual_in_fp32 or dtype == self.wte.weight.dtype else dtype
        # Under autocast the final norm's output leaves in the compute dtype, in which the head's products take it
        # anyway: the cast fuses into the norm's kernel, and the gradient coming back is half as wide.
        out = None if dtype == self.wte.weight.dtype else dtype
        if self.compiled_trunk is not None and self.training:
            if cu_seqlens is not None:
                torch._dynamo.mark_dynamic(cu_seqlens, 0)  # document counts vary: one graph for all
            return self.compiled_trunk(input_ids, positions, cu_seqlens, residual, out)
        return self.trunk(input_ids, positions, cu_seqlens, residual, out)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else self.wte.weight.dtype

    def use_kernels(self, device: torch.device, dtype: torch.dtype) -> None:
        """Chooses every part's kernel (``model.kernels``) for ``device`` and ``dtype`` and hands each to its module,
        with one log line: once, at the first forward, and again only if the device, the dtype or compilation
        changed. Outside any compiled graph, which then sees the kernels as constants."""
        key = (device, dtype, self.compiled_trunk is not None)
        if key == self.kernels_for or torch.compiler.is_compiling():
            return
        chosen = kernels.choose_kernels(self.compute, device, dtype, key[2], self.config.n_layer, self.config.n_embd,
                                        self.config.n_head)
        for block, mlp in zip(self.blocks, chosen.mlp, strict=True):
            block.attn.kernel, block.mlp.kernel = chosen.attention, mlp
        self.head_loss.kernel = chosen.loss
        if chosen != self.kernels:
            log.info("kernels: %s", kernels.describe(chosen))
        self.kernels, self.kernels_for = chosen, key

    def kernels_used(self) -> dict:
        """What runs each part, with the settings that chose it (the run record); {} before the first forward."""
        return {} if self.kernels is None else self.kernels.described(self.compute)

    def trunk(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
        residual: torch.dtype | None = None, out: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Embeddings, blocks and the final norm: what ``compile_trunk`` compiles. ``residual``: the dtype of the
        residual stream where it is not the embeddings'; ``out``: the final norm's output dtype."""
        b, t = input_ids.shape
        layout = DocumentLayout(positions, cu_seqlens)
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        x = self.wte(input_ids) + self.wpe(positions)
        if residual is not None:
            x = x.to(residual)
        for block in self.blocks:
            if self.compute.activation_checkpointing and self.training:
                x = checkpoint(block, x, layout, use_reentrant=False)
            else:
                x = block(x, layout)
        return self.ln_f(x) if out is None else self.ln_f(x).to(out)

    def compile_trunk(self) -> None:
        """torch.compile the trunk for training, as one graph from the embeddings to the final norm, which lets
        inductor fuse across block boundaries (the loss's kernels are its own). It compiles at the first training
        forward, right after the kernels are chosen for it."""
        self.compiled_trunk = torch.compile(self.trunk)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab_size]."""
        return F.linear(self.hidden_states(input_ids, positions), self.lm_head_weight)

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """Summed next-token loss of a packed batch (input_ids, positions, targets, optional cu_seqlens)."""
        hidden = self.hidden_states(batch["input_ids"], batch.get("positions"), batch.get("cu_seqlens"))
        return self.head_loss(hidden, self.lm_head_weight, batch["targets"])
