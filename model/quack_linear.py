"""qkv's forward product and the LM head's logits through quack's plain GEMM (``model.linear_kernel``).

Both products take the model's width as their inner dimension and write an output wide for their work
(qkv: 3 x width columns; the head: one chunk of logits, the padded vocabulary wide). At the trainer's
shapes cuBLAS runs them below the other products, and quack's default Hopper tile (pingpong, whose
second warp group computes while the first writes its output) measured faster: 1.14x for qkv and
1.07x for a chunk of logits, with the same output bits (``python -m tools bench tiles --products``,
docs/PERFORMANCE.md). The attention's output projection measured within 3 %, so it stays cuBLAS's,
as do all backward products (``dout @ weight`` and ``dout.t() @ x`` sum over long inner dimensions,
where cuBLAS is at its best). The MLP's products have their own epilogue kernels (``model.fused_mlp``).

Compiled CUDA training in bf16 or fp16 only, like ``model.mlp_kernel``, and chosen by the same rules
(``fused_mlp.choose``): eager runs (the probe, evaluation, CPU) keep cuBLAS's products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import flash4, fused_mlp

Kernel = fused_mlp.Kernel  # model.linear_kernel: auto, quack or torch
CHOICES = fused_mlp.CHOICES
OPTION = "model.linear_kernel"


def torch_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [n, k] @ weight [m, k].t() by cuBLAS."""
    return rows @ weight.t()


def quack_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch_product`` by quack's GEMM at its default tile (a custom op, so torch.compile calls it as it is)."""
    from quack.gemm_interface import gemm

    return gemm(rows, weight.t(), tuned=False)


PRODUCT = {"quack": quack_product, "torch": torch_product}  # tests swap in references where quack is absent


class _QuackForwardLinear(torch.autograd.Function):
    """A bias-free linear layer on rows [n, k] in the compute dtype: quack's forward product, cuBLAS's gradients."""

    @staticmethod
    def forward(ctx, rows, weight):
        ctx.save_for_backward(rows, weight)
        return PRODUCT["quack"](rows, weight)

    @staticmethod
    def backward(ctx, dout):
        rows, weight = ctx.saved_tensors
        return dout @ weight, dout.t() @ rows


def linear(x: torch.Tensor, weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) by ``kernel`` ("quack" or "torch", from ``choose``). With quack, casts to the
    autocast dtype as ``F.linear`` does under autocast; the fp32 weight gets its gradient through the cast."""
    if kernel == "torch":
        return F.linear(x, weight)
    return fused_mlp.on_rows(_QuackForwardLinear.apply, x, weight)


def choose(requested: str, device: torch.device, dtype: torch.dtype, compiled: bool, width: int) -> str:
    """"quack" or "torch" for ``model.linear_kernel`` = ``requested``: ``fused_mlp.choose``'s rules."""
    return fused_mlp.choose(requested, device, dtype, compiled, width, option=OPTION)


def describe(kernel: str) -> str:
    """What ran qkv's forward product and the head's logits, for the log."""
    if kernel == "quack":
        return (f"quack's GEMM for qkv's forward and the head's logits "
                f"(quack-kernels {flash4.installed_version(fused_mlp.QUACK_PACKAGE) or '?'})")
    return "PyTorch's products (cuBLAS on CUDA) for qkv's forward and the head's logits"
