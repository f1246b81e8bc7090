"""The residual adds that follow a matrix product, inside the product (``model.residual_in_gemm``).

Each block adds two products to the residual stream: the attention's output projection and the MLP's
proj. Written as ``x + F.linear(h, w)``, the GEMM writes its output and a separate kernel (inductor's, fused
with the LayerNorm after it) reads it back beside the stream. As one ``torch.addmm(x, h, w.t())``, cuBLAS
reads the stream as the GEMM's C operand in its epilogue and writes the sum: one pass over the stream's
bytes fewer per add, and one rounding of the sum instead of two. Inductor keeps the ``addmm`` whole where a
reduction (the next LayerNorm) or another product reads the sum; where only pointwise kernels would, it
splits it back into a product and an add that they fuse.

Only where the stream already has the product's dtype: under autocast ``addmm`` casts its C operand to the
compute dtype, which would round an fp32 stream (``model.residual_in_fp32``) to bf16.
"""

from __future__ import annotations

import torch


def add_product(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x + h @ weight.t()`` by one ``torch.addmm`` over rows: x [..., m], h [..., k], weight [m, k]; x's shape."""
    rows = torch.addmm(x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1]), weight.t())
    return rows.view(x.shape)


def fusable(x: torch.Tensor) -> bool:
    """Whether ``x`` (the residual stream) has the dtype the products compute in here, so that ``add_product``
    adds it unrounded."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return x.dtype == dtype
