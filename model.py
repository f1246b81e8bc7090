"""The GPT-style decoder: pure PyTorch, no framework, readable top to bottom.

Pre-LayerNorm blocks (LayerNorm with bias), learned absolute positions, bias-free linear
layers, a GELU MLP of width 4d, and a token embedding tied to the LM head. Rows may pack
several documents: ``positions`` restart at 0 where a document starts, and attention never
crosses that boundary.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import attention_kernels
import norm_kernels

try:  # the flash-attention varlen kernel; absent from older PyTorch and CPU-only builds it can't use
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

IGNORE_INDEX = -100
ATTENTION_CHOICES = ("auto", "fa4", "varlen", "sdpa")
COMPILE_SCOPES = ("trunk", "blocks")

log = logging.getLogger(__name__)


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # embedding rows; at least the tokenizer's vocabulary
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block; must divide n_embd
    n_embd: int = 768  # width of the residual stream
    max_seq_len: int = 4096  # row length of packed training sequences and number of learned positions
    layer_norm_eps: float = 1e-5  # LayerNorm epsilon
    init_std: float = 0.02  # std of the normal weight init (residual projections scaled down by depth)
    activation_checkpointing: bool = False  # recompute each block in the backward pass to save memory
    activation_memory_budget: float = 0.75  # compiled trunk: below 1, the partitioner recomputes cheap ops to save activations
    # "auto": FlashAttention 4 where it is installed and the GPU supports it, else "varlen"; "fa4": FA4, and an
    # error on a GPU where it cannot run; "varlen": PyTorch's CUDA kernels (varlen flash for packed rows, fused
    # causal SDPA for one-document rows); "sdpa": SDPA with a document mask. CPU and fp32 always take SDPA
    # (attention_kernels.choose).
    attention: str = "auto"
    # "torch": the residual add and nn.LayerNorm, which inductor fuses when compiled; "quack": quack's fused
    # residual-add + LayerNorm (quack-kernels, installed with FA4), an error on a GPU where it cannot run. quack
    # measured 5 % slower inside the compiled step (docs/PERFORMANCE.md, 2026-12-01). CPU, fp32 and fp16 always
    # take "torch" (norm_kernels.choose). The weights and their names are the same either way.
    norm_kernel: str = "torch"
    # Experiment, off unless measured to pay: the blocks' Linear layers (qkv, attention and MLP projections) train
    # with torchao's float8 tensorwise scaling (fp8.py). Needs CUDA with compute capability 8.9+ and torchao;
    # refused otherwise. The LM head and embeddings stay bf16.
    fp8: bool = False
    loss_chunk_tokens: int = 16384  # LM head + cross-entropy in chunks of this many tokens; 0: all at once
    compile_scope: str = "trunk"  # what torch.compile takes: "trunk" (one graph) or "blocks" (one graph all blocks share)

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
        if self.loss_chunk_tokens < 0 or self.layer_norm_eps <= 0 or self.init_std <= 0:
            found.append("model.loss_chunk_tokens must be >= 0, model.layer_norm_eps and model.init_std > 0")
        if not 0 <= self.activation_memory_budget <= 1:
            found.append(f"model.activation_memory_budget must lie in [0, 1] (1: no extra recomputation), "
                         f"not {self.activation_memory_budget}")
        if self.n_head >= 1 and self.n_embd % self.n_head:
            found.append(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        if self.attention not in ATTENTION_CHOICES:
            found.append(f"model.attention must be one of {', '.join(ATTENTION_CHOICES)}, not {self.attention!r}")
        if self.norm_kernel not in norm_kernels.CHOICES:
            found.append(f"model.norm_kernel must be one of {', '.join(norm_kernels.CHOICES)}, not {self.norm_kernel!r}")
        if self.compile_scope not in COMPILE_SCOPES:
            found.append(f"model.compile_scope must be one of {', '.join(COMPILE_SCOPES)}, not {self.compile_scope!r}")
        return found


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, 1, T, T]: token i sees token j iff j <= i and both lie in one document.

    A document starts wherever ``positions`` is 0, so segment ids are a running count of starts.
    """
    segment = torch.cumsum(positions == 0, dim=-1)
    same_document = segment[:, :, None] == segment[:, None, :]
    t = positions.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    return (same_document & causal).unsqueeze(1)


def document_offsets(positions: torch.Tensor) -> torch.Tensor:
    """int32 offsets of each document in the flattened rows, plus the total: flash-attention's cu_seqlens."""
    flat = positions.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    total = torch.tensor([flat.numel()], device=flat.device)
    return torch.cat([starts, total]).to(torch.int32)


class DocumentLayout:
    """Where the documents of a batch of rows start, in the forms the attention kernels want, and
    which kernel family runs (``attention_kernels.choose``: "fa4", "flash" or "sdpa").

    Built once per forward and shared by every layer. ``cu_seqlens`` usually comes precomputed
    with the batch (host side, no device sync); the mask is only built if a layer needs it.
    ``positions`` None means one document per row.
    """

    def __init__(self, positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None, kernel: str) -> None:
        self.positions = positions
        self.cu_seqlens = cu_seqlens
        self.kernel = kernel
        self._mask: torch.Tensor | None = None

    def use_fa4(self, q: torch.Tensor) -> bool:
        return self.kernel == "fa4" and q.is_cuda

    def use_varlen(self, q: torch.Tensor) -> bool:
        if self.positions is None or self.kernel != "flash" or not q.is_cuda or varlen_attn is None:
            return False
        return q.dtype in (torch.float16, torch.bfloat16)

    def mask(self) -> torch.Tensor | None:
        if self.positions is not None and self._mask is None:
            self._mask = document_causal_mask(self.positions)
        return self._mask

    def offsets(self) -> torch.Tensor:
        if self.cu_seqlens is None:
            self.cu_seqlens = document_offsets(self.positions)
        return self.cu_seqlens


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
    """Causal attention over [B, T, H, hd] that never crosses a document boundary; returns [B, T, H, hd].

    The one place attention is computed: FlashAttention 4 (varlen for packed rows, dense causal
    for one-document rows) or PyTorch's varlen flash kernel on CUDA (documents as separate
    sequences), PyTorch SDPA elsewhere (one row per sequence, document mask).
    """
    b, t, h, hd = q.shape
    if layout.use_fa4(q):
        if layout.positions is None:
            return attention_kernels.fa4_attention(q, k, v)
        cu = layout.offsets()
        flat = [z.reshape(b * t, h, hd) for z in (q, k, v)]
        return attention_kernels.fa4_attention(*flat, cu, t).view(b, t, h, hd)
    if layout.use_varlen(q):
        cu = layout.offsets()
        flat = [z.reshape(b * t, h, hd) for z in (q, k, v)]
        return varlen_attn(*flat, cu, cu, t, t, window_size=(-1, 0)).view(b, t, h, hd)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    mask = layout.mask()
    if mask is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return y.transpose(1, 2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head) for z in (q, k, v))
        return self.proj(attend(q, k, v, layout).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def add_layer_norm(norm: nn.LayerNorm, residual: torch.Tensor, delta: torch.Tensor, kernel: str):
    """(norm(residual + delta), residual + delta): a pre-LN block's residual add and the LayerNorm
    that follows it. With ``kernel`` "quack" one kernel reads both and writes both (norm_kernels)."""
    if kernel == "quack":
        return norm_kernels.add_layer_norm(delta, residual, norm.weight, norm.bias, norm.eps)
    residual = residual + delta
    return norm(residual), residual


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, residual: torch.Tensor, delta: torch.Tensor, layout: DocumentLayout, norm: str = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)), with each add deferred into the LayerNorm after
        it: the stream comes in and goes out as (residual, delta), the branch output not yet added."""
        h, residual = add_layer_norm(self.ln_1, residual, delta, norm)
        h, residual = add_layer_norm(self.ln_2, residual, self.attn(h, layout), norm)
        return residual, self.mlp(h)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.max_seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self._compiled_trunk: Callable | None = None  # what training calls instead of _trunk
        self._compiled_loss_chunk = None
        self.attention_kernels: dict[str, str] = {}  # batch kind -> the kernel that ran it (run record, log)
        self.norm_kernel_used: str | None = None  # the LayerNorm that ran (run record, log)
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
        """Final-LayerNorm hidden states [B, T, d].

        ``positions`` None means one document per row; ``cu_seqlens`` (document offsets in the
        flattened rows, see document_offsets) may come with the batch to spare a device sync, and
        then also tells, from its shape alone, when every row is one document.
        Training runs the compiled trunk once ``compile_trunk`` was called; evaluation stays eager.
        """
        if input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
        if cu_seqlens is not None and cu_seqlens.shape[0] == input_ids.shape[0] + 1:
            # As many documents as rows, and every row starts one: each row is a single document
            # with positions 0..T-1, plain causal attention, which dense causal kernels do fastest.
            positions = cu_seqlens = None
        kernel = self.attention_kernel(input_ids.device, packed=positions is not None)
        norm = self.layer_norm_kernel(input_ids.device)
        if self._compiled_trunk is not None and self.training:
            if cu_seqlens is not None:
                torch._dynamo.mark_dynamic(cu_seqlens, 0)  # document counts vary: one graph for all
            return self._compiled_trunk(input_ids, positions, cu_seqlens, kernel, norm)
        return self._trunk(input_ids, positions, cu_seqlens, kernel, norm)

    def activation_dtype(self, device: torch.device) -> torch.dtype:
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else self.wte.weight.dtype

    def attention_kernel(self, device: torch.device, packed: bool) -> str:
        """The attention kernel family for this forward (decided here, outside any compiled graph),
        recorded with the batch kind it served; the first use of each is logged."""
        dtype = self.activation_dtype(device)
        kernel = attention_kernels.choose(self.config.attention, device, dtype, self.config.n_embd // self.config.n_head)
        if torch.compiler.is_compiling():  # traced inside someone's compiled forward: no bookkeeping in the graph
            return kernel
        kind = "packed rows" if packed else "one-document rows"
        used = attention_kernels.describe(kernel, packed)
        if self.attention_kernels.get(kind) != used:
            self.attention_kernels[kind] = used
            log.info("attention for %s: %s", kind, used)
        return kernel

    def layer_norm_kernel(self, device: torch.device) -> str:
        """The LayerNorm for this forward, chosen as the attention kernel is; recorded and logged when it changes."""
        kernel = norm_kernels.choose(self.config.norm_kernel, device, self.activation_dtype(device))
        if torch.compiler.is_compiling():
            return kernel
        used = norm_kernels.describe(kernel)
        if self.norm_kernel_used != used:
            self.norm_kernel_used = used
            log.info("LayerNorm: %s", used)
        return kernel

    def _trunk(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
        kernel: str = "sdpa", norm: str = "torch", blocks: list[nn.Module] | None = None,
    ) -> torch.Tensor:
        b, t = input_ids.shape
        layout = DocumentLayout(positions, cu_seqlens, kernel)
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        residual, delta = self.wte(input_ids), self.wpe(positions)  # added by the first block's first norm
        for block in blocks or self.blocks:
            if self.config.activation_checkpointing and self.training:
                residual, delta = checkpoint(block, residual, delta, layout, norm, use_reentrant=False)
            else:
                residual, delta = block(residual, delta, layout, norm)
        return add_layer_norm(self.ln_f, residual, delta, norm)[0]

    def compile_trunk(self) -> None:
        """torch.compile the trunk for training, and the loss's per-chunk softmax arithmetic.

        ``compile_scope`` "trunk" makes one graph from the embeddings to the final norm, which lets
        inductor fuse across block boundaries. "blocks" compiles each block; all blocks share the
        code and shapes, so one graph serves them all and compilation takes a fraction of the time
        (under autocast the first block gets one of its own: the stream it receives, the embeddings,
        is fp32 where the others receive a bf16 branch output).
        """
        if self.config.activation_memory_budget < 1.0:  # read when the graph is partitioned, on first use
            torch._functorch.config.activation_memory_budget = self.config.activation_memory_budget
        if self.config.compile_scope == "blocks":  # a plain list in a partial: no second copy in state_dict
            self._compiled_trunk = functools.partial(self._trunk, blocks=[torch.compile(b) for b in self.blocks])
        else:
            self._compiled_trunk = torch.compile(self._trunk)
        self._compiled_loss_chunk = torch.compile(_chunk_loss_and_grad, dynamic=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab_size]."""
        return F.linear(self.hidden_states(input_ids, positions), self.lm_head_weight)

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """Summed next-token loss of a packed batch (input_ids, positions, targets, optional cu_seqlens)."""
        hidden = self.hidden_states(batch["input_ids"], batch.get("positions"), batch.get("cu_seqlens"))
        return token_loss_sum(
            hidden, self.lm_head_weight, batch["targets"], self.config.loss_chunk_tokens, self._compiled_loss_chunk
        )


def token_loss_sum(
    hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 0,
    chunk_fn: Callable | None = None,
) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over targets != IGNORE_INDEX, in fp32.

    Returning the sum lets the caller divide by the whole optimizer update's target count.
    With ``chunk_tokens`` the full-vocabulary logits never exist at once (ChunkedLinearCrossEntropy).
    """
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if not chunk_tokens:
        return _cross_entropy_sum(hidden, head_weight, targets)
    if torch.is_grad_enabled():  # a batch of at most chunk_tokens is one chunk: still no saved logits
        chunk_fn = chunk_fn or _chunk_loss_and_grad
        return ChunkedLinearCrossEntropy.apply(hidden, head_weight, targets, chunk_tokens, chunk_fn)
    chunks = zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))
    return sum(_cross_entropy_sum(h, head_weight, t) for h, t in chunks)


def _cross_entropy_sum(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, head_weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


VOCAB_ALIGNMENT = 128  # padded vocabulary keeps the head's matmuls on the aligned (fast) GEMM kernels


def padded_vocab_size(vocab_size: int) -> int:
    """The LM head's column count inside the loss: the vocabulary rounded up to VOCAB_ALIGNMENT."""
    return -(-vocab_size // VOCAB_ALIGNMENT) * VOCAB_ALIGNMENT


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, dtype: torch.dtype):
    """Summed loss of one chunk and d(loss)/d(logits) = softmax - one-hot (zero for ignored targets).

    ``logits`` come in the matmul's dtype and are widened here to at least fp32. The one-hot is a
    comparison, not a scatter, so inductor fuses the function into one reduction kernel that reads
    the logits and writes the gradient in ``dtype`` (no fp32 copy of the chunk); eager (the
    probe, CPU runs), the in-place steps hold one fp32 copy. Columns past ``vocab_size`` are
    padding: -inf logits, so they take no probability.
    """
    columns = torch.arange(logits.shape[1], device=logits.device)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)  # ours to change in place
    logits.masked_fill_(columns >= vocab_size, float("-inf"))
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    log_normalizer = torch.logsumexp(logits, dim=-1)
    loss = torch.where(valid, log_normalizer - logits.gather(1, safe[:, None]).squeeze(1), 0.0).sum()
    grad = logits.sub_(log_normalizer[:, None]).exp_()
    grad = grad.sub_((columns[None, :] == safe[:, None]).to(grad.dtype)).mul_(valid[:, None])
    return loss, grad.to(dtype)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """LM head + summed cross-entropy, chunk by chunk, with the gradients computed on the way.

    Each chunk's logits live only while its loss and its gradients (softmax - one-hot, times the
    head) are computed, so peak memory holds one chunk of logits instead of all of them, and
    nothing is recomputed in backward. Under autocast the matmuls run in the autocast dtype, as
    F.linear would; the softmax and the sums stay in fp32 (at least). The vocabulary is padded to
    a multiple of VOCAB_ALIGNMENT inside the computation: with 50257 columns the GEMMs fall back
    to slow unaligned kernels.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, chunk_fn=_chunk_loss_and_grad):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        exact = torch.promote_types(dtype, torch.float32)
        vocab, width = weight.shape
        padded = padded_vocab_size(vocab)
        with torch.autocast(device_type=device, enabled=False):
            w = torch.zeros(padded, width, dtype=dtype, device=weight.device)
            w[:vocab] = weight
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(padded, width, dtype=exact, device=weight.device)
            loss = torch.zeros((), dtype=exact, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_tokens):
                h = hidden[start : start + chunk_tokens].to(dtype)
                logits = h @ w.t()
                chunk_loss, grad_logits = chunk_fn(logits, targets[start : start + chunk_tokens], vocab, dtype)
                loss += chunk_loss
                grad_hidden[start : start + chunk_tokens] = (grad_logits @ w).to(hidden.dtype)
                grad_weight += (grad_logits.t() @ h).to(exact)
        ctx.save_for_backward(grad_hidden, grad_weight[:vocab])
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, (grad_weight * grad_loss).to(ctx.weight_dtype), None, None, None


def training_flops(config: GPTConfig, tokens: int, attention_pairs: int) -> float:
    """The training lab's estimate of forward+backward matrix FLOPs (for MFU).

    6 * (12 L d^2 + V d) per token for the dense layers and LM head, plus 12 L d per causal
    attention pair counted as sum(s^2) over independent document segments s.
    """
    dense = 6 * (12 * config.n_layer * config.n_embd**2 + config.vocab_size * config.n_embd) * tokens
    return dense + 12 * config.n_layer * config.n_embd * attention_pairs


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (the tied embedding/head counted once)."""
    return sum(p.numel() for p in model.parameters())
