"""Experiment: the chunk softmax with each whole row held in registers, so the logits are read once
and written once (the model's kernel, model/triton_cross_entropy.py, reads each row twice).

A row of the padded GPT-2 vocabulary is three power-of-two spans (32,768 + 16,384 + 2,048 columns,
the last one masked past 50,304): Triton blocks must be powers of two, and one 65,536-column block
would hold 30 % padding in registers. `bench tiles --softmax` times it against the model's kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _resident_rows(logits, row_loss, targets, row_stride, vocab, padded, ignore_index,
                   A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start_of_row = logits + row * row_stride
    target = tl.load(targets + row)
    valid = target != ignore_index
    ca = tl.arange(0, A)
    cb = A + tl.arange(0, B)
    cc = A + B + tl.arange(0, C)
    xa = tl.load(start_of_row + ca, mask=ca < vocab, other=float("-inf"))
    xb = tl.load(start_of_row + cb, mask=cb < vocab, other=float("-inf"))
    xc = tl.load(start_of_row + cc, mask=cc < vocab, other=float("-inf"))
    target_logit = tl.load(start_of_row + tl.where(valid, target, 0)).to(tl.float32)
    row_max = tl.maximum(tl.maximum(tl.max(xa, axis=0), tl.max(xb, axis=0)), tl.max(xc, axis=0)).to(tl.float32)
    exp_sum = (tl.sum(tl.exp(xa.to(tl.float32) - row_max), axis=0) + tl.sum(tl.exp(xb.to(tl.float32) - row_max), axis=0)
               + tl.sum(tl.exp(xc.to(tl.float32) - row_max), axis=0))
    log_normalizer = row_max + tl.log(exp_sum)
    tl.store(row_loss + row, tl.where(valid, log_normalizer - target_logit, 0.0))
    scale = tl.where(valid, 1.0, 0.0)
    ga = (tl.exp(xa.to(tl.float32) - log_normalizer) - tl.where(ca == target, 1.0, 0.0)) * scale
    tl.store(start_of_row + ca, ga.to(start_of_row.dtype.element_ty), mask=ca < padded)
    gb = (tl.exp(xb.to(tl.float32) - log_normalizer) - tl.where(cb == target, 1.0, 0.0)) * scale
    tl.store(start_of_row + cb, gb.to(start_of_row.dtype.element_ty), mask=cb < padded)
    gc = (tl.exp(xc.to(tl.float32) - log_normalizer) - tl.where(cc == target, 1.0, 0.0)) * scale
    tl.store(start_of_row + cc, gc.to(start_of_row.dtype.element_ty), mask=cc < padded)


def spans(padded: int) -> tuple[int, int, int]:
    """Three power-of-two spans covering ``padded`` columns with little waste (each at least 16)."""
    first = 1 << (padded.bit_length() - 1)
    rest = padded - first
    second = 1 << (rest.bit_length() - 1) if rest else 0
    rest -= second
    third = 1 << (rest - 1).bit_length() if rest else 0
    return first, max(second, 16), max(third, 16)


def loss_and_gradient_in_place(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, ignore_index: int,
                               warps: int) -> tuple[torch.Tensor, object]:
    """As model.triton_cross_entropy's, one program of ``warps`` warps per whole row; also the compiled kernel."""
    rows, padded = logits.shape
    row_loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    a, b, c = spans(padded)
    kernel = _resident_rows[(rows,)](logits, row_loss, targets.contiguous(), logits.stride(0), vocab_size, padded,
                                     ignore_index, A=a, B=b, C=c, num_warps=warps)
    return row_loss.sum(), kernel
