"""The MLP with its GELU inside the matrix products (``compute.mlp``), through quack's GEMMs.

PyTorch runs the MLP as cuBLAS products with the GELU between them as its own kernels: the
forward reads the pre-activation back to apply the GELU, and the backward reads the product's
gradient and the pre-activation again to apply the GELU's derivative. quack (the optional
``quack-kernels`` package, CuTe-DSL GEMMs for Hopper and Blackwell) does the GELU in the fc
product's epilogue, writing the pre-activation and the activation at once, and the derivative in the
epilogue of proj's input-gradient product: the MLP's elementwise passes are gone. The GELU is the
exact (erf) one, as ``F.gelu`` computes it, by a cheaper formula than quack's own (``model.kernels.quack_gelu``); the
products accumulate in fp32 as cuBLAS's do.

In the last ``compute.mlp_kept_derivatives`` blocks (Hopper), fc's product also writes the GELU's derivative, which
the backward keeps with the activation in place of the pre-activation: proj's input-gradient product then only
scales by it (``_KeptDerivativeMLP``), at 4 x width x 2 bytes more per token.

Models built for compiled CUDA training in bf16 or fp16 only (their evaluation forwards too): models built
eager (the probe, the tools, CPU) keep PyTorch's MLP, so quack's two kernels compile (persisted under the
output's compile cache) in training alone. ``model.kernels`` chooses when the model is built; run_record.json
says what ran.
"""

from __future__ import annotations

import importlib
import logging
import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from model.kernels import gpu

log = logging.getLogger(__name__)

QUACK_PACKAGE = "quack-kernels"
QUACK_COMPUTE_CAPABILITIES = (9, 10)  # Hopper and Blackwell data-centre parts: quack's GEMMs with epilogues
# F.gelu's exact GELU, by quack_gelu.py's formula, registered in quack's tables under this name once quack imports
# (quack's own "gelu_erf" computes the same function, at more arithmetic per element than its epilogues can hide)
ACTIVATION = "gelu_exact_rational"


def torch_mlp(x: torch.Tensor, fc_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """The MLP as PyTorch computes it: fc, exact GELU, proj (no biases)."""
    return F.linear(F.gelu(F.linear(x, fc_weight)), proj_weight)


class _GeluEpilogueMLP(torch.autograd.Function):
    """The MLP on rows [tokens, d] in the compute dtype: quack's fc product with the GELU in its epilogue, and
    quack's input-gradient product of proj with the GELU's derivative in its epilogue (which also gives the
    activation back for proj's weight gradient). The other four products are cuBLAS's, which suit their shapes
    (the weight gradients sum over all tokens into small outputs)."""

    @staticmethod
    def forward(ctx, x, fc_weight, proj_weight):
        from quack.gemm_interface import gemm_act

        preact, postact = gemm_act(x, fc_weight.t(), activation=ACTIVATION, tuned=False)
        ctx.save_for_backward(x, preact, fc_weight, proj_weight)  # the activation is recomputed, as inductor would
        return postact @ proj_weight.t()

    @staticmethod
    def backward(ctx, dout):
        x, preact, fc_weight, proj_weight = ctx.saved_tensors
        dpreact, postact = gelu_dact(dout.contiguous(), proj_weight, preact)
        return dpreact @ fc_weight, dpreact.t() @ x, dout.t() @ postact


class _KeptDerivativeMLP(torch.autograd.Function):
    """``_GeluEpilogueMLP`` for a block that keeps the GELU's derivative (``compute.mlp_kept_derivatives``): fc's
    product writes the activation and gelu'(preact) in place of the pre-activation, and the backward keeps both, so
    that proj's input-gradient product only scales by the derivative: no GELU arithmetic and one output where
    ``gelu_dact`` recomputes the activation and writes it. The cost: the activation kept, 4 x width values a token."""

    @staticmethod
    def forward(ctx, x, fc_weight, proj_weight):
        postact, derivative = gelu_keeping_derivative(x, fc_weight)
        ctx.save_for_backward(x, postact, derivative, fc_weight, proj_weight)
        return postact @ proj_weight.t()

    @staticmethod
    def backward(ctx, dout):
        x, postact, derivative, fc_weight, proj_weight = ctx.saved_tensors
        dpreact = times_derivative(dout.contiguous(), proj_weight, derivative)
        return dpreact @ fc_weight, dpreact.t() @ x, dout.t() @ postact


def derivative_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a block keeps gelu'(preact) for compute in ``dtype``: fp16 under bf16, whose 3 more
    mantissa bits make the gradient's second rounding (of the derivative before the product's is) 8x smaller than
    a bf16 one; gelu' lies in [-0.17, 1.13], well inside fp16's range. Other dtypes keep their own (the CPU tests'
    fp64)."""
    return torch.float16 if dtype == torch.bfloat16 else dtype


@torch.library.custom_op("runfab::quack_gelu_keeping_derivative", mutates_args=())
def gelu_keeping_derivative(x: torch.Tensor, fc_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu(x @ fc_weight.t()) and gelu'(x @ fc_weight.t()) (in ``derivative_dtype``), by one quack GEMM."""
    from model.kernels import quack_gelu

    derivative = x.new_empty((x.shape[0], fc_weight.shape[0]), dtype=derivative_dtype(x.dtype))
    result = quack_gelu.gelu_keeping_derivative(x, fc_weight.t(), out={"derivative": derivative}, tuned=False)
    return result["D"], derivative


@gelu_keeping_derivative.register_fake
def _(x, fc_weight):
    shape = (x.shape[0], fc_weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape, dtype=derivative_dtype(x.dtype))


@torch.library.custom_op("runfab::quack_times_derivative", mutates_args=())
def times_derivative(dout: torch.Tensor, proj_weight: torch.Tensor, derivative: torch.Tensor) -> torch.Tensor:
    """(dout @ proj_weight) * derivative, rows [tokens, 4 * width] in dout's dtype, by one quack GEMM."""
    from model.kernels import quack_gelu

    return quack_gelu.times_derivative(dout, proj_weight, C=derivative, tuned=False)["D"]


@times_derivative.register_fake
def _(dout, proj_weight, derivative):
    return dout.new_empty((dout.shape[0], proj_weight.shape[1]))


# proj's input-gradient product with the GELU derivative in its epilogue. quack gives every Hopper GEMM one default
# tile (128 x 192); this product's epilogue (reading the pre-activation, writing two outputs) outweighs its short
# K = width loop, and a square tile runs it faster at the trainer's shape, while fc's product
# with the GELU runs fastest at the default. quack takes a pinned tile only outside torch.compile, so the product is
# a custom op: the compiled backward calls it as it is. Registered for every device, as custom ops are.
DACT_TILE_SM90 = (128, 128)


def dact_config(device: torch.device):
    """The pinned tile for ``gelu_dact`` on ``device``: a quack GemmConfig on Hopper, else None (quack's default)."""
    return None if device.type != "cuda" else pinned_dact_config(gpu.compute_capability(device)[0])


@lru_cache(maxsize=None)
def pinned_dact_config(major: int):
    """One config object per architecture: quack caches a launch per pinned config by the object's identity, so a
    new (equal) object at every call would take its slow path each time and grow that cache without bound."""
    if major != 9:
        return None
    from quack.gemm_config import GemmConfig

    return GemmConfig(tile_m=DACT_TILE_SM90[0], tile_n=DACT_TILE_SM90[1], pingpong=True, cluster_m=2, cluster_n=1,
                      is_dynamic_persistent=False, device_capacity=9)


@torch.library.custom_op("runfab::quack_gelu_dact", mutates_args=())
def gelu_dact(dout: torch.Tensor, proj_weight: torch.Tensor, preact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dout @ proj_weight) * gelu'(preact) and gelu(preact), rows [tokens, 4 * width], by one quack GEMM."""
    from quack.gemm_interface import gemm_dact

    dpreact, postact = gemm_dact(dout, proj_weight, preact, activation=ACTIVATION, tuned=False,
                                 config=dact_config(dout.device))
    return dpreact, postact


@gelu_dact.register_fake
def _(dout, proj_weight, preact):
    return torch.empty_like(preact), torch.empty_like(preact)


def quack_kept_derivative_mlp(x: torch.Tensor, fc_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """``quack_mlp`` keeping the GELU's derivative from the forward (``_KeptDerivativeMLP``)."""
    return on_rows(_KeptDerivativeMLP.apply, x, fc_weight, proj_weight)


def quack_mlp(x: torch.Tensor, fc_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """``torch_mlp`` with the GELU and its derivative in quack's GEMM epilogues. Casts to the autocast dtype as
    ``F.linear`` does under autocast (the fp32 weights get their gradients through the casts); each quack GEMM
    runs a fixed tile (quack's default, or ``DACT_TILE_SM90``): autotuning costs minutes of compilation. Call it
    where ``quack_unavailable_reason`` has found quack usable: that check registers the GELU (``ACTIVATION``) in
    quack's tables."""
    return on_rows(_GeluEpilogueMLP.apply, x, fc_weight, proj_weight)


def on_rows(function, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    """``function(rows, *weights)`` on ``x`` flattened to rows [tokens, d], the operands cast to the autocast dtype
    as ``F.linear`` casts them under autocast (fp32 weights get their gradients through the casts); the output
    comes back in ``x``'s leading shape. quack's GEMMs take 2-D operands of one half dtype."""
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    out = function(x.to(dtype).reshape(-1, x.shape[-1]), *[w.to(dtype) for w in weights])
    return out.view(*x.shape[:-1], out.shape[-1])


# A block's kernel, not a setting: quack's MLP in a block that keeps the GELU's derivative (compute.mlp_kept_derivatives)
KEPT_DERIVATIVE = "quack, derivative kept"


def kept_derivative_runs(capability: tuple[int, int] | None) -> bool:
    """Whether a block can keep the GELU's derivative on a GPU of compute ``capability`` (None: no CUDA device):
    quack's epilogues there pass their functions one value at a time (Hopper), as model.kernels.quack_gelu's take
    them, and quack's frontend built those epilogues."""
    if capability is None or capability[0] != 9:
        return False
    from model.kernels import quack_gelu

    return hasattr(quack_gelu, "times_derivative")


def block_kernels(kernel: str, n_layer: int, kept: int, capability: tuple[int, int] | None) -> tuple[str, ...]:
    """Each block's MLP kernel: ``kernel`` ("quack" or "torch"), with the last ``kept`` blocks keeping the GELU's
    derivative where ``kernel`` is quack's and ``kept_derivative_runs`` (Hopper: Blackwell's epilogues take pairs
    of values, which model.kernels.quack_gelu's epilogue functions do not)."""
    if kernel != "quack" or kept <= 0 or not kept_derivative_runs(capability):
        kept = 0
    kept = max(0, min(kept, n_layer))
    return (kernel,) * (n_layer - kept) + (KEPT_DERIVATIVE,) * kept


def kernel(name: str):
    """The function ``(x, fc_weight, proj_weight) -> proj(gelu(fc(x)))`` of a block's MLP kernel ``name`` (one of
    ``block_kernels``'), or None for "torch": the block's own Linear modules and PyTorch's GELU."""
    return {"torch": None, "quack": quack_mlp, KEPT_DERIVATIVE: quack_kept_derivative_mlp}[name]


@lru_cache(maxsize=None)
def quack_imports() -> str | None:
    """None when quack's GEMMs import, else why not (tried once; the CuTe DSL takes seconds to load). Where they
    import, this also registers the model's GELU in quack's tables under ``ACTIVATION``."""
    gpu.prepare_environment()  # the CuTe DSL's and quack's caches: output folder, or memory only
    try:
        importlib.import_module("quack.gemm_interface")
        import cutlass

        from model.kernels import quack_gelu

        quack_gelu.register(ACTIVATION)
        if getattr(quack_gelu, "EPILOGUE_PROBLEM", None):  # the blocks then recompute the activation: still quack's
            log.info("compute.mlp_kept_derivatives: not used (%s)", quack_gelu.EPILOGUE_PROBLEM)
    except Exception as error:  # noqa: BLE001 - missing package, missing CUDA libraries, wrong Python
        return f"quack.gemm_interface does not import ({type(error).__name__}: {str(error)[:200]})"
    return dsl_location_problem(cutlass.__file__)


def dsl_location_problem(cutlass_file: str) -> str | None:
    """Why quack's epilogue GEMMs would fail with the CuTe DSL at ``cutlass_file``, or None. quack fingerprints an
    epilogue's functions and everything they reach, except code under a site-packages (or dist-packages) folder;
    a DSL installed elsewhere (pip --target into another folder) is reached, and 4.8.1 holds a value quack refuses
    (a ContextVar): every such GEMM raises TypeError at its first call (quack-kernels 0.6.5)."""
    if any(f"{os.sep}{folder}{os.sep}" in cutlass_file for folder in ("site-packages", "dist-packages")):
        return None
    return (f"the CuTe DSL lies outside a site-packages folder ({os.path.dirname(cutlass_file)}), where quack's "
            f"epilogue GEMMs fail; install it with pip into the environment, or into a --target folder named "
            f"site-packages")


def quack_unavailable_reason(capability: tuple[int, int] | None, dtype: torch.dtype, width: int) -> str | None:
    """None when quack's MLP can run in ``dtype`` on a GPU of compute ``capability`` (None: no CUDA device) for a
    model of ``width`` (n_embd), else why not."""
    if capability is None:
        return "it needs a CUDA device"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it computes in bf16 or fp16, not {dtype}"
    if width % 8:  # the operands' rows are width or 4 * width elements of 2 bytes
        return f"the model's width {width} is not a multiple of 8, and quack's GEMMs need rows of whole 16 bytes"
    major, minor = capability
    if major not in QUACK_COMPUTE_CAPABILITIES:
        return f"compute capability {major}.{minor} is not one quack's GEMMs support here (9.x, 10.x)"
    return quack_imports()


def describe(kernel: str) -> str:
    """What ran the MLP, for the log."""
    if kernel == "quack":
        return f"quack GEMMs with the GELU in their epilogues (quack-kernels {gpu.installed_version(QUACK_PACKAGE) or '?'})"
    if kernel == KEPT_DERIVATIVE:
        return "quack GEMMs with the GELU in their epilogues, the GELU's derivative kept from the forward"
    return "PyTorch (cuBLAS products, GELU by inductor or eager)"
