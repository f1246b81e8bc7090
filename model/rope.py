"""Rotary position embeddings (``model.family: llama``), in the rotate-half convention of Hugging Face's Llama.

Each head's dimension is split in two halves; value i of the first half and value i of the second turn together by
the angle position x theta^(-2i / head_dim). With the halves paired this way (rather than neighbouring values) the
exported q and k weights are the trained ones, unpermuted. The positions are the rows' own, which restart at 0 with
every document of a packed row, so a document's rotations are those it gets alone.
"""

from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles [B, T, 1, head_dim] in fp32 (the 1 broadcasts over heads), for
    ``positions`` [B, T]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inverse_frequencies = 1.0 / (theta ** exponents)
    angles = positions.float()[..., None] * inverse_frequencies
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [B, T, heads, head_dim] turned by the angles of ``cos`` and ``sin``, computed in fp32 and returned in
    ``x``'s dtype (inside the compiled trunk one fused pointwise kernel)."""
    wide = x.float()
    first, second = wide.chunk(2, dim=-1)
    return (wide * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)
