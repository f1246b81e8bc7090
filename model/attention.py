"""Causal attention that never crosses a document boundary, and which kernel computes it.

``attend()`` is the one place attention is computed. Its kernel family (``choose``):

- ``"fa4"``: FlashAttention 4 (``model.flash4``, the optional ``flash-attn-4`` package): varlen for
  packed rows, dense causal for one-document rows;
- ``"flash"``: PyTorch's own CUDA kernels: ``varlen_attn`` for packed rows, fused causal SDPA for
  one-document rows;
- ``"sdpa"``: SDPA with a document mask, on every device and dtype.

``model.attention: auto`` takes FA4 where it imports and the GPU is one it supports, else "flash".
"""

from __future__ import annotations

import logging
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from model import flash4

try:  # the flash-attention varlen kernel; absent from older PyTorch and CPU-only builds it can't use
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

log = logging.getLogger(__name__)

Kernel = Literal["auto", "fa4", "varlen", "sdpa"]  # model.attention
CHOICES = get_args(Kernel)


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
    """Where the documents of a batch of rows start, in the forms the kernels want, and which
    kernel family runs ("fa4", "flash" or "sdpa").

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


def attend(qkv: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
    """Causal attention over ``qkv`` [B, T, 3, H, hd] (the projection's output, q, k, v packed) that
    never crosses a document boundary; returns [B, T, H, hd].

    FlashAttention 4 or PyTorch's varlen kernel see the documents as separate sequences of the
    flattened rows; SDPA sees one row per sequence, with the document mask. FA4 takes the packing as
    it is and returns its gradient packed the same way.
    """
    b, t, _, h, hd = qkv.shape
    if layout.use_fa4(qkv):
        if layout.positions is None:
            return flash4.fa4_attention(qkv)
        return flash4.fa4_attention(qkv.reshape(b * t, 3, h, hd), layout.offsets(), t).view(b, t, h, hd)
    q, k, v = qkv.unbind(2)
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


_reported: set = set()


def choose(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel family for ``model.attention`` = ``requested`` ("auto", "fa4", "varlen", "sdpa")."""
    if requested == "sdpa" or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "sdpa"
    if requested in ("auto", "fa4"):
        reason = flash4.fa4_unavailable_reason(device, head_dim)
        if reason is None:
            return "fa4"
        if requested == "fa4":
            raise RuntimeError(f"model.attention is 'fa4' but FlashAttention 4 cannot run: {reason}. "
                               f"Install it (README: Optional: FlashAttention 4) or use 'auto'.")
        if (requested, reason) not in _reported:
            _reported.add((requested, reason))
            log.info("attention: FlashAttention 4 not used (%s); PyTorch's kernels instead", reason)
    return "flash"


def describe(family: str, packed: bool) -> str:
    """What runs for a batch: packed rows (several documents) or one document per row."""
    if family == "fa4":
        version = flash4.installed_version(flash4.FA4_PACKAGE) or "?"
        return f"FlashAttention 4 {'varlen' if packed else 'dense causal'} (flash-attn-4 {version})"
    if family == "flash":
        return "varlen_attn (FlashAttention 2)" if packed else "SDPA is_causal (cuDNN/flash)"
    return "SDPA with a document mask" if packed else "SDPA is_causal"


def choose_and_record(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int, packed: bool,
                      used: dict[str, str]) -> str:
    """``choose``, and what ran noted in ``used`` under the batch kind it served (the run record
    reads it); each change is logged. Nothing is noted while tracing a compiled graph."""
    kernel = choose(requested, device, dtype, head_dim)
    if torch.compiler.is_compiling():
        return kernel
    kind = "packed rows" if packed else "one-document rows"
    description = describe(kernel, packed)
    if used.get(kind) != description:
        used[kind] = description
        log.info("attention for %s: %s", kind, description)
    return kernel
