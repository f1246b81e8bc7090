"""The GPT-style decoder: pure PyTorch, no framework, readable top to bottom.

Pre-LayerNorm blocks (LayerNorm with bias), learned absolute positions, bias-free linear
layers, a GELU MLP of width 4d, and a token embedding tied to the LM head. Rows may pack
several documents: ``positions`` restart at 0 where a document starts, and attention never
crosses that boundary (``model.attention``). The LM head and the loss are ``model.loss``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model import attention, fused_mlp, loss, quack_linear
from model.attention import DocumentLayout, attend

log = logging.getLogger(__name__)

CompileScope = Literal["trunk", "blocks"]
COMPILE_SCOPES = get_args(CompileScope)


@dataclass
class GPTConfig:
    """The ``model`` section of the config: the decoder's shape and how it runs."""

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
    activation_checkpointing: bool = False
    """Recompute each block in the backward pass: less activation memory for more compute"""
    activation_memory_budget: float = 1.0
    """Compiled trunk only: below 1, the partitioner recomputes more (even the attention and the MLP's first product)
    to keep fewer activations"""
    attention: attention.Kernel = "auto"
    """Attention kernel: fa4 (FlashAttention 4; an error on a GPU where it cannot run), varlen (PyTorch's CUDA kernels:
    varlen flash for packed rows, fused causal SDPA for one-document rows), sdpa (SDPA with a document mask); auto: fa4
    where it is installed and the GPU supports it, else varlen. CPU and fp32 always take sdpa"""
    mlp_kernel: fused_mlp.Kernel = "auto"
    """Compiled CUDA training in bf16: quack (the GELU inside the MLP's GEMM epilogues, quack-kernels; an error where it
    cannot run), torch (cuBLAS products and a separate GELU); auto: quack where it imports and the GPU supports it, else
    torch. Eager runs always take torch; run_record.json names what ran"""
    mlp_kept_derivatives: int = 6
    """Compiled training with quack's MLP (model.mlp_kernel) on Hopper: in this many blocks, the last ones, fc's
    product also writes the GELU's derivative, which the backward keeps with the activation in place of the
    pre-activation, so that proj's input-gradient product only scales by it (no GELU arithmetic, one output
    instead of two). Each such block keeps 4 x n_embd x 2 bytes more per token: 6 blocks at the defaults add
    0.035 MiB per microbatch token (docs/PERFORMANCE.md); 0: none"""
    linear_kernel: quack_linear.Kernel = "auto"
    """Compiled CUDA training in bf16: quack (qkv's forward product and the LM head's logits by quack's GEMM,
    quack-kernels; an error where it cannot run), torch (cuBLAS); auto: quack where it imports and the GPU supports it,
    else torch. Eager runs always take torch; run_record.json names what ran"""
    residual_in_fp32: bool = False
    """true: keep the residual stream (the embeddings and every block's sum) in fp32 under autocast, as autocast
    alone leaves it; false: in the compute dtype (bf16), as Megatron-LM does by default: half the bytes for the
    LayerNorms, residual adds and saved activations; held-out loss within 1e-4 of the fp32 stream's over 100 updates
    on the same rows (docs/PERFORMANCE.md).
    Runs without autocast (fp32, CPU) are unaffected"""
    fp8: bool = False
    """Train the blocks' Linear layers with torchao's float8 tensorwise scaling (CUDA compute capability 8.9+ and
    torchao, refused otherwise); the LM head and embeddings stay bf16. The blocks then call those layers, so
    model.mlp_kernel and model.linear_kernel's qkv product do not apply"""
    loss_chunk_tokens: int = 16384
    """LM head and cross-entropy run over chunks of this many tokens, so the logits of a whole microbatch never
    exist at once; 0: all at once"""
    loss_kernel: loss.Kernel = "chunked"
    """The LM head + cross-entropy in training: chunked (PyTorch), liger (liger-kernel) or cce
    (cut-cross-entropy); the packages run on CUDA in bf16 and are an error where they do not import. CPU, fp32
    and fp16 runs always take chunked"""
    loss_softmax: loss.Softmax = "gemm_lse"
    """Compiled CUDA training with the chunked loss: each chunk's softmax and gradient as one Triton pass over logits
    whose log-sum-exp quack's GEMM computed in its epilogue (gemm_lse: where quack computes the logits,
    model.linear_kernel, in bf16 on Hopper; else triton); as one Triton kernel that reads the logits twice and writes
    the gradient over them (triton); or as inductor-compiled PyTorch (compiled). Eager runs take plain PyTorch;
    run_record.json names what ran"""
    compile_scope: CompileScope = "trunk"
    """What torch.compile takes: trunk (one graph) or blocks (one graph all blocks share: compiles sooner, needs
    more GPU memory)"""

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
        if self.mlp_kept_derivatives < 0:
            found.append(f"model.mlp_kept_derivatives must be >= 0, not {self.mlp_kept_derivatives}")
        if self.loss_chunk_tokens < 0 or self.layer_norm_eps <= 0 or self.init_std <= 0:
            found.append("model.loss_chunk_tokens must be >= 0, model.layer_norm_eps and model.init_std > 0")
        if not 0 <= self.activation_memory_budget <= 1:
            found.append(f"model.activation_memory_budget must lie in [0, 1] (1: no extra recomputation), "
                         f"not {self.activation_memory_budget}")
        if self.n_head >= 1 and self.n_embd % self.n_head:
            found.append(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        if self.attention not in attention.CHOICES:
            found.append(f"model.attention must be one of {', '.join(attention.CHOICES)}, not {self.attention!r}")
        if self.mlp_kernel not in fused_mlp.CHOICES:
            found.append(f"model.mlp_kernel must be one of {', '.join(fused_mlp.CHOICES)}, not {self.mlp_kernel!r}")
        if self.linear_kernel not in quack_linear.CHOICES:
            found.append(f"model.linear_kernel must be one of {', '.join(quack_linear.CHOICES)}, "
                         f"not {self.linear_kernel!r}")
        if self.loss_kernel not in loss.CHOICES:
            found.append(f"model.loss_kernel must be one of {', '.join(loss.CHOICES)}, not {self.loss_kernel!r}")
        if self.loss_softmax not in loss.SOFTMAX_CHOICES:
            found.append(f"model.loss_softmax must be one of {', '.join(loss.SOFTMAX_CHOICES)}, not {self.loss_softmax!r}")
        if self.compile_scope not in COMPILE_SCOPES:
            found.append(f"model.compile_scope must be one of {', '.join(COMPILE_SCOPES)}, not {self.compile_scope!r}")
        return found


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, layout: DocumentLayout, linear_kernel: str = "torch") -> torch.Tensor:
        b, t, d = x.shape
        if linear_kernel == fused_mlp.LAYERS:
            qkv = self.qkv(x)
        else:
            qkv = quack_linear.linear(x, self.qkv.weight, linear_kernel)
        qkv = qkv.view(b, t, 3, self.n_head, d // self.n_head)  # q, k, v side by side, as split(d) gives
        return self.proj(attend(qkv, layout).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, kernel: str = "torch") -> torch.Tensor:
        if kernel == fused_mlp.LAYERS:
            return self.proj(F.gelu(self.fc(x)))
        return fused_mlp.gelu_mlp(x, self.fc.weight, self.proj.weight, kernel)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, layout: DocumentLayout, mlp_kernel: str = "torch",
                linear_kernel: str = "torch") -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), layout, linear_kernel)
        x = x + self.mlp(self.ln_2(x), mlp_kernel)
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.max_seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self._compiled_trunk: Callable | None = None  # what training calls instead of _trunk
        self.attention_kernels: dict[str, str] = {}  # batch kind -> the kernel that ran it (run record, log)
        self.mlp_kernel: str | None = None  # what ran the MLP in the last training batch (run record, log)
        self.mlp_kept_derivatives = 0  # in how many blocks it kept the GELU's derivative (run record, log)
        self.linear_kernel: str | None = None  # and qkv's forward product and the head's logits
        self.loss_kernel: str | None = None  # the loss kernel of the last training batch (run record)
        self.loss_softmax: str | None = None  # and, with the chunked loss, what ran its chunk softmax
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
        # Decided here, outside any compiled graph: the graph sees the choice as a constant.
        dtype = self.compute_dtype(input_ids.device)
        kernel = attention.choose_and_record(self.config.attention, input_ids.device, dtype,
                                             self.config.n_embd // self.config.n_head, positions is not None,
                                             self.attention_kernels)
        compiled = self._compiled_trunk is not None and self.training
        mlp = (fused_mlp.LAYERS if self.config.fp8 else
               fused_mlp.choose(self.config.mlp_kernel, input_ids.device, dtype, compiled, self.config.n_embd))
        mlp_blocks = fused_mlp.block_kernels(mlp, self.config.n_layer, self.config.mlp_kept_derivatives,
                                             input_ids.device)
        kept = mlp_blocks.count(fused_mlp.KEPT_DERIVATIVE)
        recorded = (self.mlp_kernel, self.mlp_kept_derivatives)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and recorded != (mlp, kept):
            self.mlp_kernel, self.mlp_kept_derivatives = mlp, kept
            log.info("mlp: %s%s", fused_mlp.describe(mlp),
                     f"; the last {kept} blocks keep the GELU's derivative from the forward" if kept else "")
        linear = self.chosen_linear_kernel(input_ids.device)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and self.linear_kernel != linear:
            self.linear_kernel = linear
            log.info("linear: %s", quack_linear.describe(linear))
        # fp32 keeps the embeddings' dtype (fp32 weights); a half dtype makes every residual add half too.
        residual = None if self.config.residual_in_fp32 or dtype == self.wte.weight.dtype else dtype
        # Under autocast the final norm's output leaves in the compute dtype, in which the head's products take it
        # anyway: the cast fuses into the norm's kernel, and the gradient coming back is half as wide.
        out = None if dtype == self.wte.weight.dtype else dtype
        qkv = fused_mlp.LAYERS if self.config.fp8 else linear  # the head's logits keep ``linear``: it is not float8
        if compiled:
            if cu_seqlens is not None:
                torch._dynamo.mark_dynamic(cu_seqlens, 0)  # document counts vary: one graph for all
            return self._compiled_trunk(input_ids, positions, cu_seqlens, kernel, mlp_blocks, residual, qkv, out=out)
        return self._trunk(input_ids, positions, cu_seqlens, kernel, mlp_blocks, residual, qkv, out=out)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else self.wte.weight.dtype

    def chosen_linear_kernel(self, device: torch.device) -> str:
        """What runs qkv's forward product and the head's logits here (``model.linear_kernel``)."""
        compiled = self._compiled_trunk is not None and self.training
        return quack_linear.choose(self.config.linear_kernel, device, self.compute_dtype(device), compiled,
                                   self.config.n_embd)

    def _trunk(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
        kernel: str = "sdpa", mlp: str | tuple[str, ...] = "torch", residual: torch.dtype | None = None,
        linear: str = "torch", blocks: list[nn.Module] | None = None, out: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``mlp``: one MLP kernel for every block, or one per block (``fused_mlp.block_kernels``)."""
        b, t = input_ids.shape
        layout = DocumentLayout(positions, cu_seqlens, kernel)
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        x = self.wte(input_ids) + self.wpe(positions)
        if residual is not None:
            x = x.to(residual)
        blocks = blocks or self.blocks
        for block, block_mlp in zip(blocks, (mlp,) * len(blocks) if isinstance(mlp, str) else mlp, strict=True):
            if self.config.activation_checkpointing and self.training:
                x = checkpoint(block, x, layout, block_mlp, linear, use_reentrant=False)
            else:
                x = block(x, layout, block_mlp, linear)
        return self.ln_f(x) if out is None else self.ln_f(x).to(out)

    def compile_trunk(self) -> None:
        """torch.compile the trunk for training (the loss compiles its own per-chunk arithmetic).

        ``compile_scope`` "trunk" makes one graph from the embeddings to the final norm, which lets
        inductor fuse across block boundaries. "blocks" compiles each block; all blocks share the
        code and shapes, so one graph serves them all and compilation takes a fraction of the time.
        """
        # Process-wide, read when the graph is partitioned on first use.
        torch._functorch.config.activation_memory_budget = self.config.activation_memory_budget
        if self.config.compile_scope == "blocks":  # a plain list in a partial: no second copy in state_dict
            self._compiled_trunk = functools.partial(self._trunk, blocks=[torch.compile(b) for b in self.blocks])
        else:
            self._compiled_trunk = torch.compile(self._trunk)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab_size]."""
        return F.linear(self.hidden_states(input_ids, positions), self.lm_head_weight)

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """Summed next-token loss of a packed batch (input_ids, positions, targets, optional cu_seqlens)."""
        hidden = self.hidden_states(batch["input_ids"], batch.get("positions"), batch.get("cu_seqlens"))
        dtype = self.compute_dtype(hidden.device)
        kernel = loss.choose(self.config.loss_kernel, hidden.device, dtype)
        linear = self.chosen_linear_kernel(hidden.device)
        if torch.is_grad_enabled():
            self.loss_kernel = kernel
            self.loss_softmax = (loss.chunk_softmax_ran(self._compiled_trunk is not None, self.config.loss_softmax,
                                                        hidden.device, linear, dtype) if kernel == "chunked" else None)
        return loss.token_loss_sum(hidden, self.lm_head_weight, batch["targets"], self.config.loss_chunk_tokens,
                                   kernel, compiled=self._compiled_trunk is not None,
                                   softmax=self.config.loss_softmax, linear=linear)
