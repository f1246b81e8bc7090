"""What every decoder family shares: the ``model`` section of the config, and the machinery around the blocks.

``ModelConfig`` is the decoder's shape, with ``family`` choosing the architecture (``model.gpt``'s GPT-2,
``model.llama``'s Llama); ``model.families.build_model`` builds the one it names. ``Decoder`` is the part both
families run the same way: the kernels chosen once, when it is built, for the device and dtype it is built for
(``model.kernels``), the trunk
(embeddings, blocks, final norm) compiled as one graph for training, activation checkpointing, the residual
stream's dtype, and the LM head's chunked loss (``model.loss``). A family says how it embeds tokens, what its
blocks are, and which norm ends the trunk.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model import kernels
from model.kernels import ComputeConfig, Kernels, Target, attention, fused_mlp
from model.kernels.attention import DocumentLayout
from model.loss import LMHeadLoss, chunk_function
from model.rope import RotaryTable

log = logging.getLogger(__name__)

Family = Literal["gpt2", "llama"]
FAMILIES = get_args(Family)
SWIGLU_ALIGNMENT = 256  # Llama's rounding of the default SwiGLU width ("multiple_of")


@dataclass
class ModelConfig:
    """The ``model`` section of the config: which decoder family, and its shape (how it computes is the ``compute``
    section). Keys marked "llama" are that family's; gpt2 refuses them away from their defaults."""

    family: Family = "gpt2"
    """The architecture: gpt2 (LayerNorm, learned positions, GELU MLP of width 4 x n_embd, full multi-head attention,
    exported as GPT2LMHeadModel) or llama (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases,
    exported as LlamaForCausalLM, or Qwen3ForCausalLM with qk_norm)"""
    vocab_size: int = 50257
    """Embedding rows; at least the tokenizer's vocabulary"""
    n_layer: int = 12
    """Transformer blocks"""
    n_head: int = 12
    """Attention (query) heads per block; must divide n_embd"""
    n_embd: int = 768
    """Width of the residual stream"""
    max_seq_len: int = 4096
    """Tokens per packed training row; for gpt2 also the number of learned positions"""
    layer_norm_eps: float = 1e-5
    """Epsilon of the family's norms: LayerNorm's (gpt2), RMSNorm's (llama)"""
    init_std: float = 0.02
    """Standard deviation of the normal weight init (residual projections are scaled down by depth)"""
    n_kv_head: int | None = None
    """llama: key and value heads per block, each shared by n_head / n_kv_head query heads (grouped-query attention;
    1: multi-query); must divide n_head. null: n_head (full multi-head attention, the only kind gpt2 has)"""
    intermediate_size: int | None = None
    """llama: width of the SwiGLU MLP (its gate and up products); null: 8 x n_embd / 3 rounded up to a multiple of
    256, the GELU MLP's parameter count. gpt2's MLP is always 4 x n_embd wide"""
    rope_theta: float = 10000.0
    """llama: base of the rotary position angles; positions restart at 0 with every document of a packed row"""
    tie_embeddings: bool = True
    """The LM head is the token embedding (true), or a matrix of its own (false, llama only: gpt2 always ties)"""
    qk_norm: bool = False
    """llama: an RMSNorm with its own weight over each head's query and key before the rotary turn, as Qwen3's;
    exported as Qwen3ForCausalLM (model_type qwen3) in place of LlamaForCausalLM"""
    zero_init_proj: bool = False
    """Initialize the blocks' output projections (attention's and the MLP's last product) to zero, so that every
    block starts as the identity; false: normal init scaled by 1/sqrt(2 x n_layer). Only the init changes"""

    def __post_init__(self) -> None:
        """A model built from a config it cannot run fails here; config.check_config reports all at once."""
        if self.problems():
            raise ValueError("; ".join(self.problems()))

    def problems(self) -> list[str]:
        if self.family not in FAMILIES:
            return [f"model.family must be one of {', '.join(FAMILIES)}, not {self.family!r}"]
        found = [f"model.{name} must be at least 1, not {getattr(self, name)}"
                 for name in ("vocab_size", "n_layer", "n_head", "n_embd", "n_kv_head", "intermediate_size")
                 if getattr(self, name) is not None and getattr(self, name) < 1]
        if self.max_seq_len < 2:  # a row of n tokens trains on n - 1 next-token targets
            found.append(f"model.max_seq_len must be at least 2 (a row needs a token and the next one to predict), "
                         f"not {self.max_seq_len}")
        if self.layer_norm_eps <= 0 or self.init_std <= 0:
            found.append("model.layer_norm_eps and model.init_std must be > 0")
        if self.rope_theta <= 0:
            found.append(f"model.rope_theta must be > 0, not {self.rope_theta}")
        if self.n_head >= 1 and self.n_embd % self.n_head:
            found.append(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        if self.family == "gpt2":
            defaults = {item.name: item.default for item in fields(ModelConfig)}
            found += [f"model.{name} is a llama key: gpt2 {GPT2_HAS[name]}; leave it at {json.dumps(defaults[name])} "
                      f"or set model.family llama" for name in GPT2_HAS if getattr(self, name) != defaults[name]]
        elif self.n_head >= 1 and self.n_embd % self.n_head == 0:
            if self.kv_heads >= 1 and self.n_head % self.kv_heads:
                found.append(f"model.n_head ({self.n_head}) must be divisible by model.n_kv_head ({self.kv_heads}): "
                             f"each key/value head serves the same number of query heads")
            if self.head_dim % 2:
                found.append(f"model.n_embd / model.n_head (the head dimension, {self.head_dim}) must be even: "
                             f"rotary positions turn the head's values in pairs")
        return found

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key and value heads per block (n_kv_head, or n_head where it is null)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: GPT-2's 4 x n_embd, or Llama's SwiGLU width."""
        if self.family == "gpt2":
            return 4 * self.n_embd
        if self.intermediate_size is not None:
            return self.intermediate_size
        return -(-(8 * self.n_embd // 3) // SWIGLU_ALIGNMENT) * SWIGLU_ALIGNMENT


# What gpt2 has in place of each llama key (model.family gpt2 refuses them away from their defaults).
GPT2_HAS = {
    "n_kv_head": "has full multi-head attention (as many key/value heads as query heads)",
    "intermediate_size": "has a GELU MLP of width 4 x n_embd",
    "rope_theta": "has learned positions, not rotary ones",
    "tie_embeddings": "ties its LM head to the token embedding",
    "qk_norm": "normalizes no query or key (its export, GPT2LMHeadModel, has no such norm)",
}

class Decoder(nn.Module):
    """A decoder-only LM: ``wte`` (the token embedding), ``blocks`` (each ``Block.forward(x, layout)``, with an
    ``attn`` holding its attention kernel as ``attend`` and an ``mlp`` holding its fused kernel, if any, as
    ``kernel``), a final norm, and the LM head's loss.

    A family defines ``embed``, ``final_norm`` and ``lm_head_weight``, builds its modules after
    ``Decoder.__init__``, then calls ``reset_parameters`` and ``use_target``.
    """

    wte: nn.Embedding
    blocks: nn.ModuleList

    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.compute = compute or ComputeConfig()
        self.head_loss = LMHeadLoss(self.compute.loss_chunk_tokens)
        self.compiled_trunk: Callable | None = None  # what training calls in place of trunk, for a compiled target
        self.kernels: Kernels | None = None  # what runs each part, chosen for ``target`` by ``use_target``
        self.target: Target | None = None
        self.rotary: RotaryTable | None = None  # the rotary angles of every position, where the family turns q and k

    def embed(self, input_ids: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """The residual stream's start [B, T, d] for the rows' tokens."""
        raise NotImplementedError

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last block and the LM head."""
        raise NotImplementedError

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's [vocab_size, n_embd] matrix (the token embedding's where they are tied)."""
        raise NotImplementedError

    def embeddings(self) -> list[nn.Parameter]:
        """The embedding tables (the optimizer leaves them out of weight decay unless told otherwise)."""
        return [self.wte.weight]

    def reset_parameters(self) -> None:
        """Normal init of every matrix, residual output projections (``proj``) scaled by 1/sqrt(2 * n_layer), as
        GPT-2's, or zero (``zero_init_proj``: drawn first all the same, so every other matrix is the one the normal
        init gives); norms to their identity."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            scale = 1 / math.sqrt(2 * self.config.n_layer) if name.endswith("proj.weight") else 1.0
            nn.init.normal_(p, mean=0.0, std=std * scale)
            if name.endswith("proj.weight") and self.config.zero_init_proj:
                nn.init.zeros_(p)
        for module in self.modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final-norm hidden states [B, T, d], in the compute dtype (autocast's where it is on).

        ``positions`` None means one document per row; ``cu_seqlens`` (document offsets in the
        flattened rows, see attention.document_offsets) may come with the batch to spare a device
        sync, and then also tells, from its shape alone, when every row is one document.
        Training runs the compiled trunk where the model was built for a compiled target; evaluation runs eager,
        with the same kernels.
        """
        if input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
        if cu_seqlens is not None and cu_seqlens.shape[0] == input_ids.shape[0] + 1:
            # As many documents as rows, and every row starts one: each row is a single document
            # with positions 0..T-1, plain causal attention, which dense causal kernels do fastest.
            positions = cu_seqlens = None
        dtype = self.compute_dtype(input_ids.device)
        # Under autocast the residual stream is kept in the compute dtype, as in Megatron-LM's default: half the bytes
        # for the norms, residual adds and saved activations. The final norm's output leaves in it too, in which the
        # head's products take it anyway: the cast fuses into the norm's kernel, and the gradient coming back is half
        # as wide. Without autocast everything stays in the weights' dtype.
        stream = None if dtype == self.wte.weight.dtype else dtype
        if self.compiled_trunk is not None and self.training:
            if cu_seqlens is not None:
                torch._dynamo.mark_dynamic(cu_seqlens, 0)  # document counts vary: one graph for all
            return self.compiled_trunk(input_ids, positions, cu_seqlens, stream)
        return self.trunk(input_ids, positions, cu_seqlens, stream)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else self.wte.weight.dtype

    def use_target(self, target: Target | None = None) -> None:
        """Chooses every part's kernel (``model.kernels``) for ``target`` and hands each module its kernel, with one
        log line; for a compiled target, wraps the trunk in torch.compile (which compiles at the first training
        forward). None: where the weights are, in their dtype, eager. A family calls it when it is built (with
        the target ``build_model`` was given); whoever runs the model elsewhere later calls it again, never a
        forward."""
        weight = self.wte.weight
        target = target or Target(torch.device("cpu") if weight.is_meta else weight.device, weight.dtype)
        chosen = kernels.choose_kernels(self.compute, target, self.config)
        for block, mlp in zip(self.blocks, chosen.mlp, strict=True):
            block.attn.attend = attention.kernel(chosen.attention)
            block.mlp.kernel = fused_mlp.kernel(mlp)
        self.head_loss.chunk_fn = chunk_function(chosen.loss)
        self.compiled_trunk = torch.compile(self.trunk) if target.compiled else None
        log.info("kernels: %s", kernels.describe(chosen, self.config.family))
        self.kernels, self.target = chosen, target

    def kernels_used(self) -> dict:
        """What runs each part, with the settings that chose it (the run record)."""
        return {} if self.kernels is None else self.kernels.described(self.compute)

    def trunk(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
        stream: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Embeddings, blocks and the final norm: what a compiled target compiles, as one graph, which lets inductor
        fuse across block boundaries (the loss's kernels are its own). ``stream``: the dtype of the residual
        stream and of the final norm's output, where it is not the embeddings'."""
        rotary = None if self.rotary is None else self.rotary(positions, input_ids.shape[1])
        layout = DocumentLayout(positions, cu_seqlens, rotary)
        x = self.embed(input_ids, layout)
        if stream is not None:
            x = x.to(stream)
        for block in self.blocks:
            if self.compute.activation_checkpointing and self.training:
                x = checkpoint(block, x, layout, use_reentrant=False)
            else:
                x = block(x, layout)
        return self.final_norm(x) if stream is None else self.final_norm(x).to(stream)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab_size]."""
        return F.linear(self.hidden_states(input_ids, positions), self.lm_head_weight)

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """Summed next-token loss of a packed batch (input_ids, positions, targets, optional cu_seqlens)."""
        hidden = self.hidden_states(batch["input_ids"], batch.get("positions"), batch.get("cu_seqlens"))
        return self.head_loss(hidden, self.lm_head_weight, batch["targets"])
