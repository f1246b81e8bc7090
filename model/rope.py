"""Rotary position embeddings (``model.family: llama``), in the rotate-half convention of Hugging Face's Llama.

Each head's dimension is split in two halves; value i of the first half and value i of the second turn together by
the angle position x theta^(-2i / head_dim). With the halves paired this way (rather than neighbouring values) the
exported q and k weights are the trained ones, unpermuted. The positions are the rows' own, which restart at 0 with
every document of a packed row, so a document's rotations are those it gets alone.

``RotaryTable`` holds the cos and sin of every position up to ``max_seq_len``, computed once when the model is built
or moved: a forward looks its tokens' rows up (once, for every layer), so no compiled kernel evaluates cos or sin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles [B, T, 1, head_dim] in fp32 (the 1 broadcasts over heads), for
    ``positions`` [B, T]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inverse_frequencies = 1.0 / (theta ** exponents)
    angles = positions.float()[..., None] * inverse_frequencies
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    return angles.cos(), angles.sin()


class RotaryTable(nn.Module):
    """cos and sin [max_seq_len, head_dim] in fp32 of positions 0..max_seq_len - 1, as ``rotary_cos_sin`` computes
    them, held as buffers outside the state dict. They move with the model, and are computed again in fp32 on the
    new device whenever the model is moved, cast (a "-true" precision's ``module.to(dtype)``) or materialized from
    the meta device (``to_empty``): a cast never rounds them, and an uninitialized copy never stays."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, theta: float, max_seq_len: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_seq_len = head_dim, theta, max_seq_len
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.fill(self.cos.device)

    def fill(self, device: torch.device) -> None:
        positions = torch.arange(self.max_seq_len, device=device)[None]
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.theta)
        self.cos, self.sin = cos[0, :, 0], sin[0, :, 0]

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.fill(self.cos.device)
        return self

    def forward(self, positions: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, T, 1, head_dim] of ``positions`` [B, T]; for None (every row one document from 0),
        [1, length, 1, head_dim], which broadcasts over the rows."""
        if positions is None:
            return self.cos[None, :length, None], self.sin[None, :length, None]
        return F.embedding(positions, self.cos)[:, :, None], F.embedding(positions, self.sin)[:, :, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [B, T, heads, head_dim] turned by the angles of ``cos`` and ``sin``, computed in fp32 and returned in
    ``x``'s dtype (inside the compiled trunk one fused pointwise kernel)."""
    wide = x.float()
    first, second = wide.chunk(2, dim=-1)
    return (wide * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)
