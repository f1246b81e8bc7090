"""One chunk's cross-entropy and its logits gradient as a single Triton kernel, in place.

The chunked loss (``model.loss``) computes, for each chunk of logits, the summed loss and
d(loss)/d(logits) = softmax - one-hot. Written in PyTorch and compiled, that takes several passes
over the chunk (max, sum of exponentials, then the gradient) and a second buffer for the gradient.
Here one program per row reads the row twice and writes it once: an online max and sum of
exponentials, then the gradient written over the logits it was computed from. Triton ships with
every CUDA build of PyTorch, so this needs nothing RunFab's image lacks.

Where each row's log-sum-exp comes with the logits (quack's GEMM computes it in its epilogue, one value
per output tile of the row: ``model.kernels.quack_lse``), ``gradient_in_place`` folds the row's tile values and
reads the row once and writes it once.

Columns at or past ``vocab`` are the padding of the LM head (zero rows of the weight): they take
no probability and get a zero gradient. Rows whose target is ``ignore_index`` take no loss and
get a zero gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per step of a row and warps per row, for rows of the padded GPT-2 vocabulary on Hopper.
BLOCK_COLUMNS = 2048
WARPS = 4


@triton.jit
def _write_gradient(start_of_row, log_normalizer, target, valid, vocab, padded, BLOCK: tl.constexpr):
    """softmax - one-hot over one row, written over its logits (zero past ``vocab`` and where not ``valid``)."""
    scale = tl.where(valid, 1.0, 0.0)
    for start in tl.range(0, padded, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        x = tl.load(start_of_row + columns, mask=columns < vocab, other=float("-inf")).to(tl.float32)
        gradient = (tl.exp(x - log_normalizer) - tl.where(columns == target, 1.0, 0.0)) * scale
        tl.store(start_of_row + columns, gradient.to(start_of_row.dtype.element_ty), mask=columns < padded)


@triton.jit
def _loss_and_gradient_rows(logits, row_loss, targets, row_stride, vocab, padded, ignore_index,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start_of_row = logits + row * row_stride
    target = tl.load(targets + row)
    valid = target != ignore_index
    # Read before any program writes: pass 1's block reductions order every warp's read before pass 2.
    target_logit = tl.load(start_of_row + tl.where(valid, target, 0)).to(tl.float32)

    running_max = float("-inf")
    exp_sum = 0.0
    for start in tl.range(0, vocab, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        x = tl.load(start_of_row + columns, mask=columns < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        exp_sum = exp_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    log_normalizer = running_max + tl.log(exp_sum)
    tl.store(row_loss + row, tl.where(valid, log_normalizer - target_logit, 0.0))

    _write_gradient(start_of_row, log_normalizer, target, valid, vocab, padded, BLOCK)


def _row_losses(logits: torch.Tensor) -> torch.Tensor:
    """The kernels' per-row loss buffer, after checking ``logits`` is [rows, columns] with contiguous rows."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("the Triton cross-entropy takes logits [rows, columns] with contiguous rows")
    return torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)


def loss_and_gradient_in_place(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, ignore_index: int,
                               block_columns: int = BLOCK_COLUMNS, warps: int = WARPS) -> torch.Tensor:
    """The summed loss (fp32) of ``logits`` [rows, padded vocabulary] against ``targets`` [rows];
    ``logits`` is overwritten with d(loss)/d(logits) in its own dtype."""
    row_loss = _row_losses(logits)
    rows, padded = logits.shape
    if rows:
        _loss_and_gradient_rows[(rows,)](logits, row_loss, targets.contiguous(), logits.stride(0), vocab_size,
                                         padded, ignore_index, BLOCK=block_columns, num_warps=warps)
    return row_loss.sum()


@triton.jit
def _gradient_rows(logits, tile_log_normalizers, row_loss, targets, row_stride, tile_row_stride, tile_stride, tiles,
                   vocab, padded, ignore_index, BLOCK: tl.constexpr, TILES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start_of_row = logits + row * row_stride
    target = tl.load(targets + row)
    valid = target != ignore_index
    # the row's log-sum-exp from its tiles' (each tile holds at least one real column: no -inf partial)
    tile = tl.arange(0, TILES)
    partial = tl.load(tile_log_normalizers + row * tile_row_stride + tile * tile_stride, mask=tile < tiles,
                      other=float("-inf"))
    largest = tl.max(partial, axis=0)
    log_normalizer = largest + tl.log(tl.sum(tl.exp(partial - largest), axis=0))
    target_logit = tl.load(start_of_row + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(row_loss + row, tl.where(valid, log_normalizer - target_logit, 0.0))
    tl.debug_barrier()  # every warp has read the target's logit before any warp overwrites it
    _write_gradient(start_of_row, log_normalizer, target, valid, vocab, padded, BLOCK)


def gradient_in_place(logits: torch.Tensor, log_normalizers: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                      ignore_index: int, block_columns: int = BLOCK_COLUMNS, warps: int = WARPS) -> torch.Tensor:
    """``loss_and_gradient_in_place`` given each row's log-sum-exp over its first ``vocab_size`` logits, whole
    (``log_normalizers`` [rows] fp32) or by column tiles ([rows, tiles], folded here): one read and one write of
    ``logits``, whose columns past ``vocab_size`` are not read."""
    row_loss = _row_losses(logits)
    rows, padded = logits.shape
    if rows:
        tiles = log_normalizers.reshape(rows, -1)
        _gradient_rows[(rows,)](logits, tiles, row_loss, targets.contiguous(), logits.stride(0), tiles.stride(0),
                                tiles.stride(1), tiles.shape[1], vocab_size, padded, ignore_index, BLOCK=block_columns,
                                TILES=max(16, triton.next_power_of_2(tiles.shape[1])), num_warps=warps)
    return row_loss.sum()
