"""How the model computes (the config's ``compute`` section), and which kernel runs each part.

``choose_kernels`` is the one place a kernel is chosen, for the ``Target`` a model is built for (the device and its
compute capability, the compute dtype, compiled training or eager): ``model.decoder.Decoder`` asks once, when it is
built (or when it is moved to run elsewhere, by ``Decoder.use_target``), never in a forward, and hands each module
its kernel as a callable: ``CausalSelfAttention`` and ``GroupedQueryAttention`` their attention
(``attention.kernel``), GPT-2's ``MLP`` its fused function where one is chosen (``fused_mlp.kernel``),
``LMHeadLoss`` its chunk function. The compiled trunk then sees each choice as a constant. ``pick`` is the one rule
every optional kernel follows: "auto" takes it where it runs and falls back with one log line saying why not; asking
for it by name where it cannot run is an error that says what to do.

The package holds the kernels too: ``attention`` (causal attention within documents; ``flash4``: FlashAttention 4
as custom ops), ``fused_mlp`` (GPT-2's MLP with its GELU in quack's GEMM epilogues; ``quack_gelu``: the exact
GELU's formula there), ``triton_cross_entropy`` and ``quack_lse`` (the loss's chunk kernels), and ``gpu`` (the
compute capability, the optional packages' versions, and where their compilations are cached).

The optional kernels and what they need:

- FlashAttention 4 (``model.kernels.flash4``; the ``flash-attn-4`` package): Hopper or Blackwell, half dtypes.
- quack's GEMMs with the GELU in their epilogues (``model.kernels.fused_mlp``; ``quack-kernels``): GPT-2's MLP in
  a model built for compiled training in half dtypes on Hopper or Blackwell (and then also in its evaluation
  forwards); the last ``mlp_kept_derivatives`` blocks keep the GELU's derivative on Hopper. Llama's SwiGLU MLP
  takes PyTorch's products, its elementwise work fused by inductor.
- quack's head logits with each row's log-sum-exp (``model.kernels.quack_lse``) and the one-pass Triton
  gradient (``model.kernels.triton_cross_entropy``): compiled training in bf16 on Hopper; elsewhere on CUDA the
  two-pass Triton kernel over cuBLAS's logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from model.kernels import attention, flash4, fused_mlp, gpu

log = logging.getLogger(__name__)

Attention = Literal["auto", "fa4", "varlen", "sdpa"]
MLPKernel = Literal["auto", "quack", "torch"]
LossKernel = Literal["auto", "quack", "triton"]
MLP_CHOICES, LOSS_CHOICES = get_args(MLPKernel), get_args(LossKernel)
LSE_COMPUTE_CAPABILITY = 9  # Hopper: quack hands its epilogue functions single fp32 values (model.kernels.quack_lse)


@dataclass
class ComputeConfig:
    """The ``compute`` section of the config: how the model computes, whatever its shape. Kernels apply to
    CUDA runs; CPU runs and fp32 take PyTorch's plain path, whatever is set here."""

    attention: Attention = "auto"
    """Attention kernel: fa4 (FlashAttention 4; an error on a GPU where it cannot run), varlen (PyTorch's CUDA kernels:
    varlen flash for packed rows, fused causal SDPA for one-document rows), sdpa (SDPA with a document mask); auto: fa4
    where it is installed and the GPU supports it, else varlen"""
    mlp: MLPKernel = "auto"
    """MLP kernel of compiled training in half dtypes: quack (gpt2's GELU inside the MLP's GEMM epilogues,
    quack-kernels; an error where it cannot run, and with llama, whose SwiGLU MLP it does not compute), torch (cuBLAS
    products and a separate activation); auto: quack for gpt2 where it imports and the GPU supports it, else torch.
    Models built eager (the probe, the tools) take torch"""
    mlp_kept_derivatives: int = 6
    """With quack's MLP on Hopper: in this many blocks, the last ones, fc's product also writes the GELU's derivative,
    which the backward keeps in place of the pre-activation, so that proj's input-gradient product only scales by it.
    Each such block keeps 4 x n_embd x 2 bytes more per token; 0: none"""
    loss: LossKernel = "auto"
    """Chunk kernel of the LM head's loss in compiled CUDA training: quack (the logits with each row's log-sum-exp
    from quack's GEMM epilogue, then one Triton pass writing the gradient; bf16 on Hopper, an error elsewhere), triton
    (cuBLAS's logits, then a Triton kernel reading them twice); auto: quack where it runs, else triton. Eager runs
    take PyTorch"""
    loss_chunk_tokens: int = 16384
    """LM head and cross-entropy run over chunks of this many tokens, so the logits of a whole microbatch never
    exist at once; 0: all at once"""
    activation_checkpointing: bool = False
    """Recompute each block in the backward pass: less activation memory for more compute"""

    def problems(self) -> list[str]:
        """What the types do not say (config.choice_problems checks the choices of every section)."""
        return [f"compute.{name} must be >= 0, not {getattr(self, name)}"
                for name in ("mlp_kept_derivatives", "loss_chunk_tokens") if getattr(self, name) < 0]


@dataclass(frozen=True)
class Target:
    """What a model is built to run as, which its kernels are chosen for: the device, the dtype it computes in
    (autocast's, or its weights'), whether training runs the compiled trunk, and the GPU's compute capability. The
    default is a CPU model in fp32, eager."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    compiled: bool = False
    capability: tuple[int, int] | None = None
    """The compute capability (major, minor) of the GPU the kernels are chosen for; None: the CUDA device's own,
    read when they are chosen (none off CUDA). Given, it describes a GPU rather than asks one: the tests choose
    kernels for Hopper and Blackwell on a CPU."""

    def gpu_capability(self) -> tuple[int, int] | None:
        """The compute capability the kernels are chosen for: the given one, else the CUDA device's; None off CUDA."""
        if self.capability is not None:
            return self.capability
        return gpu.compute_capability(self.device) if self.device.type == "cuda" else None


@dataclass(frozen=True)
class Kernels:
    """What runs each part: the attention family ("fa4", "flash", "sdpa"), each block's MLP in compiled training
    ("torch", "quack", ``fused_mlp.KEPT_DERIVATIVE``) and the loss's chunk function ("eager", "triton", "quack")."""

    attention: str
    mlp: tuple[str, ...]
    loss: str

    def mlp_family(self) -> str:
        """"quack" where any block runs quack's MLP (keeping the derivative or not), else "torch"."""
        return "torch" if all(kernel == "torch" for kernel in self.mlp) else "quack"

    def described(self, compute: ComputeConfig) -> dict:
        """What ran, for the run record: each part's setting and the kernels behind it."""
        kept = self.mlp.count(fused_mlp.KEPT_DERIVATIVE)
        return {
            "attention": {"requested": compute.attention,
                          "ran": {kind: attention.describe(self.attention, packed)
                                  for kind, packed in (("packed rows", True), ("one-document rows", False))}},
            "mlp": {"requested": compute.mlp, "ran": self.mlp_family(), "blocks_keeping_the_gelu_derivative": kept},
            "loss": {"requested": compute.loss, "ran": self.loss},
        }


_reported: set = set()


def pick(option: str, requested: str, kernel: str, problem: str | None, fallback: str) -> str:
    """``kernel`` for the setting ``option`` = ``requested`` ("auto" or ``kernel``) where it runs (``problem`` None);
    "auto" falls back to ``fallback`` with one log line a process; ``kernel`` by name where it cannot run raises."""
    if problem is None:
        return kernel
    if requested == kernel:
        raise RuntimeError(f"{option} is {kernel!r} but it cannot run: {problem}. Use 'auto', or install it where it "
                           f"runs (docs/configuration.md: optional kernels).")
    if (option, problem) not in _reported:
        _reported.add((option, problem))
        log.info("%s: %s not used (%s); %s instead", option, kernel, problem, fallback)
    return fallback


def attention_kernel(compute: ComputeConfig, target: Target, head_dim: int) -> str:
    """The attention family: FA4 where it runs (auto, fa4), PyTorch's flash kernels, or SDPA with a mask (CPU, fp32)."""
    if compute.attention == "sdpa" or target.device.type != "cuda" or target.dtype not in (torch.float16,
                                                                                          torch.bfloat16):
        return "sdpa"
    if compute.attention == "varlen":
        return "flash"
    problem = flash4.fa4_unavailable_reason(target.gpu_capability(), head_dim)
    return pick("compute.attention", compute.attention, "fa4", problem, "flash")


def mlp_kernels(compute: ComputeConfig, target: Target, n_layer: int, width: int,
                family: str = "gpt2") -> tuple[str, ...]:
    """Each block's MLP kernel: a fused one only in a model built for compiled training (quack's GEMMs compile at
    first use: the probe and the tools, which build eager models, stay within PyTorch's)."""
    if not target.compiled or compute.mlp == "torch":
        return ("torch",) * n_layer
    if family != "gpt2":  # where a field library's SwiGLU kernel would be chosen, once one measures faster
        return (pick("compute.mlp", compute.mlp, "quack", SWIGLU_WITHOUT_QUACK, "torch"),) * n_layer
    capability = target.gpu_capability()
    problem = fused_mlp.quack_unavailable_reason(capability, target.dtype, width)
    kernel = pick("compute.mlp", compute.mlp, "quack", problem, "torch")
    return fused_mlp.block_kernels(kernel, n_layer, compute.mlp_kept_derivatives, capability)


# Why llama's MLP runs PyTorch's products: quack's epilogue holds GPT-2's GELU, and inductor fuses SwiGLU's SiLU and
# product (and RMSNorm) into the compiled trunk's own kernels.
SWIGLU_WITHOUT_QUACK = ("quack's MLP has GPT-2's GELU in its epilogues, not SwiGLU; llama's SwiGLU and RMSNorm run "
                        "as PyTorch's products with the elementwise work fused by inductor in the compiled trunk")


def loss_kernel(compute: ComputeConfig, target: Target, width: int) -> str:
    """The chunk function of the loss in training: PyTorch's eager (CPU, eager runs), quack's logits with their
    log-sum-exp and the one-pass Triton gradient, or the two-pass Triton kernel over cuBLAS's logits."""
    if not target.compiled or target.device.type != "cuda":
        return "eager"
    if compute.loss == "triton":
        return "triton"
    capability = target.gpu_capability()
    problem = fused_mlp.quack_unavailable_reason(capability, target.dtype, width)
    if problem is None and target.dtype != torch.bfloat16:
        problem = f"its logits are rounded to bf16, not {target.dtype}"
    if problem is None and capability[0] != LSE_COMPUTE_CAPABILITY:
        problem = "its epilogue takes the single values Hopper's GEMMs pass (compute capability 9.x)"
    return pick("compute.loss", compute.loss, "quack", problem, "triton")


def choose_kernels(compute: ComputeConfig, target: Target, shape) -> Kernels:
    """Every part's kernel for a model of ``shape`` (model.decoder.ModelConfig) built for ``target``."""
    return Kernels(attention=attention_kernel(compute, target, shape.head_dim),
                   mlp=mlp_kernels(compute, target, shape.n_layer, shape.n_embd, shape.family),
                   loss=loss_kernel(compute, target, shape.n_embd))


def describe(kernels: Kernels, family: str = "gpt2") -> str:
    """One log line of what runs."""
    kept = kernels.mlp.count(fused_mlp.KEPT_DERIVATIVE)
    mlp = fused_mlp.describe(kernels.mlp_family()) if family == "gpt2" else SWIGLU_DESCRIPTION
    return (f"attention: {attention.describe(kernels.attention, True)} for packed rows, "
            f"{attention.describe(kernels.attention, False)} for one-document rows; mlp: {mlp}"
            f"{f', the last {kept} blocks keeping the GELU derivative' if kept else ''}; loss chunks: "
            f"{LOSS_DESCRIPTIONS[kernels.loss]}")


SWIGLU_DESCRIPTION = "PyTorch (cuBLAS products, SwiGLU and RMSNorm by inductor or eager)"

LOSS_DESCRIPTIONS = {
    "eager": "PyTorch",
    "triton": "cuBLAS's logits and a two-pass Triton kernel",
    "quack": "quack's logits with their log-sum-exp and a one-pass Triton kernel",
}
