"""The LM head and the next-token cross-entropy, summed over the target tokens.

The head is the tied token embedding. Its logits are the largest tensor of a step (tokens x
vocabulary), so in training they never exist all at once: ``ChunkedLinearCrossEntropy`` computes
one chunk of logits at a time, with the loss and its gradients in the forward pass, over a
vocabulary padded to a multiple of ``VOCAB_ALIGNMENT``. Each chunk's logits, loss and logits
gradient come from a chunk function (``chunk_function``; ``model.kernels`` chooses which, from
``compute.loss``, when the model is built):

- ``"eager"``: PyTorch (CPU runs, the probe, models the tools build);
- ``"triton"``: cuBLAS's logits, then one Triton kernel that reads them twice and writes the
  gradient over them (``model.kernels.triton_cross_entropy``);
- ``"quack"``: the logits with each row's log-sum-exp from quack's GEMM epilogue (``model.kernels.quack_lse``,
  bf16 on Hopper), then the Triton kernel's single pass.

Validation (no gradients) takes the plain cross-entropy, chunk by chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # a target that takes no loss: the last token of a document, padding
VOCAB_ALIGNMENT = 128  # padded vocabulary keeps the head's matmuls on the aligned (fast) GEMM kernels


class LMHeadLoss(nn.Module):
    """The summed next-token loss of hidden states through the tied head, by its chunk function (``chunk_fn``, which
    the model hands it when it is built: ``chunk_function`` of the kernel ``model.kernels`` chose; a module without
    parameters: nothing of it is saved)."""

    def __init__(self, chunk_tokens: int, chunk_fn: Callable | None = None) -> None:
        super().__init__()
        self.chunk_tokens = chunk_tokens
        self.chunk_fn = chunk_fn or chunk_function("eager")

    def forward(self, hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(hidden, head_weight, targets, self.chunk_tokens, self.chunk_fn)


def padded_vocab_size(vocab_size: int) -> int:
    """The LM head's column count inside the loss: the vocabulary rounded up to VOCAB_ALIGNMENT."""
    return -(-vocab_size // VOCAB_ALIGNMENT) * VOCAB_ALIGNMENT


def token_loss_sum(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 0,
                   chunk_fn: Callable | None = None) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over targets != IGNORE_INDEX, in fp32.

    Returning the sum lets the caller divide by the whole optimizer update's target count. With
    ``chunk_tokens`` the full-vocabulary logits never exist at once (0: all at once, the plain path);
    in training each chunk is computed by ``chunk_fn`` (``chunk_function``'s; None: PyTorch's).
    """
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if not chunk_tokens:
        return cross_entropy_sum(hidden, head_weight, targets)
    if torch.is_grad_enabled():  # a batch of at most chunk_tokens is one chunk: still no saved logits
        return ChunkedLinearCrossEntropy.apply(hidden, head_weight, targets, chunk_tokens,
                                               chunk_fn or chunk_function("eager"))
    chunks = zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))
    return sum(cross_entropy_sum(h, head_weight, t) for h, t in chunks)


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype the head's products run in: autocast's where it is on, else the tensor's."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


def cross_entropy_sum(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain path: full logits, widened to at least fp32, and PyTorch's cross-entropy. The product runs in the
    hidden states' dtype, the compute dtype the trunk hands them in (autocast would cast the weight to it too)."""
    logits = F.linear(hidden, head_weight.to(hidden.dtype))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, dtype: torch.dtype):
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


def chunk_function(kernel: str) -> Callable:
    """What computes one chunk's loss and logits gradient from its rows and the padded head,
    ``(rows, padded_weight, targets, vocab_size, dtype) -> (loss, grad_logits)``, for ``kernel``:
    "eager", "triton" or "quack" (see the module's docstring)."""
    if kernel == "quack":
        return quack_chunk_loss_and_grad
    softmax = triton_chunk_loss_and_grad if kernel == "triton" else chunk_loss_and_grad
    return functools.partial(product_then_softmax, softmax)


def product_then_softmax(softmax_fn: Callable, rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         vocab_size: int, dtype: torch.dtype):
    """One chunk: its logits by cuBLAS (on CUDA), then ``softmax_fn`` on them."""
    return softmax_fn(rows @ weight.t(), targets, vocab_size, dtype)


def triton_chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, dtype: torch.dtype):
    """``chunk_loss_and_grad`` as one Triton kernel (``model.kernels.triton_cross_entropy``): the gradient
    is written over ``logits``, which the caller made for this chunk alone."""
    from model.kernels.triton_cross_entropy import loss_and_gradient_in_place  # Triton: CUDA builds of PyTorch only

    loss = loss_and_gradient_in_place(logits, targets, vocab_size, IGNORE_INDEX)
    return loss, logits.to(dtype)


def quack_chunk_loss_and_grad(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                              dtype: torch.dtype):
    """One chunk (bf16): its logits with each row's log-sum-exp by column tiles from one quack GEMM
    (``model.kernels.quack_lse``), then the Triton kernel's single pass, which folds the tiles' values and writes the
    gradient over the logits. quack and the CuTe DSL are imported on first use (seconds to load)."""
    from model.kernels import quack_lse
    from model.kernels.triton_cross_entropy import gradient_in_place  # Triton: CUDA builds of PyTorch only

    logits, tile_log_normalizers = quack_lse.logits_and_tile_log_normalizers(rows, weight, vocab_size)
    loss = gradient_in_place(logits, tile_log_normalizers, targets, vocab_size, IGNORE_INDEX)
    return loss, logits.to(dtype)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """LM head + summed cross-entropy, chunk by chunk, with the gradients computed on the way.

    Each chunk's logits live only while its loss and its gradients (softmax - one-hot, times the
    head) are computed, so peak memory holds one chunk of logits instead of all of them, and
    nothing is recomputed in backward. Under autocast the matmuls run in the autocast dtype, as
    F.linear would; the softmax and the sums stay in fp32 (at least). The vocabulary is padded to
    a multiple of VOCAB_ALIGNMENT inside the computation: with 50257 columns the GEMMs fall back
    to slow unaligned kernels. ``chunk_fn`` (``chunk_function``) computes each chunk's logits,
    loss and logits gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, chunk_fn):
        dtype = compute_dtype(hidden)
        exact = torch.promote_types(dtype, torch.float32)
        vocab, width = weight.shape
        padded = padded_vocab_size(vocab)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w = torch.zeros(padded, width, dtype=dtype, device=weight.device)
            w[:vocab] = weight
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(padded, width, dtype=exact, device=weight.device)
            loss = torch.zeros((), dtype=exact, device=hidden.device)
            # On CUDA the two gradient products of half-precision operands write where their results go: the
            # hidden gradient in its own dtype straight into its rows, the head's added into its fp32 sum by the
            # GEMM itself (out aliasing the sum: no copy of it, no rounded partial). Elsewhere the products are
            # widened, then stored and added.
            in_gemm = w.is_cuda and dtype in (torch.bfloat16, torch.float16) and exact == torch.float32
            for start in range(0, hidden.shape[0], chunk_tokens):
                stop = start + chunk_tokens
                h = hidden[start:stop].to(dtype)
                chunk_loss, grad_logits = chunk_fn(h, w, targets[start:stop], vocab, dtype)
                loss += chunk_loss
                if in_gemm and grad_hidden.dtype in (dtype, exact):
                    torch.mm(grad_logits, w, out_dtype=grad_hidden.dtype, out=grad_hidden[start:stop])
                else:
                    grad_hidden[start:stop] = (grad_logits @ w).to(hidden.dtype)
                if in_gemm:
                    torch.addmm(grad_weight, grad_logits.t(), h, out_dtype=exact, out=grad_weight)
                else:
                    grad_weight += (grad_logits.t() @ h).to(exact)
        ctx.save_for_backward(grad_hidden, grad_weight[:vocab])
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, (grad_weight * grad_loss).to(ctx.weight_dtype), None, None, None
