"""The LM head and the next-token cross-entropy, summed over the target tokens.

The head is the tied token embedding. Its logits are the largest tensor of a step (tokens x
vocabulary), so in training they never exist all at once. Which kernel computes the head and the
loss (``choose``, ``model.loss_kernel``):

- ``"chunked"``, the default: ``ChunkedLinearCrossEntropy``, pure PyTorch: one chunk of logits at a
  time, the loss and its gradients computed in the forward pass; it runs everywhere, and neither
  package is faster at this model's shapes (docs/PERFORMANCE.md).
- ``"liger"``: Liger-Kernel's fused linear cross-entropy (the optional ``liger-kernel`` package,
  Triton): the same scheme with its own chunking and loss kernel, on the unpadded vocabulary.
- ``"cce"``: Cut Cross-Entropy (the optional ``cut-cross-entropy`` package, Triton): the logits are
  computed tile by tile in on-chip memory and never written; the backward pass recomputes them.
  No gradient filtering here; it adds its gradient tiles into bf16 buffers.

Validation (no gradients) always takes the chunked path.

Inside the chunked loss, each chunk's softmax and its gradient (``model.loss_softmax``) run in
compiled CUDA training as a single Triton pass over logits whose log-sum-exp quack's GEMM computed in
its epilogue (``"gemm_lse"``, the default: ``model.quack_lse``; where quack computes the logits, in
bf16 on Hopper; else ``"triton"``); as one Triton kernel that reads the logits twice and writes the
gradient over them (``"triton"``: ``model.triton_cross_entropy``); or as the inductor-compiled
PyTorch function (``"compiled"``). Eager runs (CPU, the probe) take the PyTorch function as it is.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from model import quack_linear

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # a target that takes no loss: the last token of a document, padding
VOCAB_ALIGNMENT = 128  # padded vocabulary keeps the head's matmuls on the aligned (fast) GEMM kernels
Kernel = Literal["chunked", "liger", "cce"]  # model.loss_kernel
CHOICES = get_args(Kernel)
Softmax = Literal["triton", "gemm_lse", "compiled"]  # model.loss_softmax
GEMM_LSE_COMPUTE_CAPABILITY = 9  # Hopper: quack hands its epilogue functions single fp32 values (model.quack_lse)
SOFTMAX_CHOICES = get_args(Softmax)
PACKAGES = {"liger": ("liger-kernel", "liger_kernel.ops.fused_linear_cross_entropy"),
            "cce": ("cut-cross-entropy", "cut_cross_entropy")}
_modules: dict[str, object] = {}  # kernel -> its imported module
_errors: dict[str, str] = {}  # kernel -> why it could not be imported


def kernel_module(kernel: str):
    """The optional package behind ``kernel``, imported on first use; None if it does not import."""
    if kernel not in _modules and kernel not in _errors:
        package, module = PACKAGES[kernel]
        try:
            _modules[kernel] = importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - missing package, one built for another torch or Triton
            _errors[kernel] = f"{package} does not import ({type(error).__name__}: {str(error)[:200]})"
    return _modules.get(kernel)


_reported: set = set()


def choose(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel for ``model.loss_kernel`` = ``requested``. CPU runs and fp32 or fp16 runs take
    "chunked"; a package that does not import on a CUDA bf16 run is an error."""
    if requested == "chunked" or device.type != "cuda" or dtype != torch.bfloat16:
        return "chunked"
    if kernel_module(requested) is None:
        raise RuntimeError(f"model.loss_kernel is {requested!r} but {_errors[requested]}. "
                           f"Install {PACKAGES[requested][0]}, or use 'chunked'.")
    if requested not in _reported:
        _reported.add(requested)
        log.info("LM head and loss: %s (%s)", requested, PACKAGES[requested][0])
    return requested


def padded_vocab_size(vocab_size: int) -> int:
    """The LM head's column count inside the loss: the vocabulary rounded up to VOCAB_ALIGNMENT."""
    return -(-vocab_size // VOCAB_ALIGNMENT) * VOCAB_ALIGNMENT


def token_loss_sum(
    hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 0,
    kernel: str = "chunked", compiled: bool = False, softmax: str = "triton", linear: str = "torch",
) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over targets != IGNORE_INDEX, in fp32.

    Returning the sum lets the caller divide by the whole optimizer update's target count.
    ``kernel`` is what ``choose`` returned. With "chunked" and ``chunk_tokens`` the
    full-vocabulary logits never exist at once (0: all at once, the plain path); ``compiled``
    (compiled training) runs each chunk's softmax arithmetic as one kernel, which ``softmax``
    names on CUDA, and ``linear`` ("torch" or "quack", ``quack_linear.choose``) says what computes
    each chunk's logits (``chunk_function``).
    """
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if kernel != "chunked" and torch.is_grad_enabled():
        return fused_loss_sum(hidden, head_weight, targets, kernel)
    if not chunk_tokens:
        return cross_entropy_sum(hidden, head_weight, targets)
    if torch.is_grad_enabled():  # a batch of at most chunk_tokens is one chunk: still no saved logits
        chunk_fn = chunk_function(compiled, softmax, hidden.device, linear, compute_dtype(hidden))
        return ChunkedLinearCrossEntropy.apply(hidden, head_weight, targets, chunk_tokens, chunk_fn)
    chunks = zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))
    return sum(cross_entropy_sum(h, head_weight, t) for h, t in chunks)


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype the head's products run in: autocast's where it is on, else the tensor's."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


def fused_loss_sum(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, kernel: str):
    """The summed loss through Liger's or Cut Cross-Entropy's kernel, on bf16 operands (``choose``
    takes them only for bf16 runs): the fp32 weight is cast once per call and autograd carries its
    gradient back to fp32, as the chunked path does. Liger accumulates the head's gradient in fp32.
    """
    with torch.autocast("cuda", enabled=False):
        h, w = hidden.to(torch.bfloat16), head_weight.to(torch.bfloat16)
        if kernel == "liger":
            function = kernel_module("liger").LigerFusedLinearCrossEntropyFunction
            # input, weight, target, bias, class weights, ignore_index, z-loss scale, label smoothing,
            # reduction, softcap, return_z_loss, accumulation dtype
            loss = function.apply(h, w, targets, None, None, IGNORE_INDEX, 0.0, 0.0, "sum", None, False, torch.float32)
            return loss[0] if isinstance(loss, tuple) else loss
        return kernel_module("cce").linear_cross_entropy(h, w, targets, ignore_index=IGNORE_INDEX, reduction="sum",
                                                         filter_eps=None, impl="cce")


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


def chunk_softmax_ran(compiled: bool, softmax: str, device: torch.device, linear: str = "torch",
                      dtype: torch.dtype = torch.bfloat16) -> str:
    """What ``chunk_function`` takes for these arguments, by name: "eager", "triton", "gemm_lse" or
    "compiled". "gemm_lse" needs the logits from quack's GEMM (``linear``) in bf16 on Hopper
    (``model.quack_lse``); elsewhere on CUDA it is "triton"."""
    if not compiled:
        return "eager"
    if softmax == "compiled" or device.type != "cuda":
        return "compiled"
    if softmax == "gemm_lse" and linear == "quack" and dtype == torch.bfloat16 \
            and torch.cuda.get_device_capability(device)[0] == GEMM_LSE_COMPUTE_CAPABILITY:
        return "gemm_lse"
    return "triton"


def chunk_function(compiled: bool, softmax: str, device: torch.device, linear: str = "torch",
                   dtype: torch.dtype = torch.bfloat16) -> Callable:
    """What computes one chunk's loss and logits gradient from its rows and the padded head,
    ``(rows, padded_weight, targets, vocab_size, dtype) -> (loss, grad_logits)``: the logits by
    ``linear``'s product, then the PyTorch function in eager runs; in compiled training the Triton
    kernel on CUDA when ``softmax`` is "triton" (or "gemm_lse" where that cannot run), else the
    function compiled by inductor; or, for "gemm_lse" (``chunk_softmax_ran``), the logits with their
    log-sum-exp from quack's GEMM and the Triton kernel's single pass."""
    ran = chunk_softmax_ran(compiled, softmax, device, linear, dtype)
    if ran == "gemm_lse":
        return gemm_lse_chunk_loss_and_grad
    softmax_fn = {"eager": chunk_loss_and_grad, "triton": triton_chunk_loss_and_grad}.get(ran)
    return functools.partial(product_then_softmax, quack_linear.PRODUCT[linear],
                             softmax_fn or compiled_chunk_loss_and_grad())


def product_then_softmax(product: Callable, softmax_fn: Callable, rows: torch.Tensor, weight: torch.Tensor,
                         targets: torch.Tensor, vocab_size: int, dtype: torch.dtype):
    """One chunk: its logits by ``product`` (``quack_linear.PRODUCT``), then ``softmax_fn`` on them."""
    return softmax_fn(product(rows, weight), targets, vocab_size, dtype)


def triton_chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, dtype: torch.dtype):
    """``chunk_loss_and_grad`` as one Triton kernel (``model.triton_cross_entropy``): the gradient
    is written over ``logits``, which the caller made for this chunk alone."""
    from model.triton_cross_entropy import loss_and_gradient_in_place  # Triton: CUDA builds of PyTorch only

    loss = loss_and_gradient_in_place(logits, targets, vocab_size, IGNORE_INDEX)
    return loss, logits.to(dtype)


def gemm_lse_chunk_loss_and_grad(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                 dtype: torch.dtype):
    """One chunk (bf16): its logits with each row's log-sum-exp by column tiles from one quack GEMM
    (``logits_and_tile_log_normalizers``), then the Triton kernel's single pass, which folds the tiles' values and
    writes the gradient over the logits."""
    from model.triton_cross_entropy import gradient_in_place  # Triton: CUDA builds of PyTorch only

    logits, tile_log_normalizers = logits_and_tile_log_normalizers(rows, weight, vocab_size)
    loss = gradient_in_place(logits, tile_log_normalizers, targets, vocab_size, IGNORE_INDEX)
    return loss, logits.to(dtype)


def logits_and_tile_log_normalizers(rows: torch.Tensor, padded_weight: torch.Tensor, vocab_size: int):
    """``model.quack_lse.logits_and_tile_log_normalizers``, imported on first use (it imports quack and the CuTe DSL);
    tests swap in ``reference_logits_and_tile_log_normalizers`` where quack is absent."""
    from model import quack_lse

    return quack_lse.logits_and_tile_log_normalizers(rows, padded_weight, vocab_size)


REFERENCE_TILE_COLUMNS = 192  # quack's default tile width for the head's product on Hopper


def reference_logits_and_tile_log_normalizers(rows: torch.Tensor, padded_weight: torch.Tensor, vocab_size: int,
                                              tile_columns: int = REFERENCE_TILE_COLUMNS):
    """What ``logits_and_tile_log_normalizers`` computes, in PyTorch: the logits in the rows' dtype (NaN past the
    vocabulary, where quack's are left unwritten), and each row's log-sum-exp of those logits within each tile of
    ``tile_columns`` of its first ``vocab_size`` columns (the last tile ragged), in fp32 [rows, tiles]."""
    logits = rows @ padded_weight.t()
    logits[:, vocab_size:] = float("nan")
    tiles = logits[:, :vocab_size].float().split(tile_columns, dim=1)
    return logits, torch.stack([torch.logsumexp(tile, dim=-1) for tile in tiles], dim=1)


_compiled_chunk: Callable | None = None


def compiled_chunk_loss_and_grad() -> Callable:
    """``chunk_loss_and_grad`` through torch.compile, made once per process: every chunk has one shape."""
    global _compiled_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(chunk_loss_and_grad, dynamic=False)
    return _compiled_chunk


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
