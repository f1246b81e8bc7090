"""One chunk of the LM head's logits with each row's log-sum-exp from one quack GEMM, and each row's target logit
(``model.loss_softmax: gemm_lse``).

The chunked loss needs, for every row of logits, the log-sum-exp over the vocabulary before it can write the
gradient softmax - one-hot. Computed after the product, that costs a read of the whole chunk (the two-pass Triton
kernel reads it twice and writes it once). Here the product's epilogue, quack's ``lse_epi``, folds each output
tile into a running (max, sum of exponentials) per row while the tile is still in registers; the gradient kernel
then reads the chunk once (``triton_cross_entropy.gradient_in_place``). Each row's target logit is one dot
product of the row with its target's row of the head, accumulated in fp32 as the GEMM's are (quack's epilogue can
pick it out too, ``lse_target_epi``, at 0.17 ms a chunk more: docs/PERFORMANCE.md).

Both statistics are those of the fp32 accumulators, so the loss is that of the fp32 logits, while the gradient is
computed from the stored bf16 logits against them: softmax - one-hot then does not sum to exactly zero, and a
confident row's gradient carries its target logit's rounding error (the two-pass kernel's cancels). At the
trainer's vocabulary with peaked rows, the gradient's error against fp64 measured twice the two-pass kernel's; on
real text the held-out loss was the same (docs/PERFORMANCE.md). This is why "triton" stays the default.

The head is padded to a multiple of 128 rows with zeros, whose logits (0) are not classes: the product runs over
the vocabulary's rows alone and writes into the first ``vocab`` columns of a buffer as wide as the padded head, so
the rows stay aligned for the gradient products, and quack's epilogue leaves the columns past its N out of the
sums. The gradient kernel writes those columns' zeros.

Hopper only (``loss.chunk_softmax_ran``), where it was measured; elsewhere the chunked loss takes the two-pass
kernel. Importing this module imports quack and the CuTe DSL: ``loss`` imports it only where quack's GEMMs were
chosen.
"""

from __future__ import annotations

import torch
from quack.epilogue.library import lse_epi


def logits_and_row_statistics(rows: torch.Tensor, padded_weight: torch.Tensor, targets: torch.Tensor, vocab: int):
    """(logits [n, padded] in the rows' dtype, whose columns past ``vocab`` are left unwritten; each row's
    log-sum-exp over the vocabulary [n] fp32; each row's target logit [n] fp32, of no meaning where the target
    lies outside the vocabulary, as ``IGNORE_INDEX`` does) for rows [n, k] on a CUDA device, the zero-padded head
    [padded, k] in the same dtype and ``targets`` [n], by quack's default Hopper tile."""
    logits = torch.empty(rows.shape[0], padded_weight.shape[0], dtype=rows.dtype, device=rows.device)
    lse = lse_epi(rows, padded_weight[:vocab].t(), out={"D": logits[:, :vocab]}, tuned=False)["lse"]
    target_rows = padded_weight[targets.clamp(0, vocab - 1)]
    target_logit = torch.bmm(rows[:, None, :], target_rows[:, :, None], out_dtype=torch.float32)
    return logits, lse.reshape(-1), target_logit.reshape(-1)
