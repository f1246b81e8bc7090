"""FlashAttention 4 (the optional ``flash-attn-4`` package) as PyTorch custom ops.

``runfab::fa4_forward`` and ``runfab::fa4_backward`` are ``torch.library`` custom ops with fake
(shape-only) implementations, so ``torch.compile`` traces the trunk as one graph instead of breaking
at every layer's CuTe-DSL launch; the forward's autograd formula calls the backward op. Which kernel
runs is decided in ``model.kernels``; this module says whether FA4 can run at all.

FA4 compiles its kernels at first use (a few seconds each), into the caches ``model.kernels.gpu`` sets up.
"""

from __future__ import annotations

import logging
import warnings

import torch

from model.kernels import gpu

log = logging.getLogger(__name__)

FA4_PACKAGE = "flash-attn-4"
FA4_COMPUTE_CAPABILITIES = (9, 10)  # Hopper and Blackwell data-centre parts
FA4_HEAD_DIMS = range(8, 129, 8)  # what FA4 compiles on both: multiples of 8 up to 128

_fa4: object | None = None  # flash_attn.cute.interface once imported
_fa4_error: str | None = None  # why it could not be imported


def fa4_interface():
    """flash_attn.cute.interface, imported on first use (seconds: it loads the CuTe DSL); None if absent."""
    global _fa4, _fa4_error
    if _fa4 is None and _fa4_error is None:
        gpu.prepare_environment()
        # The CuTe DSL warns at every kernel compilation that FA4's aux_data argument is not a JIT
        # argument (FA4 passes it on purpose as a compile-time value): noise in the training log.
        warnings.filterwarnings("ignore", message="Argument aux_data .* cannot be converted to a JitArgument")
        try:
            import flash_attn.cute.interface as interface
        except Exception as error:  # noqa: BLE001 - missing package, missing CUDA libraries, wrong Python
            _fa4_error = f"flash_attn.cute does not import ({type(error).__name__}: {str(error)[:200]})"
        else:
            _fa4 = interface
    return _fa4


def fa4_unavailable_reason(capability: tuple[int, int] | None, head_dim: int) -> str | None:
    """None when FA4 can run attention of ``head_dim`` on a GPU of compute ``capability`` (None: no CUDA device),
    else why not."""
    if capability is None:
        return "needs a CUDA device"
    major, minor = capability
    if major not in FA4_COMPUTE_CAPABILITIES:
        return f"compute capability {major}.{minor} is not one FA4 supports here (9.x, 10.x)"
    if head_dim not in FA4_HEAD_DIMS:
        return f"head dimension {head_dim} is not a multiple of 8 up to 128"
    return fa4_import_problem()


def fa4_import_problem() -> str | None:
    """None when FA4's interface imports (tried once), else why not."""
    return None if fa4_interface() is not None else _fa4_error


# ----------------------------------------------------------------------------- the custom ops
#
# Registered for every device, as custom ops are; FA4 itself runs on CUDA alone.


def _fa4_forward_impl(q, k, v, cu_seqlens, max_seqlen):
    fa = fa4_interface()
    varlen = cu_seqlens is not None
    result = fa._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen if varlen else None, max_seqlen_k=max_seqlen if varlen else None,
        causal=True, return_lse=True,
    )
    return result[0], result[1]


def _fa4_backward_impl(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, dq, dk, dv) -> None:
    """FA4's backward, writing the gradients into ``dq``, ``dk``, ``dv`` (views of one buffer)."""
    fa = fa4_interface()
    varlen = cu_seqlens is not None
    written = fa._flash_attn_bwd(
        q, k, v, out, dout, lse, causal=True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen if varlen else None, max_seqlen_k=max_seqlen if varlen else None,
        dq=dq, dk=dk, dv=dv,
    )[:3]
    for result, buffer in zip(written, (dq, dk, dv)):
        if result.data_ptr() != buffer.data_ptr():  # FA4 4.0.0b36 writes in place; a version that does not
            buffer.copy_(result)


def _split(qkv: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as views of ``qkv`` [..., H + 2 * kv_heads, hd]: FA4 reads them strided, and takes fewer key/value
    heads than query heads (grouped-query attention) as they are."""
    heads = qkv.shape[-2]
    return qkv.split((heads - 2 * kv_heads, kv_heads, kv_heads), dim=-2)


def _lse_shape(qkv: torch.Tensor, kv_heads: int, varlen: bool) -> tuple[int, ...]:
    h = qkv.shape[-2] - 2 * kv_heads
    if varlen:  # qkv [total, H + 2 KV, hd] -> [H, total]
        return (h, qkv.shape[0])
    return (qkv.shape[0], h, qkv.shape[1])  # qkv [B, T, H + 2 KV, hd] -> [B, H, T]


def _out_shape(qkv: torch.Tensor, kv_heads: int) -> tuple[int, ...]:
    return (*qkv.shape[:-2], qkv.shape[-2] - 2 * kv_heads, qkv.shape[-1])


# The ops take q, k and v packed as the qkv projection leaves them ([..., H + 2 KV, hd]) and return the
# gradient in that same packing: FA4 reads q, k, v as strided views and writes dq, dk, dv into views
# of one buffer, so no copy joins three separate gradients into the projection's gradient.


@torch.library.custom_op("runfab::fa4_forward", mutates_args=())
def fa4_forward(qkv: torch.Tensor, kv_heads: int, cu_seqlens: torch.Tensor | None,
                max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention and its log-sum-exp (fp32). Dense: qkv [B, T, H + 2 KV, hd], cu_seqlens None.
    Varlen: [total, H + 2 KV, hd] with int32 document offsets ``cu_seqlens`` and the longest length bound."""
    out, lse = _fa4_forward_impl(*_split(qkv, kv_heads), cu_seqlens, max_seqlen)
    return out.contiguous(), lse.contiguous()  # the layouts the fake implementation promises


@fa4_forward.register_fake
def _(qkv, kv_heads, cu_seqlens, max_seqlen):
    return (qkv.new_empty(_out_shape(qkv, kv_heads)),
            qkv.new_empty(_lse_shape(qkv, kv_heads, cu_seqlens is not None), dtype=torch.float32))


@torch.library.custom_op("runfab::fa4_backward", mutates_args=())
def fa4_backward(
    dout: torch.Tensor, qkv: torch.Tensor, kv_heads: int, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None, max_seqlen: int,
) -> torch.Tensor:
    """The gradient of ``fa4_forward``'s output with respect to ``qkv``, packed as ``qkv``."""
    dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    _fa4_backward_impl(dout, *_split(qkv, kv_heads), out, lse, cu_seqlens, max_seqlen, *_split(dqkv, kv_heads))
    return dqkv


@fa4_backward.register_fake
def _(dout, qkv, kv_heads, out, lse, cu_seqlens, max_seqlen):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    qkv, kv_heads, cu_seqlens, max_seqlen = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse, cu_seqlens)
    ctx.kv_heads, ctx.max_seqlen = kv_heads, max_seqlen


def _backward(ctx, grad_out, grad_lse):  # the log-sum-exp is not differentiated: attention returns only out
    qkv, out, lse, cu_seqlens = ctx.saved_tensors
    return fa4_backward(grad_out, qkv, ctx.kv_heads, out, lse, cu_seqlens, ctx.max_seqlen), None, None, None


fa4_forward.register_autograd(_backward, setup_context=_setup_context)


def fa4_attention(qkv: torch.Tensor, kv_heads: int, cu_seqlens: torch.Tensor | None = None,
                  max_seqlen: int = 0) -> torch.Tensor:
    """Causal FA4 attention of packed ``qkv`` with ``kv_heads`` key/value heads: dense [B, T, H + 2 KV, hd] when
    ``cu_seqlens`` is None, else varlen [total, H + 2 KV, hd]; returns [B, T, H, hd] or [total, H, hd]."""
    return fa4_forward(qkv, kv_heads, cu_seqlens, max_seqlen)[0]
