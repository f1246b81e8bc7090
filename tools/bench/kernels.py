"""Time the step's big kernels on their own: attention backends and the model's GEMM shapes.

The trainer's step is mostly attention and matrix products; this says how fast each candidate
kernel runs at the trainer's shapes (microbatch 32 x 4096, 12 heads of 64, d 768), and whether the
candidates agree, so a choice between them rests on figures. Prints one line per measurement.

Usage (GPU): python -m tools bench kernels [--microbatch 32] [--docs-mean 1000] [--kernels 'varlen FA2' 'FA4 varlen']
             python -m tools bench kernels --mlp     (the MLP block: PyTorch against quack's fused GELU GEMMs)
FlashAttention 4 (varlen, and dense for one-document rows) is a candidate when flash_attn.cute imports.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

from model import flash4
from tools.bench.runs import cuda_median_ms, quack_missing


def timed(fn, repeats: int = 20) -> float:
    """Median milliseconds of fn() over CUDA events, after warm-up calls."""
    return cuda_median_ms(fn, repeats)


def realistic_offsets(rows: int, t: int, mean: float, seed: int = 0) -> torch.Tensor:
    """cu_seqlens of rows packed with lognormal documents (sigma 1, as synthetic-records writes them), cut at row ends."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - 0.5
    starts = []
    for r in range(rows):
        at = 0
        while at < t:
            starts.append(r * t + at)
            at += max(1, round(rng.lognormal(mu, 1.0)))
    return torch.tensor(starts + [rows * t], dtype=torch.int32)


def document_offsets(layout: str, rows: int, t: int, mean: float = 1000.0) -> torch.Tensor:
    """cu_seqlens of ``rows`` rows of ``t`` tokens: one document per row ("one-doc"), or "realistic" documents."""
    if layout == "one-doc":
        return torch.arange(0, rows * t + 1, t, dtype=torch.int32)
    return realistic_offsets(rows, t, mean)


def attention_pairs(cu: torch.Tensor) -> int:
    lengths = (cu[1:] - cu[:-1]).long()
    return int((lengths * (lengths + 1) // 2).sum())


def report(name: str, ms: float, flops: float) -> None:
    print(f"{name:<48} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


# Every kernel takes q, k and v packed as the model's projection leaves them, qkv [total, 3, H, hd],
# and returns [total, H, hd]; the ones that take them apart get strided views, as in the model.


def cudnn_ragged(qkv, cu, max_len):
    """aten's cuDNN attention over ragged sequences, causal; differentiable through aten's formula."""
    q, k, v = qkv.unbind(1)
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True)[0]


def fa2_varlen(qkv, cu, max_len):
    q, k, v = qkv.unbind(1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0))


def fa4_varlen(qkv, cu, max_len):
    """FlashAttention 4 through the model's custom op (what training runs)."""
    return flash4.fa4_attention(qkv, cu, max_len)


def fa4_dense(qkv, cu, row_len):
    """FlashAttention 4 dense causal over whole rows: right only for one document per row."""
    total, _, h, hd = qkv.shape
    return flash4.fa4_attention(qkv.view(total // row_len, row_len, 3, h, hd)).view(total, h, hd)


class FlexDocuments:
    """FlexAttention over rows of packed documents, with a (same document, causal) block mask built
    once per batch layout, as a model would build it once per microbatch for all its layers."""

    def __init__(self, compiled: bool = True) -> None:
        self._masks: dict = {}
        self._attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def __call__(self, qkv, cu, row_len):
        q, k, v = qkv.unbind(1)
        total, h, hd = q.shape
        rows = total // row_len
        key = (cu.data_ptr(), total)
        if key not in self._masks:
            starts = torch.zeros(total, dtype=torch.int32, device=q.device)
            starts[cu[:-1].long()] = 1
            document = starts.cumsum(0).view(rows, row_len)

            def same_document_causal(b, h, q_index, k_index):
                return (document[b, q_index] == document[b, k_index]) & (k_index <= q_index)
            self._masks[key] = create_block_mask(same_document_causal, rows, None, row_len, row_len, device=q.device)
        qs, ks, vs = (z.view(rows, row_len, h, hd).transpose(1, 2) for z in (q, k, v))
        out = self._attend(qs, ks, vs, block_mask=self._masks[key])
        return out.transpose(1, 2).reshape(total, h, hd)


def reference(q, k, v, cu) -> torch.Tensor:
    """fp64 causal attention document by document: the ground truth the kernels are checked against."""
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        qs, ks, vs = (z[a:b].double().transpose(0, 1) for z in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    return torch.cat(outs)


def candidates(only: list[str] | None = None) -> dict:
    found = {"cuDNN ragged": cudnn_ragged, "FlexAttention": FlexDocuments()}
    if varlen_attn is not None:
        found["varlen FA2"] = fa2_varlen
    reason = flash4.fa4_unavailable_reason(torch.device("cuda"), 64)
    if reason is None:
        found["FA4 varlen"] = fa4_varlen
    else:
        print(f"FlashAttention 4 not timed: {reason}")
    return {name: fn for name, fn in found.items() if not only or name in only}


def correctness(args) -> None:
    """Each kernel's output and input gradients against fp64, on a small packed batch."""
    dev = torch.device("cuda")
    rows, t, h, hd = 2, 1024, 4, 64
    cu = realistic_offsets(rows, t, 300, seed=1).to(dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    qkv, grad = torch.randn(rows * t, 3, h, hd, device=dev, generator=gen), torch.randn(rows * t, h, hd, device=dev)
    leaves = [z.double().requires_grad_() for z in qkv.unbind(1)]
    reference(*leaves, cu).backward(grad.double())
    expected = [reference(*(z.detach() for z in leaves), cu)] + [z.grad for z in leaves]

    def relative(a, b):
        return float((a.double() - b).norm() / b.norm())
    print(f"\ncorrectness against fp64, {len(cu) - 1} documents in {rows} rows of {t}:")
    for name, fn in candidates(args.kernels).items():
        try:
            packed = qkv.bfloat16().requires_grad_()
            out = fn(packed, cu, t)
            out.backward(grad.bfloat16())
            errors = [relative(a, b) for a, b in zip([out.detach(), *packed.grad.unbind(1)], expected)]
            print(f"  {name:<14} relative error out/dq/dk/dv: " + " ".join(f"{e:.2e}" for e in errors))
        except Exception as error:  # noqa: BLE001 - a benchmark reports what the build lacks and goes on
            print(f"  {name}: {type(error).__name__}: {str(error)[:300]}")
    try:  # does the cuDNN ragged op compile, with the document count dynamic?
        compiled = torch.compile(cudnn_ragged, fullgraph=True)
        packed = qkv.bfloat16().requires_grad_()
        for cu_try in (cu, realistic_offsets(rows, t, 200, seed=2).to(dev)):
            torch._dynamo.mark_dynamic(cu_try, 0)
            out = compiled(packed, cu_try, t)
            out.backward(grad.bfloat16())
            eager = cudnn_ragged(packed.detach(), cu_try, t)
            print(f"  cuDNN ragged compiled, {len(cu_try) - 1} documents: max |compiled - eager| "
                  f"{float((out.detach() - eager).abs().max()):.2e}")
    except Exception as error:  # noqa: BLE001
        print(f"  cuDNN ragged compiled: {type(error).__name__}: {str(error)[:500]}")


def attention(args) -> None:
    b, t, h, hd = args.microbatch, 4096, 12, 64
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(b * t, 3, h, hd, device=dev, dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(b * t, h, hd, device=dev, dtype=torch.bfloat16, generator=gen)
    layouts = {layout: document_offsets(layout, b, t, args.docs_mean) for layout in ("one-doc", "realistic")}
    for layout, cu_cpu in layouts.items():
        cu = cu_cpu.to(dev)
        pairs = attention_pairs(cu_cpu)
        fwd_flops, bwd_flops = 4 * pairs * h * hd, 10 * pairs * h * hd  # 2 and 5 matmuls over the causal pairs
        print(f"\n{layout}: {len(cu_cpu) - 1} documents in {b} rows, {pairs / (b * t):.0f} causal pairs per token")
        packed = qkv.clone().requires_grad_()
        kernels = candidates()
        if layout == "one-doc" and "FA4 varlen" in kernels:
            kernels["FA4 dense"] = fa4_dense
        if layout == "one-doc":
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                def sdpa(qkv, cu, max_len, backend=backend):
                    with sdpa_kernel([backend]):
                        qs, ks, vs = (z.view(b, t, h, hd).transpose(1, 2) for z in qkv.unbind(1))
                        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2).reshape(b * t, h, hd)
                kernels[f"SDPA {backend.name}"] = sdpa
        kernels = {name: fn for name, fn in kernels.items() if not args.kernels or name in args.kernels}
        for name, fn in kernels.items():
            try:
                started = time.perf_counter()
                fn(packed, cu, t).backward(grad)  # the first call compiles (FA4: JIT), kept out of the timing
                torch.cuda.synchronize()
                print(f"{layout} {name}: first forward+backward {time.perf_counter() - started:.2f} s")
                report(f"{layout} {name} forward", timed(lambda: fn(packed, cu, t)), fwd_flops)
                report(f"{layout} {name} forward+backward", timed(lambda: fn(packed, cu, t).backward(grad)),
                       fwd_flops + bwd_flops)
            except Exception as error:  # noqa: BLE001
                print(f"{layout} {name}: {type(error).__name__}: {str(error)[:300]}")


def gemms(args) -> None:
    n = args.microbatch * 4096
    dev = torch.device("cuda")
    print()
    shapes = [("qkv", n, 768, 2304), ("attn proj", n, 768, 768), ("mlp fc", n, 768, 3072), ("mlp proj", n, 3072, 768),
              ("head chunk 8192", 8192, 768, 50304), ("head chunk 32768", 32768, 768, 50304)]
    for name, m, kdim, ndim in shapes:
        a = torch.randn(m, kdim, device=dev, dtype=torch.bfloat16)
        w = torch.randn(ndim, kdim, device=dev, dtype=torch.bfloat16)
        g = torch.randn(m, ndim, device=dev, dtype=torch.bfloat16)
        flops = 2 * m * kdim * ndim
        report(f"gemm {name} forward  [{m}x{kdim}]@[{kdim}x{ndim}]", timed(lambda: a @ w.t()), flops)
        report(f"gemm {name} grad input", timed(lambda: g @ w), flops)
        report(f"gemm {name} grad weight", timed(lambda: g.t() @ a), flops)


def fused(args) -> None:
    """Fused-kernel candidates at the trainer's shapes, each against what the trainer runs (inductor's
    kernels), with its error against an fp32 reference: the LayerNorm as inductor compiles it, quack's fused
    cross-entropy (loss and gradient in one pass), and FP8 (e4m3, per-tensor scales) for the
    forward GEMMs with the cost of the casts. Bytes are the fewest each must move."""
    dev = torch.device("cuda")
    n, d, vocab, padded, chunk = args.microbatch * 4096, 768, 50257, 50304, 16384
    gen = torch.Generator(device=dev).manual_seed(0)

    def bandwidth(name, ms, nbytes):
        print(f"{name:<60} {ms:8.3f} ms  {nbytes / ms / 1e9:6.2f} TB/s", flush=True)

    def relative(a, b):
        return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())

    print("\nfused kernels")
    x = torch.randn(n, d, device=dev, generator=gen).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(d, device=dev, generator=gen)).requires_grad_()
    bias = (0.1 * torch.randn(d, device=dev, generator=gen)).requires_grad_()
    g = torch.randn(n, d, device=dev, generator=gen).bfloat16()
    inductor_ln = torch.compile(lambda x, w, b: F.layer_norm(x.float(), (d,), w, b, 1e-5).to(torch.bfloat16))
    with torch.no_grad():
        bandwidth("LayerNorm fwd, inductor (as the trunk)", timed(lambda: inductor_ln(x, w, bias)), 4 * n * d)
    bandwidth("LayerNorm fwd+bwd, inductor", timed(lambda: inductor_ln(x, w, bias).backward(g)), 10 * n * d)

    from model.loss import chunk_loss_and_grad
    logits = (2 * torch.randn(chunk, padded, device=dev, generator=gen)).bfloat16()
    targets = torch.randint(0, vocab, (chunk,), device=dev, generator=gen)
    ours = torch.compile(chunk_loss_and_grad, dynamic=False)
    loss, grad = ours(logits, targets, vocab, torch.bfloat16)
    bandwidth("loss chunk 16384 x 50304 (loss + grad), inductor (as the trainer)",
              timed(lambda: ours(logits, targets, vocab, torch.bfloat16)), 4 * chunk * padded)
    try:
        from quack.cross_entropy import cross_entropy_fwd

        # The trainer's padded columns carry -inf, so they take no probability. (quack refused the
        # 50,257-column view of the padded logits: its 16-bit row alignment is not a supported copy.)
        masked = logits.clone()
        masked[:, vocab:] = float("-inf")
        quack_loss, quack_grad = cross_entropy_fwd(masked, targets, return_dx=True)
        print(f"  quack cross-entropy relative error loss/grad vs the trainer's: {relative(quack_loss.sum(), loss):.2e} "
              f"{relative(quack_grad, grad):.2e}")
        bandwidth("loss chunk (loss + grad), quack cross_entropy_fwd(return_dx)",
                  timed(lambda: cross_entropy_fwd(masked, targets, return_dx=True)), 4 * chunk * padded)
    except Exception as error:  # noqa: BLE001
        print(f"  quack cross-entropy: {type(error).__name__}: {str(error)[:300]}")

    f8 = torch.float8_e4m3fn
    fp8_max = torch.finfo(f8).max

    @torch.compile
    def to_fp8(t):  # per-tensor scale: amax, scale, cast (what a tensorwise FP8 linear adds per operand)
        scale = fp8_max / t.abs().amax().float().clamp(min=1e-12)
        return (t.float() * scale).clamp(-fp8_max, fp8_max).to(f8), scale.reciprocal()
    for name, m, kdim, ndim in [("qkv", n, 768, 2304), ("mlp fc", n, 768, 3072), ("mlp proj", n, 3072, 768)]:
        a = torch.randn(m, kdim, device=dev, generator=gen).bfloat16()
        wt = (0.02 * torch.randn(ndim, kdim, device=dev, generator=gen)).bfloat16()
        try:
            a8, sa = to_fp8(a)
            w8, sw = to_fp8(wt)
            out8 = torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
            error = relative(out8, a.float() @ wt.float().t())
            bf16_ms = timed(lambda: a @ wt.t())
            fp8_ms = timed(lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16))
            cast_ms = timed(lambda: (to_fp8(a), to_fp8(wt)))
            flops = 2 * m * kdim * ndim
            print(f"gemm {name} forward bf16 {bf16_ms:.3f} ms ({flops / bf16_ms / 1e9:.0f} TFLOP/s), fp8 {fp8_ms:.3f} ms "
                  f"({flops / fp8_ms / 1e9:.0f}), casts {cast_ms:.3f} ms: fp8+casts / bf16 = "
                  f"{(fp8_ms + cast_ms) / bf16_ms:.2f}; relative error {error:.1e}", flush=True)
        except Exception as error:  # noqa: BLE001
            print(f"gemm {name} fp8: {type(error).__name__}: {str(error)[:300]}")


def mlp(args) -> None:
    """The MLP block (fc, exact GELU, proj) forward and backward at the trainer's shape, as training runs it
    (fp32 weights under bf16 autocast, compiled): PyTorch (cuBLAS, inductor's GELU) against quack's GEMMs with
    the GELU in their epilogues (``model.fused_mlp``), each with its error against an fp32 reference; then
    quack's plain GEMM against cuBLAS at the MLP's product shapes, which says where a difference comes from."""
    from model import fused_mlp

    dev = torch.device("cuda")
    n, d = args.microbatch * 4096, 768
    if quack_missing("kernels --mlp", dev, d):
        return
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, d, device=dev, generator=gen).bfloat16().requires_grad_()
    fc = (0.02 * torch.randn(4 * d, d, device=dev, generator=gen)).requires_grad_()
    proj = (0.02 / math.sqrt(24) * torch.randn(d, 4 * d, device=dev, generator=gen)).requires_grad_()
    g = torch.randn(n, d, device=dev, generator=gen).bfloat16()
    flops = 3 * 2 * 2 * n * d * 4 * d  # two products, forward and two backward GEMMs each
    reference_out = fused_mlp.torch_mlp(x.float(), fc, proj)
    reference = (reference_out, *torch.autograd.grad(reference_out, (x, fc, proj), g.float()))

    def step(fn):
        with torch.autocast("cuda", torch.bfloat16):
            out = fn(x, fc, proj)
        return (out, *torch.autograd.grad(out, (x, fc, proj), g))

    def relative(a, b):
        return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())

    def quack_all_six(x, fc, proj):  # quack's own MLP: its GEMMs for the four products cuBLAS does in ours
        from quack.mlp import mlp_func

        return mlp_func(x, fc, proj, fused_mlp.ACTIVATION, tuned=False)

    variants = {"PyTorch compiled (as the trunk)": torch.compile(fused_mlp.torch_mlp),
                "quack GELU epilogues + cuBLAS (model.mlp_kernel quack), compiled": torch.compile(fused_mlp.quack_mlp),
                "quack GELU epilogues + cuBLAS, eager": fused_mlp.quack_mlp,
                "quack's mlp_func (all six products quack's), compiled": torch.compile(quack_all_six)}
    print(f"\nMLP block, {n} tokens x {d} -> {4 * d} -> {d}, forward + backward")
    for name, fn in variants.items():
        try:
            start = time.perf_counter()
            results = step(fn)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            errors = " ".join(f"{what} {relative(r, ref):.1e}" for what, r, ref in zip(("out", "dx", "dfc", "dproj"),
                                                                                       results, reference))
            report(f"mlp {name}", timed(lambda: step(fn)), flops)
            print(f"  first call {first:.1f} s; relative error against fp32: {errors}", flush=True)
        except Exception as error:  # noqa: BLE001
            print(f"mlp {name}: {type(error).__name__}: {str(error)[:400]}", flush=True)
    try:  # the fused products alone against what they replace
        from quack.gemm_interface import gemm, gemm_act, gemm_dact

        xb, fcb, projb = x.detach(), fc.detach().bfloat16(), proj.detach().bfloat16()
        gelu = torch.compile(F.gelu)
        gelu_backward = torch.compile(lambda dg, h: torch.ops.aten.gelu_backward(dg, h))
        preact = xb @ fcb.t()
        dgelu = g @ projb
        product = 2 * n * d * 4 * d  # FLOPs of each of these products
        for name, ours, theirs in [
                ("fc + GELU forward", lambda: gelu(xb @ fcb.t()),
                 lambda: gemm_act(xb, fcb.t(), activation=fused_mlp.ACTIVATION, tuned=False)),
                ("proj input gradient + GELU derivative", lambda: gelu_backward(g @ projb, preact),
                 lambda: gemm_dact(g, projb, preact, activation=fused_mlp.ACTIVATION, tuned=False)),
                ("fc weight gradient", lambda: dgelu.t() @ xb, lambda: gemm(dgelu.t(), xb, tuned=False))]:
            a, b = timed(ours), timed(theirs)
            print(f"{name}: cuBLAS+inductor {a:.3f} ms ({product / a / 1e9:.0f} TFLOP/s), quack {b:.3f} ms "
                  f"({product / b / 1e9:.0f})", flush=True)
        autotuned = [("fc + GELU forward", gemm_act, (xb, fcb.t())),
                     ("proj input gradient + GELU derivative", gemm_dact, (g, projb, preact))]
        for name, fn, operands in autotuned if args.tune else []:  # quack's autotuner: minutes of compilation
            start = time.perf_counter()
            fn(*operands, activation=fused_mlp.ACTIVATION, tuned=True)
            torch.cuda.synchronize()
            tuning = time.perf_counter() - start
            ms = timed(lambda: fn(*operands, activation=fused_mlp.ACTIVATION, tuned=True))
            print(f"{name}, quack autotuned: {ms:.3f} ms after {tuning:.1f} s of tuning", flush=True)
    except Exception as error:  # noqa: BLE001
        print(f"quack fused products: {type(error).__name__}: {str(error)[:400]}", flush=True)
    try:
        from quack.gemm_interface import gemm

        for name, m, kdim, ndim in [("mlp fc", n, d, 4 * d), ("mlp proj", n, 4 * d, d), ("qkv", n, d, 3 * d)]:
            a = torch.randn(m, kdim, device=dev, generator=gen).bfloat16()
            w = torch.randn(ndim, kdim, device=dev, generator=gen).bfloat16()
            cublas = timed(lambda: a @ w.t())
            quack = timed(lambda: gemm(a, w.t(), tuned=False))
            print(f"gemm {name} forward [{m}x{kdim}]@[{kdim}x{ndim}]: cuBLAS {cublas:.3f} ms "
                  f"({2 * m * kdim * ndim / cublas / 1e9:.0f} TFLOP/s), quack {quack:.3f} ms "
                  f"({2 * m * kdim * ndim / quack / 1e9:.0f})", flush=True)
    except Exception as error:  # noqa: BLE001
        print(f"quack gemm: {type(error).__name__}: {str(error)[:400]}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--microbatch", type=int, default=32)
    parser.add_argument("--docs-mean", type=float, default=1000.0)
    parser.add_argument("--gemms", action="store_true", help="also time the model's matrix-product shapes")
    parser.add_argument("--fused", action="store_true",
                        help="only the fused-kernel candidates: quack cross-entropy, FP8 GEMMs")
    parser.add_argument("--mlp", action="store_true",
                        help="only the MLP block: PyTorch against quack's GEMMs with the GELU in their epilogues")
    parser.add_argument("--tune", action="store_true", help="with --mlp: also quack's autotuned fused GEMMs (minutes)")
    parser.add_argument("--kernels", nargs="*", default=None, help="only these candidates (e.g. 'varlen FA2' 'FA4 varlen')")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m tools bench kernels: needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    if args.fused:
        fused(args)
        return 0
    if args.mlp:
        mlp(args)
        return 0
    correctness(args)
    attention(args)
    if args.gemms:
        gemms(args)
    return 0
