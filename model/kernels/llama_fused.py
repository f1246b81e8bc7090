"""Llama's RMSNorm and SwiGLU by a field library's kernels (``compute.norm``, ``compute.mlp``), on CUDA.

In the compiled trunk inductor already fuses RMSNorm and SwiGLU's SiLU and product into kernels of its own; these
are the libraries' hand-written ones, to measure against it (tools/bench/llama_speed.sh):

- Liger's RMSNorm and its SwiGLU over the fused gate-and-up product (``liger-kernel``, Triton), in Liger's "gemma"
  casting: the norm computes in fp32 with the weight in the input's dtype and rounds once, as ``F.rms_norm`` does;
  the SiLU in fp32 rounded to the input's dtype, times up, as ``F.silu(gate) * up`` does.
- quack's RMSNorm (``quack-kernels``, CuTe DSL; Hopper and Blackwell), computing in fp32 with the fp32 weight.

Each runs as an opaque operator in the compiled graph (Liger's as custom ops here, quack's as its own), so the
trunk stays one graph. Only a model built for compiled CUDA training in a half dtype takes them, and only by name
(``model.kernels`` chooses, at build); the modules' PyTorch path is unchanged.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import lru_cache

import torch

from model.kernels import gpu

LIBRARIES = ("liger", "quack")
PACKAGES = {"liger": "liger-kernel", "quack": "quack-kernels"}
QUACK_COMPUTE_CAPABILITIES = (9, 10)


@lru_cache(maxsize=None)
def imports(library: str) -> str | None:
    """None when ``library``'s kernels import, else why not (tried once a process)."""
    gpu.prepare_environment()  # quack's and the CuTe DSL's caches: the output folder, or memory only
    modules = {"liger": ("liger_kernel.ops.rms_norm", "liger_kernel.ops.swiglu"), "quack": ("quack.rmsnorm",)}
    try:
        for module in modules[library]:
            importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - missing package, no Triton (CPU builds), missing CUDA libraries
        return f"{modules[library][0]} does not import ({type(error).__name__}: {str(error)[:200]})"
    return None


def unavailable_reason(library: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when ``library``'s RMSNorm and SwiGLU can run in ``dtype`` on ``device``, else why not."""
    if device.type != "cuda":
        return f"it needs a CUDA device, not {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it computes in bf16 or fp16, not {dtype}"
    if library == "quack":
        major, minor = gpu.compute_capability(device)
        if major not in QUACK_COMPUTE_CAPABILITIES:
            return f"compute capability {major}.{minor} is not one quack's kernels support here (9.x, 10.x)"
    return imports(library)


# ----------------------------------------------------------------------------- Liger's RMSNorm

def _gemma_casting() -> int:
    """Liger's "gemma" casting mode, as its backward takes it."""
    from liger_kernel.ops.rms_norm import _str_to_casting_mode

    return _str_to_casting_mode["gemma"]


@torch.library.custom_op("runfab::liger_rms_norm", mutates_args=())
def _liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` [..., d] (contiguous) by ``weight`` in x's dtype, and each row's inverse RMS (fp32)."""
    from liger_kernel.ops.rms_norm import rms_norm_forward

    y, _, rstd, *_ = rms_norm_forward(x, weight, eps, 0.0, "gemma", None)
    return y, rstd


@_liger_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("runfab::liger_rms_norm_backward", mutates_args=())
def _liger_rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from liger_kernel.ops.rms_norm import rms_norm_backward
    from liger_kernel.ops.utils import calculate_settings

    block, warps = calculate_settings(x.shape[-1])
    dx, dw = rms_norm_backward(dy.contiguous(), x.reshape(-1, x.shape[-1]), weight, rstd, 0.0, _gemma_casting(),
                               block, warps, False, None, True)
    return dx.view(x.shape), dw


@_liger_rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _liger_rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _liger_rms_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _liger_rms_norm_backward(dy, x, weight, rstd)
    return dx, dw, None


_liger_rms_norm.register_autograd(_liger_rms_norm_grad, setup_context=_liger_rms_norm_setup)


def liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (d,), weight.to(x.dtype), eps)`` by Liger's kernels."""
    return _liger_rms_norm(x.contiguous(), weight.to(x.dtype), eps)[0]


def quack_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` by quack's kernels, in fp32 with the fp32 weight, rounded once to x's dtype."""
    from quack.rmsnorm import rmsnorm

    return rmsnorm(x, weight, eps=eps)


# ----------------------------------------------------------------------------- Liger's SwiGLU

@torch.library.custom_op("runfab::liger_swiglu", mutates_args=())
def _liger_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``gate_up`` [..., 2 * width] holding gate's columns, then up's (contiguous)."""
    from liger_kernel.ops.swiglu import swiglu_fused_gate_up_forward

    return swiglu_fused_gate_up_forward(gate_up)[1]


@_liger_swiglu.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("runfab::liger_swiglu_backward", mutates_args=())
def _liger_swiglu_backward(gate_up: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    from liger_kernel.ops.swiglu import swiglu_fused_gate_up_backward

    return swiglu_fused_gate_up_backward(gate_up, dout.contiguous(), False).view(gate_up.shape)


@_liger_swiglu_backward.register_fake
def _(gate_up, dout):
    return torch.empty_like(gate_up)


def _liger_swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _liger_swiglu_grad(ctx, dout):
    (gate_up,) = ctx.saved_tensors
    return _liger_swiglu_backward(gate_up, dout)


_liger_swiglu.register_autograd(_liger_swiglu_grad, setup_context=_liger_swiglu_setup)


def liger_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of the fused gate-and-up product by Liger's kernel."""
    return _liger_swiglu(gate_up.contiguous())


def norm_kernel(name: str) -> Callable | None:
    """The function ``(x, weight, eps) -> RMSNorm(x)`` of ``name`` ("liger", "quack"), or None for "torch"."""
    return {"torch": None, "liger": liger_rms_norm, "quack": quack_rms_norm}[name]


def describe(name: str, part: str) -> str:
    """What ran ``part`` ("norm" or "swiglu"), for the log."""
    if name == "torch":
        return "PyTorch (inductor-fused in the compiled trunk)"
    version = gpu.installed_version(PACKAGES[name]) or "?"
    return f"{name}'s {'RMSNorm' if part == 'norm' else 'SwiGLU'} ({PACKAGES[name]} {version})"
