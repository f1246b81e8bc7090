"""Which LayerNorm runs, and quack's fused residual-add + LayerNorm as PyTorch custom ops.

``model.add_layer_norm()`` stays the single entry; this module answers two questions for it:

- **Which kernel** (``choose``): ``"torch"``, the default (``residual + delta`` then ``nn.LayerNorm``,
  which inductor fuses with the casts and adds around them), or ``"quack"`` (the optional
  ``quack-kernels`` package, which FA4 already pulls in: one CuTe-DSL kernel reads the residual stream
  and the branch output and writes their sum and its LayerNorm, one backward kernel computes the input,
  weight and bias gradients and adds the stream's incoming gradient). quack is opt-in because it
  measured slower inside the compiled step: 476,181 against 501,463 tokens/s on an H200 (realistic
  documents, FA4, 2026-12-01; docs/PERFORMANCE.md), since the custom ops cut inductor's fusions and
  changed what the partitioner recomputes. CPU, fp32 and fp16 always take torch.
- **How quack runs inside a compiled graph**: ``runfab::add_layer_norm`` and
  ``runfab::add_layer_norm_backward`` are functional ``torch.library`` custom ops with fake (shape-only)
  implementations, so ``torch.compile`` traces the trunk as one graph; the forward's autograd formula
  calls the backward op. quack's own ops write into buffers they are given (mutating ops), which
  inductor must functionalize; wrapping them in ops that allocate their outputs keeps the graph plain.

The kernels compile at first use (a few seconds each) through the same CuTe DSL as FA4, so the same
cache settings apply (``attention_kernels.prepare_environment``).
"""

from __future__ import annotations

import importlib
import logging

import torch

from model import attention_kernels

log = logging.getLogger(__name__)

CHOICES = ("torch", "quack")
QUACK_PACKAGE = "quack-kernels"
QUACK_COMPUTE_CAPABILITIES = (9, 10)  # Hopper (measured alone) and Blackwell data-centre parts (not measured here)
_quack: object | None = None  # quack.rmsnorm once imported (it holds the LayerNorm kernels too)
_quack_error: str | None = None  # why it could not be imported


def quack_module():
    """quack.rmsnorm, imported on first use (seconds: it loads the CuTe DSL); None if absent."""
    global _quack, _quack_error
    if _quack is None and _quack_error is None:
        attention_kernels.prepare_environment()
        try:
            # The module by name: ``import quack.rmsnorm as m`` would bind quack's function ``rmsnorm``,
            # which quack's __init__ imports over the submodule's attribute.
            rmsnorm = importlib.import_module("quack.rmsnorm")
        except Exception as error:  # noqa: BLE001 - missing package, missing CUDA libraries, wrong Python
            _quack_error = f"quack does not import ({type(error).__name__}: {str(error)[:200]})"
        else:
            _quack = rmsnorm
    return _quack


def quack_unavailable_reason(device: torch.device) -> str | None:
    """None when quack's LayerNorm can run on ``device``, else why not."""
    if device.type != "cuda":
        return f"needs a CUDA device, not {device.type}"
    major, minor = attention_kernels.compute_capability(device)
    if major not in QUACK_COMPUTE_CAPABILITIES:
        return f"compute capability {major}.{minor} is not one quack is used on here (9.x, 10.x)"
    if quack_module() is None:
        return _quack_error
    return None


def choose(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The LayerNorm for ``model.norm_kernel`` = ``requested`` ("torch", "quack"), given the device and
    the activations' dtype (the autocast dtype under autocast)."""
    if requested == "torch" or device.type != "cuda" or dtype != torch.bfloat16:
        return "torch"  # CPU, fp32 and fp16 runs (evaluation, smoke tests) keep PyTorch's LayerNorm
    reason = quack_unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"model.norm_kernel is 'quack' but quack's LayerNorm cannot run: {reason}. "
                           f"Install quack-kernels (README: Optional: FlashAttention 4) or use 'torch'.")
    return "quack"


def describe(kernel: str) -> str:
    if kernel == "quack":
        return f"quack fused residual-add + LayerNorm (quack-kernels {attention_kernels.installed_version(QUACK_PACKAGE) or '?'})"
    return "torch LayerNorm (residual add separate; inductor fuses both when compiled)"


# ----------------------------------------------------------------------------- the custom ops
#
# As for FA4's ops, the implementation is a pair of functions, quack's by default; tests on machines
# without quack swap in a reference (tests/unit/test_norm_kernels.py), which is why the ops are
# registered for every device. All tensors are 2-D rows [M, N]; weight and bias [N].


def _quack_forward_impl(delta, residual, weight, bias, eps, out_dtype):
    rmsnorm = quack_module()
    delta, residual = delta.contiguous(), residual.contiguous()
    out = torch.empty_like(delta, dtype=out_dtype)
    summed = torch.empty_like(residual)
    mean = torch.empty(delta.shape[0], device=delta.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    # x, weight, out, bias, rstd, mean, residual, residual_out, eps, is_layernorm: the kernel adds x and
    # residual in fp32, stores the sum in residual_out's dtype and normalizes the fp32 sum.
    rmsnorm._rmsnorm_fwd(delta, weight, out, bias, rstd, mean, residual, summed, eps, True)
    return out, summed, mean, rstd


def _quack_backward_impl(grad_out, grad_sum, summed, weight, mean, rstd, delta_dtype):
    rmsnorm = quack_module()
    n = summed.shape[-1]
    sm_count = rmsnorm.get_sm_count(n, summed.device)  # persistent grid: one fp32 partial row of dw, db per CTA
    grad_delta = torch.empty_like(summed, dtype=delta_dtype)
    two_dtypes = delta_dtype != summed.dtype
    grad_residual = torch.empty_like(summed) if two_dtypes else summed.new_empty(0)
    dw_partial = torch.empty(sm_count, n, device=summed.device, dtype=torch.float32)
    db_partial = torch.empty_like(dw_partial)
    # The kernel adds the stream's incoming gradient (grad_sum) to the LayerNorm's input gradient and
    # writes the result twice when the two inputs differ in dtype: bf16 for the branch, fp32 for the stream.
    rmsnorm._rmsnorm_bwd(
        summed, weight, grad_out.contiguous(), rstd, grad_delta, dw_partial, db_partial,
        None if grad_sum is None else grad_sum.contiguous(), grad_residual if two_dtypes else None, sm_count,
        mean=mean, is_layernorm=True,
    )
    return grad_delta, grad_residual, dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype)


IMPLEMENTATION = {"forward": _quack_forward_impl, "backward": _quack_backward_impl}


@torch.library.custom_op("runfab::add_layer_norm", mutates_args=())
def add_layer_norm_forward(
    delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm(residual + delta) in ``out_dtype``, the sum in residual's dtype, and each row's fp32
    mean and reciprocal standard deviation (for the backward)."""
    out, summed, mean, rstd = IMPLEMENTATION["forward"](delta, residual, weight, bias, eps, out_dtype)
    return out.contiguous(), summed.contiguous(), mean.contiguous(), rstd.contiguous()


@add_layer_norm_forward.register_fake
def _(delta, residual, weight, bias, eps, out_dtype):
    rows = delta.new_empty(delta.shape[0], dtype=torch.float32)
    return delta.new_empty(delta.shape, dtype=out_dtype), residual.new_empty(residual.shape), rows, rows.new_empty(rows.shape)


@torch.library.custom_op("runfab::add_layer_norm_backward", mutates_args=())
def add_layer_norm_backward(
    grad_out: torch.Tensor, grad_sum: torch.Tensor | None, summed: torch.Tensor, weight: torch.Tensor,
    mean: torch.Tensor, rstd: torch.Tensor, delta_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of delta, of residual (empty when both share a dtype: then it equals delta's), weight, bias."""
    grads = IMPLEMENTATION["backward"](grad_out, grad_sum, summed, weight, mean, rstd, delta_dtype)
    return tuple(g.contiguous() for g in grads)


@add_layer_norm_backward.register_fake
def _(grad_out, grad_sum, summed, weight, mean, rstd, delta_dtype):
    residual_shape = summed.shape if delta_dtype != summed.dtype else (0,)
    return (summed.new_empty(summed.shape, dtype=delta_dtype), summed.new_empty(residual_shape),
            weight.new_empty(weight.shape), weight.new_empty(weight.shape))


def _setup_context(ctx, inputs, output) -> None:
    delta, residual, weight, bias, eps, out_dtype = inputs
    out, summed, mean, rstd = output
    ctx.save_for_backward(summed, weight, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.delta_dtype = delta.dtype
    ctx.two_dtypes = delta.dtype != residual.dtype


def _backward(ctx, grad_out, grad_sum, grad_mean, grad_rstd):
    summed, weight, mean, rstd = ctx.saved_tensors
    grad_delta, grad_residual, grad_weight, grad_bias = add_layer_norm_backward(
        grad_out, grad_sum, summed, weight, mean, rstd, ctx.delta_dtype)
    return grad_delta, grad_residual if ctx.two_dtypes else grad_delta, grad_weight, grad_bias, None, None


add_layer_norm_forward.register_autograd(_backward, setup_context=_setup_context)


def add_layer_norm(
    delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(residual + delta), residual + delta) over the last dimension, in one kernel each way.

    The normalized output comes in the autocast dtype (what the next matmul casts it to anyway, so
    half the bytes written); the sum keeps the residual stream's dtype (fp32 under bf16-mixed).
    """
    shape, width = residual.shape, residual.shape[-1]
    device = residual.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else residual.dtype
    out, summed, _, _ = add_layer_norm_forward(
        delta.reshape(-1, width), residual.reshape(-1, width), weight, bias, eps, out_dtype)
    return out.view(shape), summed.view(shape)
