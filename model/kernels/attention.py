"""Causal attention that never crosses a document boundary.

``attend()`` is the one place attention is computed, by one of three kernel families
(``model.kernels`` chooses which, from ``compute.attention``):

- ``"fa4"``: FlashAttention 4 (``model.kernels.flash4``, the optional ``flash-attn-4`` package): varlen for
  packed rows, dense causal for one-document rows;
- ``"flash"``: PyTorch's own CUDA kernels: ``varlen_attn`` for packed rows, fused causal SDPA for
  one-document rows;
- ``"sdpa"``: SDPA with a document mask, on every device and dtype.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model.kernels import flash4, gpu

try:  # the flash-attention varlen kernel; absent from older PyTorch and CPU-only builds it can't use
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None
# PyTorch versions whose varlen_attn has no enable_gqa need the key/value heads repeated to the query heads' count,
# there alone.
VARLEN_TAKES_GROUPS = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters


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
    """Where the documents of a batch of rows start, in the forms the kernels want, and the rotary angles of its
    tokens where the family turns q and k (``model.rope``).

    Built once per forward and shared by every layer. ``cu_seqlens`` usually comes precomputed
    with the batch (host side, no device sync); the mask is only built if a layer needs it.
    ``positions`` None means one document per row.
    """

    def __init__(self, positions: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                 rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.positions = positions
        self.cu_seqlens = cu_seqlens
        self.rotary = rotary  # cos and sin [B or 1, T, 1, head_dim] of every token, looked up once by the decoder
        self._mask: torch.Tensor | None = None

    def mask(self) -> torch.Tensor | None:
        if self.positions is not None and self._mask is None:
            self._mask = document_causal_mask(self.positions)
        return self._mask

    def offsets(self) -> torch.Tensor:
        if self.cu_seqlens is None:
            self.cu_seqlens = document_offsets(self.positions)
        return self.cu_seqlens


def attend(qkv: torch.Tensor, kv_heads: int, layout: DocumentLayout, kernel: str = "sdpa") -> torch.Tensor:
    """Causal attention that never crosses a document boundary, by the ``kernel`` family, over ``qkv``
    [B, T, H + 2 * kv_heads, hd]: the H query heads, then the key heads, then the value heads, as one
    projection writes them. With fewer key/value heads than query heads (grouped-query attention) each
    serves H / kv_heads consecutive query heads. Returns [B, T, H, hd].

    FlashAttention 4 or PyTorch's varlen kernel see the documents as separate sequences of the
    flattened rows; SDPA sees one row per sequence, with the document mask. FA4 takes the packing as
    it is and returns its gradient packed the same way. Every kernel takes the fewer key/value heads
    as they are.
    """
    b, t, heads, hd = qkv.shape
    h = heads - 2 * kv_heads
    if kernel == "fa4":
        if layout.positions is None:
            return flash4.fa4_attention(qkv, kv_heads)
        return flash4.fa4_attention(qkv.reshape(b * t, heads, hd), kv_heads, layout.offsets(), t).view(b, t, h, hd)
    q, k, v = qkv.split((h, kv_heads, kv_heads), dim=2)
    grouped = {"enable_gqa": True} if kv_heads != h else {}
    if (kernel == "flash" and layout.positions is not None and q.is_cuda and varlen_attn is not None
            and q.dtype in (torch.float16, torch.bfloat16)):
        cu = layout.offsets()
        if grouped and not VARLEN_TAKES_GROUPS:
            k, v = (z.repeat_interleave(h // kv_heads, dim=2) for z in (k, v))
            grouped = {}
        flat = [z.reshape(b * t, z.shape[2], hd) for z in (q, k, v)]
        return varlen_attn(*flat, cu, cu, t, t, window_size=(-1, 0), **grouped).view(b, t, h, hd)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    mask = layout.mask()
    if mask is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **grouped)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **grouped)
    return y.transpose(1, 2)


def kernel(family: str) -> Callable[[torch.Tensor, int, DocumentLayout], torch.Tensor]:
    """``attend`` by ``family`` ("fa4", "flash", "sdpa"), as a block holds it from its build: (qkv, kv_heads,
    layout) -> [B, T, H, hd]."""
    return functools.partial(attend, kernel=family)


def describe(family: str, packed: bool) -> str:
    """What runs for a batch: packed rows (several documents) or one document per row."""
    if family == "fa4":
        version = gpu.installed_version(flash4.FA4_PACKAGE) or "?"
        return f"FlashAttention 4 {'varlen' if packed else 'dense causal'} (flash-attn-4 {version})"
    if family == "flash":
        return "varlen_attn (FlashAttention 2)" if packed else "SDPA is_causal (cuDNN/flash)"
    return "SDPA with a document mask" if packed else "SDPA is_causal"
