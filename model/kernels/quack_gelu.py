"""The exact GELU and its derivative for quack's GEMM epilogues, by a formula with two hardware approximations.

quack's own exact GELU (``gelu_erf``) evaluates ``erf`` through the CUDA math library in every element of its
epilogues; at the trainer's shape that arithmetic, more than the memory traffic, is what the epilogue waits on.
Here the normal CDF comes from Abramowitz and Stegun's rational approximation 7.1.26 (absolute
error at most 1.5e-7) around the normal density, which the derivative needs anyway, so an element costs one
``ex2``, one ``rcp`` and a dozen multiply-adds:

    density = exp(-x^2 / 2) / sqrt(2 pi)
    tail    = Phi(-|x|) = density * t * poly(t),  t = 1 / (1 + p |x| / sqrt(2))
    Phi(x)  = tail for x < 0, else 1 - tail;  gelu(x) = x Phi(x);  gelu'(x) = Phi(x) + x density

The tail is computed directly rather than as 1 - Phi(|x|), so negative inputs keep their relative precision down
to x = -6 (erf-based kernels, PyTorch's included, lose it to cancellation: F.gelu(-6.0) is 0 in fp32); beyond,
where the GELU is under 6e-9 in magnitude, the formula's relative error grows to 1 %. Against fp64 the GELU stays
within fp32's reach, and in bf16 its outputs are the exact GELU's rounding at least as often as PyTorch's fp32
kernel's are (tests/unit/test_model_quack_gelu.py holds it to both).

Beside the activation tables, two epilogues for quack's ``@gemm_epilogue`` frontend use the formula: fc's product
writing the activation and the GELU's derivative (for the blocks that keep the derivative, model.kernels.fused_mlp), and
proj's input-gradient product scaling by that kept derivative.

The formula is written once, over the arithmetic it is given: the CuTe DSL's in the kernels (``register``), and
PyTorch's in ``cdf_and_density``, which the tests hold to fp64. This module imports the CuTe DSL only where it is
installed, and ``fused_mlp`` imports it only where it checks that quack's GEMMs import (the DSL takes seconds to
load).
"""

from __future__ import annotations

import math

import torch

# Abramowitz and Stegun 7.1.26: erfc(z) = (a1 t + ... + a5 t^5) exp(-z^2), t = 1 / (1 + p z), z >= 0. With
# z = |x| / sqrt(2), exp(-z^2) = sqrt(2 pi) * density and Phi(-|x|) = erfc(z) / 2: the factor sqrt(2 pi) / 2 is
# folded into the coefficients, 1 / sqrt(2) into p, and 1 / sqrt(2 pi) into the exponent.
_P = 0.3275911 / math.sqrt(2.0)
_A = tuple(a * 0.5 * math.sqrt(2.0 * math.pi) for a in (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429))
_LOG2_DENSITY_SCALE = -0.5 * math.log2(2.0 * math.pi)  # log2(1 / sqrt(2 pi))
_NEG_HALF_LOG2E = -0.5 * math.log2(math.e)


def tail_and_density(x, magnitude, exp2, reciprocal):
    """(Phi(-|x|), the normal density at x) for ``x`` and ``magnitude`` = |x|, with ``exp2`` and ``reciprocal``
    supplied by the caller: the formula above on any values that have * and +."""
    density = exp2(x * x * _NEG_HALF_LOG2E + _LOG2_DENSITY_SCALE)
    t = reciprocal(magnitude * _P + 1.0)
    tail = (((((_A[4] * t + _A[3]) * t + _A[2]) * t + _A[1]) * t + _A[0]) * t) * density
    return tail, density


def cdf_and_density(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Phi(x), density(x)) by the kernels' formula, in PyTorch's arithmetic: what the tests hold to fp64."""
    tail, density = tail_and_density(x, x.abs(), torch.exp2, torch.reciprocal)
    return torch.where(x < 0, tail, 1.0 - tail), density


try:
    import cutlass.cute as cute
    from cutlass import Boolean, Float32, const_expr
    from cutlass._mlir_helpers import math as mlir_math
    from cutlass.cutlass_dsl import dsl_user_op
except Exception:  # noqa: BLE001 - absent, or present without its CUDA libraries: quack's GEMMs are not chosen
    # then (fused_mlp.quack_imports says why), and only the PyTorch mirror, cdf_and_density, is used
    cute = None

if cute is not None:
    def _exp2(value):
        return cute.math.exp2(value, fastmath=True)  # MUFU.EX2

    def _reciprocal(value):
        return mlir_math.rcp(value, approx=True, ftz=True)  # MUFU.RCP

    @dsl_user_op
    @cute.jit
    def cdf_and_density_in_kernel(x: Float32, *, loc=None, ip=None):
        tail, density = tail_and_density(x, cute.math.abs(x), _exp2, _reciprocal)
        negative = Boolean(x < 0)
        cdf = tail if negative else 1.0 - tail
        return cdf, density

    @dsl_user_op
    def gelu(x, *, loc=None, ip=None):
        """gelu(x), for quack's forward epilogues (one value or a pair, as quack passes them)."""
        if const_expr(isinstance(x, tuple)):
            return tuple(gelu(value) for value in x)
        cdf, _ = cdf_and_density_in_kernel(x)
        return x * cdf

    @dsl_user_op
    def dgelu(x, dout, *, loc=None, ip=None):
        """(dout * gelu'(x), gelu(x)), for quack's dact epilogue, which also hands the activation back."""
        if const_expr(isinstance(x, tuple)):
            pairs = [dgelu(value, grad) for value, grad in zip(x, dout)]
            return tuple(pair[0] for pair in pairs), tuple(pair[1] for pair in pairs)
        cdf, density = cdf_and_density_in_kernel(x)
        return dout * (x * density + cdf), x * cdf

    try:
        from quack.epilogue.frontend import gemm_epilogue
    except Exception:  # noqa: BLE001 - quack absent or older than its epilogue frontend: gemm_act and gemm_dact only
        gemm_epilogue = None

    # Module globals, so that quack's compile cache finds them again by name in a fresh process. Where quack's
    # frontend refuses them, blocks recompute the activation as before (fused_mlp.kept_derivative_runs).
    if gemm_epilogue is not None:
        try:
            @gemm_epilogue(outputs=("derivative",))
            def gelu_keeping_derivative(acc):
                """fc's product with the GELU: gelu(preact) as the product's output, and gelu'(preact) as a second
                output that the backward keeps in place of the pre-activation (so that its product only scales)."""
                cdf, density = cdf_and_density_in_kernel(acc)
                return {"D": acc * cdf, "derivative": acc * density + cdf}

            @gemm_epilogue()
            def times_derivative(acc, c):
                """proj's input-gradient product times the GELU's derivative kept from the forward, ``c``."""
                return {"D": acc * c}
        except Exception as error:  # noqa: BLE001
            EPILOGUE_PROBLEM = f"quack's epilogue frontend refused the GELU's epilogues: {type(error).__name__}: {error}"


def register(name: str) -> None:
    """Adds the GELU and its derivative to quack's activation tables under ``name`` (again: the same entries),
    which quack's ``gemm_act`` and ``gemm_dact`` then take as ``activation``. Needs the CuTe DSL and quack."""
    if cute is None:
        raise RuntimeError("the CuTe DSL (nvidia-cutlass-dsl) does not import: quack's GEMMs cannot run")
    from quack import activation

    activation.act_fn_map[name] = gelu
    activation.dact_fn_map[name] = dgelu
