"""One chunk of the LM head's logits with each row's log-sum-exp, from one quack GEMM (``compute.loss: quack``).

The chunked loss needs, for every row of logits, the log-sum-exp over the vocabulary before it can write the
gradient softmax - one-hot. Computed after the product, that costs a read of the whole chunk (the two-pass Triton
kernel reads it twice and writes it once). Here the product's epilogue folds each output tile into a running
(max, sum of exponentials) per row while the tile is still in registers (quack's ``OnlineLSEReduce``), so the
gradient kernel reads the chunk once (``triton_cross_entropy.gradient_in_place``).

The epilogue folds each logit as it stores it, rounded to bf16: the gradient is computed from the stored logits,
so the log-sum-exp must be theirs. From the fp32 accumulators instead, softmax - one-hot would not sum to zero, and
a confident row's gradient would carry its target logit's whole rounding error. The rounding is Veltkamp's split: c = x * (2^16 + 1), then
c - (c - x), each operation rounded to nearest in fp32, keeps x's 8 leading significant bits, bf16's. It gives the
conversion's round-to-nearest-even for every normal fp32 value under 2^111 in magnitude
(``rounded_like_the_epilogue``, tests/unit), so the folded values are the stored ones and the plain product's, bit
for bit (a subnormal logit, under 1.2e-38, may be folded as a value 2^-133 from the stored one, which changes no
exponential). Three fp32 operations, which cost the epilogue less than the hardware's conversion to bf16 and back.

quack returns the log-sum-exp of each row within each output tile of N columns, and would fold those partials
into one value per row with a few small PyTorch kernels after the GEMM; here they are returned raw, [rows, tiles],
and the gradient kernel folds each row's while it reads the row's target logit (as quack's own ``gemm_rms`` leaves
its partials to the kernel after it).

The head is padded to a multiple of 128 rows with zeros, whose logits (0) are not classes: the product runs over
the vocabulary's rows alone and writes into the first ``vocab`` columns of a buffer as wide as the padded head, so
the rows stay aligned for the gradient products, and quack's epilogue leaves the columns past its N out of the
sums. The gradient kernel writes those columns' zeros.

bf16 on Hopper only (``model.kernels.loss_kernel``): quack hands its epilogue functions single fp32 values there. The
epilogue is a module-level name, which quack's custom op needs to find it again in compiled graphs; it is defined
where quack and the CuTe DSL import, which ``loss`` asks for only where quack's GEMMs were chosen (the DSL takes
seconds to load).
"""

from __future__ import annotations

import struct

import torch

SPLITTER = 2.0**16 + 1  # Veltkamp's constant for keeping 24 - 16 = 8 of fp32's significant bits
# the split in PTX; .rn keeps each operation rounded to nearest (no contraction into a fused multiply-add)
ROUND_TO_BF16_PTX = ("{.reg .f32 c, d; mul.rn.f32 c, $1, 0f%08X; sub.rn.f32 d, c, $1; sub.rn.f32 $0, c, d;}"
                  % struct.unpack("<I", struct.pack("<f", SPLITTER))[0])


def rounded_like_the_epilogue(x: torch.Tensor) -> torch.Tensor:
    """What the epilogue's rounding computes, in PyTorch's fp32 arithmetic: what the tests hold to bf16's."""
    c = x * SPLITTER
    return c - (c - x)


try:
    from cutlass import Float32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import OnlineLSEReduce
except Exception:  # noqa: BLE001 - absent, or present without its CUDA libraries: compute.loss quack cannot run
    gemm_epilogue = None

if gemm_epilogue is not None:
    @dsl_user_op
    def rounded_to_bf16(x, *, loc=None, ip=None):
        """``x`` (one fp32 value, as quack passes them on Hopper) rounded to bf16's precision, as an fp32 value."""
        return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], ROUND_TO_BF16_PTX, "=f,f",
                                       has_side_effects=False, loc=loc, ip=ip))

    _LSE = OnlineLSEReduce("lse")
    _LSE.host_finalize = None  # the per-tile partials come back raw: ``gradient_in_place`` folds them

    @gemm_epilogue(outs={"lse": _LSE})
    def logits_and_lse_epilogue(acc):
        """The stored logit, and the same value into the row's online log-sum-exp."""
        logit = rounded_to_bf16(acc)
        return {"D": logit, "lse": logit}


def logits_and_tile_log_normalizers(rows: torch.Tensor, padded_weight: torch.Tensor, vocab: int):
    """(logits [n, padded] bf16, whose columns past ``vocab`` are left unwritten; each row's log-sum-exp within each
    of quack's output tiles of its first ``vocab`` logits [n, tiles] fp32) for rows [n, k] and the zero-padded head
    [padded, k], both bf16, by quack's default Hopper tile."""
    logits = torch.empty(rows.shape[0], padded_weight.shape[0], dtype=rows.dtype, device=rows.device)
    partials = logits_and_lse_epilogue(rows, padded_weight[:vocab].t(), out={"D": logits[:, :vocab]}, tuned=False)["lse"]
    return logits, partials.reshape(rows.shape[0], partials.shape[-1])
