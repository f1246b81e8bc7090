"""Sweep the launch shapes of the step's own and optional kernels at the trainer's shapes: quack's GELU epilogue
GEMMs, FA4's SM90 attention and the Triton chunk softmax, each candidate against the default; and cuBLAS's
products with a wide output against quack's plain GEMM under each tile.

quack and FA4 choose their tiles by a fixed rule (quack: one default config per architecture; FA4: FA3's choices
for head dimension 64, benchmarked on H100 with long sequences). The trainer's shapes are narrow products
(K = 768) with heavy epilogues and short packed documents, so another tile may be faster; this says by how much,
and whether the results agree with the default's. Prints one line per candidate; a candidate that fails to compile
prints its error and the sweep goes on.

Usage (GPU, with quack-kernels and flash-attn-4 installed):
    python -m tools bench tiles --mlp                    fc + GELU, and proj's input gradient + GELU derivative
    python -m tools bench tiles --gelu                   the same two products, the model's tiles, under each
                                                         GELU formula (and a ReLU and none as floors)
    python -m tools bench tiles --attention [--only NAME] FA4's forward tiles and backward configurations
    python -m tools bench tiles --softmax                the chunk softmax's columns per block and warps, and the
                                                         head's chunk with each row's log-sum-exp from quack's
                                                         epilogue against the two-pass softmax
    python -m tools bench tiles --products               the head's logits, qkv and the attention's output
                                                         projection: cuBLAS against quack's tiles
    python -m tools bench tiles --dact-outputs           proj's input gradient + GELU derivative writing both
                                                         outputs against the gradient alone, under tiles
    python -m tools bench tiles --kept-derivative        the MLP's GELU products against keeping gelu'(preact)
                                                         from the forward in place of the pre-activation
    python -m tools bench tiles --weight-gradients       the blocks' weight gradients: cuBLAS against quack's
                                                         split-K
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from model import flash4, fused_mlp
from tools.bench.kernels import attention_pairs, document_offsets
from tools.bench.runs import cuda_median_ms, quack_missing
from tools.bench.step_variants import isolated_softmax, relative

WIDTH, HEADS, HEAD_DIM, ROW = 768, 12, 64, 4096


def quack_configs() -> dict[str, object]:
    """Candidate SM90 configs (None: quack's default). The autotuner's space, less the cluster and swap
    combinations that measured nowhere near in quack's own sweeps, plus the default's neighbours."""
    from quack.gemm_config import GemmConfig

    def config(m, n, pingpong, cluster=(2, 1), swap_ab=False, k=None):
        return GemmConfig(tile_m=m, tile_n=n, tile_k=k, pingpong=pingpong, cluster_m=cluster[0], cluster_n=cluster[1],
                          swap_ab=swap_ab, is_dynamic_persistent=False, device_capacity=9)

    return {"default": None,
            "pingpong 128x192 cluster 1x2": config(128, 192, True, (1, 2)),
            "pingpong 128x128": config(128, 128, True),
            "pingpong 128x128, K steps of 128": config(128, 128, True, k=128),
            "pingpong 128x192, K steps of 128": config(128, 192, True, k=128),
            "pingpong 128x160": config(128, 160, True),
            "pingpong 192x128": config(192, 128, True),
            "cooperative 128x256": config(128, 256, False),
            "cooperative 256x128": config(256, 128, False),
            "cooperative 256x192": config(256, 192, False),
            "cooperative 256x192 cluster 1x2": config(256, 192, False, (1, 2)),
            "pingpong 128x192 swap_ab": config(128, 192, True, swap_ab=True),
            "cooperative 256x128 swap_ab": config(256, 128, False, swap_ab=True)}


def measured(name: str, fn, repeats: int):
    """(fn()'s result, its median milliseconds), or None after one line saying why the candidate failed (a tile
    the kernel cannot build): the sweep goes on."""
    try:
        result = fn()
        torch.cuda.synchronize()
        return result, cuda_median_ms(fn, repeats)
    except Exception as error:  # noqa: BLE001
        print(f"  {name:<48} failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
        return None


def mlp_operands(rows: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(x, fc's weight, proj's weight, the MLP output's gradient) in bf16 at the model's width, seeded."""
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, WIDTH, device=dev, generator=gen).bfloat16()
    fc = (0.02 * torch.randn(4 * WIDTH, WIDTH, device=dev, generator=gen)).bfloat16()
    proj = (0.02 * torch.randn(WIDTH, 4 * WIDTH, device=dev, generator=gen)).bfloat16()
    return x, fc, proj, torch.randn(rows, WIDTH, device=dev, generator=gen).bfloat16()


def mlp(args) -> None:
    """quack's two GELU epilogue products under each candidate config, and each with the other scheduler."""
    dev = torch.device("cuda")
    if quack_missing("tiles --mlp", dev, WIDTH):
        return
    from quack.gemm_interface import gemm_act, gemm_dact

    n = args.microbatch * ROW
    x, fc, proj, dout = mlp_operands(n, dev)
    preact = x @ fc.t()
    flops = 2 * n * WIDTH * 4 * WIDTH
    epilogue_products = {  # name -> (call(config, dynamic_scheduler), quack's default dynamic_scheduler)
        "fc + GELU (gemm_act)": (lambda cfg, ds: gemm_act(x, fc.t(), activation=fused_mlp.ACTIVATION, tuned=False,
                                                         config=cfg, dynamic_scheduler=ds), False),
        "proj input gradient + GELU derivative (gemm_dact)": (
            lambda cfg, ds: gemm_dact(dout, proj, preact, activation=fused_mlp.ACTIVATION, tuned=False, config=cfg,
                                      dynamic_scheduler=ds)[:2], True)}
    for product, (call, default_scheduler) in epilogue_products.items():
        print(f"\n{product}: [{n}x{WIDTH}] -> {4 * WIDTH}, {flops / 1e9:.0f} GFLOP", flush=True)
        baseline = None
        for name, cfg in quack_configs().items():
            for scheduler in (default_scheduler, not default_scheduler) if cfg is None else (default_scheduler,):
                label = f"{name}{'' if scheduler == default_scheduler else f', dynamic_scheduler={scheduler}'}"
                found = measured(label, lambda: call(cfg, scheduler), args.repeats)
                if found is None:
                    continue
                outputs, ms = found
                if baseline is None:
                    baseline = (ms, outputs)
                agreement = " ".join(f"{relative(o, b):.1e}" for o, b in zip(outputs, baseline[1]))
                print(f"  {label:<48} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  x{baseline[0] / ms:.3f}  "
                      f"outputs against the default: {agreement}", flush=True)


def gelu_formulas() -> dict[str, str | None]:
    """Candidate epilogue activations for the two GELU products, by quack's activation name: the two exact GELUs,
    then two floors that say how much of the epilogue is its arithmetic (a ReLU: no transcendental; none: the
    epilogue's memory traffic alone)."""
    return {"quack's gelu_erf (CUDA's erf)": "gelu_erf", "the model's (model/quack_gelu.py)": fused_mlp.ACTIVATION,
            "floor: ReLU": "relu", "floor: no activation": None}


def gelu(args, dev: torch.device | None = None) -> None:
    """quack's two GELU epilogue products at the model's tiles under each formula of ``gelu_formulas``: time, and
    for the GELUs how often their bf16 activation is the exact GELU's rounding (fp64 on the first rows)."""
    dev = dev or torch.device("cuda")
    if quack_missing("tiles --gelu", dev, WIDTH):
        return
    from quack.gemm_interface import gemm_act, gemm_dact

    n = args.microbatch * ROW
    x, fc, proj, dout = mlp_operands(n, dev)
    preact = 2.0 * (x @ fc.t())  # about unit spread, the tails included
    rows = preact[:8192].double()
    exact = (rows * 0.5 * torch.special.erfc(-rows / 2 ** 0.5)).bfloat16()
    pytorch_share = float((torch.nn.functional.gelu(preact[:8192].float()).bfloat16() == exact).float().mean())
    print(f"\nGELU of bf16 pre-activations equal to the exact GELU's bf16 rounding: PyTorch's F.gelu (fp32) "
          f"{pytorch_share:.5f}", flush=True)
    flops = 2 * n * WIDTH * 4 * WIDTH
    products = {  # name -> (call(activation), whether its activation is of ``preact``, so ``exact`` applies)
        "fc + GELU (gemm_act), quack's default tile": (
            lambda act: gemm_act(x, fc.t(), activation=act, tuned=False), False),
        "proj input gradient + GELU derivative (gemm_dact), the pinned tile": (lambda act: gemm_dact(
            dout, proj, preact, activation=act, tuned=False, config=fused_mlp.dact_config(dev))[:2], True)}
    for product, (call, of_preact) in products.items():
        print(f"\n{product}: [{n}x{WIDTH}] -> {4 * WIDTH}, {flops / 1e9:.0f} GFLOP", flush=True)
        first = None
        for name, activation in gelu_formulas().items():
            found = measured(name, lambda: call(activation), args.repeats)
            if found is None:
                continue
            outputs, ms = found
            first = first or ms
            line = f"  {name:<40} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  x{first / ms:.3f}"
            if of_preact and activation is not None and activation.startswith("gelu"):
                share = float((outputs[1][:8192] == exact).float().mean())
                line += f"  activation equal to the exact GELU's rounding: {share:.5f}"
            print(line, flush=True)


DACT_ONLY_CONFIGS = ("default", "pingpong 128x128", "pingpong 128x160", "pingpong 192x128", "cooperative 128x256",
                     "cooperative 256x128")


def quack_gelu_epilogues(sweep: str, dev: torch.device):
    """model.quack_gelu where quack's GEMMs run on ``dev`` and its epilogue frontend built the module's epilogues,
    else None after saying why (for the sweeps of ``@gemm_epilogue`` epilogues, the model's and
    tools/bench/dact_epilogue.py's)."""
    if quack_missing(f"tiles {sweep}", dev, WIDTH):
        return None
    from model import quack_gelu

    if getattr(quack_gelu, "times_derivative", None) is None:
        print(f"python -m tools bench tiles {sweep}: model.quack_gelu's epilogues are not built "
              f"({getattr(quack_gelu, 'EPILOGUE_PROBLEM', 'quack.epilogue.frontend does not import')})", file=sys.stderr)
        return None
    return quack_gelu


def dact_outputs(args) -> None:
    """proj's input-gradient product with the GELU derivative in its epilogue, writing both outputs (quack's
    ``gemm_dact``: the gradient, and the activation that proj's weight gradient needs) against the gradient alone
    (tools/bench/dact_epilogue.py, for a block that kept its activation from the forward) under
    candidate tiles; the plain product as the floor. Each gradient against ``gemm_dact``'s: relative difference
    and the share of bitwise-equal elements."""
    dev = torch.device("cuda")
    if quack_gelu_epilogues("--dact-outputs", dev) is None:
        return
    from quack.gemm_interface import gemm, gemm_dact

    from tools.bench.dact_epilogue import gelu_input_gradient

    n = args.microbatch * ROW
    x, fc, proj, dout = mlp_operands(n, dev)
    preact = 2.0 * (x @ fc.t())
    flops = 2 * n * WIDTH * 4 * WIDTH
    pinned = fused_mlp.dact_config(dev)

    def both():
        return gemm_dact(dout, proj, preact, activation=fused_mlp.ACTIVATION, tuned=False, config=pinned)[0]

    candidates = {"both outputs (gemm_dact), the pinned tile": both}
    configs = quack_configs()
    for name in DACT_ONLY_CONFIGS:
        candidates[f"the gradient alone, {name}"] = (
            lambda cfg=configs[name]: gelu_input_gradient(dout, proj, C=preact, config=cfg, tuned=False)["D"])
    candidates["floor: the plain product, quack's default tile"] = lambda: gemm(dout, proj, tuned=False)
    print(f"\nproj input gradient + GELU derivative: [{n}x{WIDTH}] -> {4 * WIDTH}, {flops / 1e9:.0f} GFLOP",
          flush=True)
    reference = both()
    first = None
    for name, fn in candidates.items():
        found = measured(name, fn, args.repeats)
        if found is None:
            continue
        out, ms = found
        first = first or ms
        line = f"  {name:<56} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  x{first / ms:.3f}"
        if "gradient" in name:
            line += (f"  against gemm_dact's: {relative(out, reference):.1e}, bitwise equal "
                     f"{float((out == reference).float().mean()):.5f}")
        print(line, flush=True)


def kept_derivative(args) -> None:
    """The MLP's two GELU products as they are (quack's ``gemm_act`` writing the pre-activation and the activation;
    ``gemm_dact`` reading the pre-activation and writing the gradient and the activation) against a block that
    keeps the GELU's derivative from the forward in place of the pre-activation: fc's product writes the activation
    and gelu'(preact) (``model.quack_gelu.gelu_keeping_derivative``), proj's input-gradient product only scales by it
    (``times_derivative``). The derivative kept in fp16 or bf16; each gradient against the exact one (fp64)."""
    dev = torch.device("cuda")
    quack_gelu = quack_gelu_epilogues("--kept-derivative", dev)
    if quack_gelu is None:
        return
    from quack.gemm_interface import gemm_act, gemm_dact

    n = args.microbatch * ROW
    x, fc, proj, dout = mlp_operands(n, dev)
    x = 2.0 * x  # pre-activations of about unit spread, the tails included
    flops = 2 * n * WIDTH * 4 * WIDTH
    configs = quack_configs()
    preact, postact = gemm_act(x, fc.t(), activation=fused_mlp.ACTIVATION, tuned=False)
    rows = slice(0, 8192)  # the exact gradient in fp64 on the first rows
    p64 = preact[rows].double()
    cdf = 0.5 * torch.special.erfc(-p64 / 2 ** 0.5)
    exact_derivative = cdf + p64 * torch.exp(-0.5 * p64 * p64) / (2 * torch.pi) ** 0.5
    exact = (dout[rows].double() @ proj.double()) * exact_derivative

    def error(gradient):
        return f"{relative(gradient[rows], exact):.2e}"

    def forward(dtype, cfg):
        derivative = torch.empty(n, 4 * WIDTH, device=dev, dtype=dtype)
        result = quack_gelu.gelu_keeping_derivative(x, fc.t(), out={"derivative": derivative}, config=cfg, tuned=False)
        return result["D"], result["derivative"]

    print(f"\nfc + GELU: [{n}x{WIDTH}] -> {4 * WIDTH}, {flops / 1e9:.0f} GFLOP", flush=True)
    found = measured("gemm_act", lambda: gemm_act(x, fc.t(), activation=fused_mlp.ACTIVATION, tuned=False),
                     args.repeats)
    if found is None:
        return
    first = found[1]
    print(f"  {'gemm_act (pre-activation, activation)':<56} {first:7.3f} ms {flops / first / 1e9:5.0f} TFLOP/s",
          flush=True)
    kept = {}
    for dtype in (torch.float16, torch.bfloat16):
        for name in ("default", "pingpong 128x128", "cooperative 128x256"):
            label = f"activation and derivative ({str(dtype)[6:]}), {name}"
            found = measured(label, lambda dtype=dtype, cfg=configs[name]: forward(dtype, cfg), args.repeats)
            if found is None:
                continue
            (activation, derivative), ms = found
            kept.setdefault(dtype, derivative)
            same = float((activation == postact).float().mean())
            print(f"  {label:<56} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  x{first / ms:.3f}  activation "
                  f"bitwise gemm_act's {same:.5f}", flush=True)
    print(f"\nproj input gradient + GELU derivative: [{n}x{WIDTH}] -> {4 * WIDTH}, {flops / 1e9:.0f} GFLOP; "
          f"gradient against the exact (fp64)", flush=True)
    pinned = fused_mlp.dact_config(dev)
    found = measured("gemm_dact", lambda: gemm_dact(dout, proj, preact, activation=fused_mlp.ACTIVATION, tuned=False,
                                                    config=pinned)[0], args.repeats)
    if found is None:
        return
    reference, first = found
    print(f"  {'gemm_dact (gradient, activation), the pinned tile':<56} {first:7.3f} ms "
          f"{flops / first / 1e9:5.0f} TFLOP/s  error {error(reference)}", flush=True)
    for dtype, derivative in kept.items():
        for name in ("default", "pingpong 128x128", "pingpong 192x128", "cooperative 128x256"):
            label = f"times the kept derivative ({str(dtype)[6:]}), {name}"
            found = measured(label, lambda derivative=derivative, cfg=configs[name]: quack_gelu.times_derivative(
                dout, proj, C=derivative, config=cfg, tuned=False)["D"], args.repeats)
            if found is None:
                continue
            gradient, ms = found
            print(f"  {label:<56} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  x{first / ms:.3f}  error "
                  f"{error(gradient)}, bitwise gemm_dact's {float((gradient == reference).float().mean()):.5f}",
                  flush=True)


def weight_gradient_shapes() -> dict[str, tuple[int, int]]:
    """(output rows, output columns) of a block's weight gradients: the weights' shapes."""
    return {"qkv": (3 * WIDTH, WIDTH), "the attention's output projection": (WIDTH, WIDTH),
            "fc": (4 * WIDTH, WIDTH), "proj": (WIDTH, 4 * WIDTH)}


def weight_gradients(args) -> None:
    """Each weight gradient of a block (``dout.t() @ rows``: a sum over all the microbatch's tokens into an output
    of a few tiles) through cuBLAS, as the step computes it, against quack's GEMM at its default tile split along
    the tokens (split-K: the partial sums occupy the SMs that the few output tiles leave idle)."""
    device = torch.device("cuda")
    if quack_missing("tiles --weight-gradients", device, WIDTH):
        return
    from quack.gemm_interface import SplitKMode, gemm

    tokens = args.microbatch * ROW
    gen = torch.Generator(device=device).manual_seed(0)
    for product, (m, n) in weight_gradient_shapes().items():
        dout = torch.randn(tokens, m, device=device, generator=gen).bfloat16()
        rows = torch.randn(tokens, n, device=device, generator=gen).bfloat16()
        flops = 2 * tokens * m * n
        print(f"\n{product}'s weight gradient: [{m}x{tokens}] @ [{tokens}x{n}], {flops / 1e9:.0f} GFLOP", flush=True)
        found = measured("cuBLAS", lambda: dout.t() @ rows, args.repeats)
        if found is None:
            continue
        expected, cublas_ms = found
        print(f"  {'cuBLAS':<40} {cublas_ms:7.3f} ms {flops / cublas_ms / 1e9:5.0f} TFLOP/s", flush=True)
        variants = [(split, SplitKMode.SERIAL) for split in (1, 2, 3, 4, 6, 8)] + [(4, SplitKMode.SEPARATE)]
        for split, mode in variants:
            label = f"quack, split-K {split}{' separate' if mode == SplitKMode.SEPARATE else ''}"
            found = measured(label, lambda: gemm(dout.t(), rows, tuned=False, split_k=split, split_k_mode=mode),
                             args.repeats)
            if found is None:
                continue
            out, ms = found
            print(f"  {label:<40} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  x{cublas_ms / ms:.3f} against cuBLAS, "
                  f"output against cuBLAS's {relative(out, expected):.1e}", flush=True)


def wide_products(microbatch: int) -> dict[str, tuple[int, int, int]]:
    """(rows, inner, columns) of the forward products that cuBLAS runs with the model width as the inner
    dimension: their output is wide for the work, and the trace shows them below the other products."""
    from model.gpt import GPTConfig
    from model.loss import padded_vocab_size

    tokens, config = microbatch * ROW, GPTConfig()
    return {"the head's logits, one chunk": (config.loss_chunk_tokens, WIDTH, padded_vocab_size(config.vocab_size)),
            "qkv forward": (tokens, WIDTH, 3 * WIDTH),
            "the attention's output projection": (tokens, WIDTH, WIDTH)}


def products(args, device: torch.device | None = None) -> None:
    """Each wide product through cuBLAS (``a @ weight.t()``, the model's layout) and through quack's plain
    GEMM (``gemm_act`` without an activation) under each candidate config, against cuBLAS's time and output."""
    device = device or torch.device("cuda")
    if quack_missing("tiles --products", device, WIDTH):
        return
    from quack.gemm_interface import gemm_act

    gen = torch.Generator(device=device).manual_seed(0)
    for product, (m, k, n) in wide_products(args.microbatch).items():
        a = torch.randn(m, k, device=device, generator=gen).bfloat16()
        weight = (0.02 * torch.randn(n, k, device=device, generator=gen)).bfloat16()
        flops = 2 * m * k * n
        print(f"\n{product}: [{m}x{k}] -> {n}, {flops / 1e9:.0f} GFLOP", flush=True)
        found = measured("cuBLAS", lambda: a @ weight.t(), args.repeats)
        if found is None:
            continue
        expected, cublas_ms = found
        print(f"  {'cuBLAS':<48} {cublas_ms:7.3f} ms {flops / cublas_ms / 1e9:5.0f} TFLOP/s", flush=True)
        for name, cfg in quack_configs().items():
            label = f"quack {name}"
            found = measured(label, lambda: gemm_act(a, weight.t(), activation=None, store_preact=False, tuned=False,
                                                     config=cfg)[1], args.repeats)
            if found is None:
                continue
            out, ms = found
            print(f"  {label:<48} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  x{cublas_ms / ms:.3f} against cuBLAS, "
                  f"output against cuBLAS's {relative(out, expected):.1e}", flush=True)


def attention_inputs(layout: str, microbatch: int):
    """Packed qkv [total, 3, H, hd], the document offsets (one-doc: one document per row) and the longest one."""
    dev = torch.device("cuda")
    total = microbatch * ROW
    gen = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(total, 3, HEADS, HEAD_DIM, device=dev, generator=gen).bfloat16()
    cu = document_offsets(layout, microbatch, ROW)
    max_len = int((cu[1:] - cu[:-1]).max())
    return qkv, cu.to(dev), max_len, attention_pairs(cu)


FORWARD_TILES = {  # name -> _flash_attn_fwd keyword arguments (none: FA4's choice, 192 x 128 RS + overlap)
    "forward default": {},
    "forward 128x128": {"tile_mn": (128, 128)},
    "forward 192x192": {"tile_mn": (192, 192)},
    "forward 128x192": {"tile_mn": (128, 192)},
    "forward 192x128 P in shared memory": {"tile_mn": (192, 128), "mma_pv_is_rs": False},
}


def backward_configs(interface) -> dict[str, object]:
    """Candidates for FA4's SM90 backward at head dimension 64 (None: FA4's, FA3's 128 x 128)."""
    default = interface._tile_size_bwd_sm90(HEAD_DIM, HEAD_DIM, True, False)
    return {"backward default": None,
            "backward 64x128 (FA3's hdim-128 causal layout)": replace(default, m_block_size=64, AtomLayoutMdQ=1),
            "backward 64x128 dQ in one warp group": replace(default, m_block_size=64, AtomLayoutMdQ=1,
                                                           dQ_single_wg=True),
            "backward 128x128 no SdP swap": replace(default, SdP_swapAB=False, AtomLayoutMSdP=2),
            "backward 128x64": replace(default, n_block_size=64, AtomLayoutNdKV=1)}


def attention(args) -> None:
    """FA4's forward under each tile and its backward under each configuration, realistic and one-doc rows."""
    interface = flash4.fa4_interface()
    if interface is None:
        print("python -m tools bench tiles --attention: flash_attn.cute does not import", file=sys.stderr)
        return
    chosen = interface._tile_size_bwd_sm90
    for layout in args.layouts:
        qkv, cu, max_len, pairs = attention_inputs(layout, args.microbatch)
        fwd_flops = 4 * pairs * HEADS * HEAD_DIM  # QK^T and PV over the causal pairs
        q, k, v = qkv.unbind(1)
        print(f"\nFA4 attention, {layout}: {len(cu) - 1} documents, longest {max_len}", flush=True)
        reference = None
        for name, extra in FORWARD_TILES.items():
            if args.only and name not in args.only:
                continue
            def forward():
                return interface._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                                 max_seqlen_k=max_len, causal=True, return_lse=True, **extra)[:2]
            found = measured(name, forward, args.repeats)
            if found is None:
                continue
            out, ms = found
            reference = reference or out
            print(f"  {name:<48} {ms:7.3f} ms {fwd_flops / ms / 1e9:5.0f} TFLOP/s  out against the default "
                  f"{relative(out[0], reference[0]):.1e}", flush=True)
        out, lse = interface._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                             max_seqlen_k=max_len, causal=True, return_lse=True)[:2]
        dout = torch.randn_like(out)
        grads = None
        for name, cfg in backward_configs(interface).items():
            if args.only and name not in args.only:
                continue
            interface._tile_size_bwd_sm90 = chosen if cfg is None else (lambda *a, cfg=cfg, **kw: cfg)
            def backward():
                return interface._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, cu_seqlens_q=cu,
                                                 cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len)[:3]
            try:
                found = measured(name, backward, args.repeats)
            finally:
                interface._tile_size_bwd_sm90 = chosen
            if found is None:
                continue
            result, ms = found
            grads = grads or [g.clone() for g in result]
            agreement = " ".join(f"{relative(g, r):.1e}" for g, r in zip(result, grads))
            print(f"  {name:<48} {ms:7.3f} ms {2.5 * fwd_flops / ms / 1e9:5.0f} TFLOP/s  dq dk dv against the "
                  f"default {agreement}", flush=True)


def softmax(args) -> None:
    """The Triton chunk kernel (one chunk of 16,384 rows x the padded GPT-2 vocabulary) under each launch."""
    results = isolated_softmax(50257)
    bandwidth = results.pop("triton_bandwidth_tb_s")
    print(f"\nchunk softmax + gradient, 16384 x 50304 bf16: compiled PyTorch {results.pop('compiled_ms'):.3f} ms")
    for name, row in results.items():
        if "error" in row:
            print(f"  {name:<28} failed: {row['error']}")
            continue
        print(f"  {name:<28} {row['ms']:7.3f} ms  {bandwidth[name]:5.2f} TB/s if read twice  loss, gradient against "
              f"compiled {row['loss_vs_compiled']:.1e} {row['grad_vs_compiled']:.1e}", flush=True)


def head_chunk_shape() -> tuple[int, int]:
    """(rows, vocabulary) of one chunk of the head at the defaults."""
    from model.gpt import GPTConfig

    config = GPTConfig()
    return config.loss_chunk_tokens, config.vocab_size


def head_chunk(args, device: torch.device | None = None) -> None:
    """One chunk of the head (16,384 rows of the model's width against the padded GPT-2 vocabulary) from its rows
    to its loss and logits gradient, both ways ``model.loss_softmax`` offers with quack's logits: quack's product,
    then the two-pass Triton kernel ("triton"), against quack's product with each row's log-sum-exp from its
    epilogue, then the single pass ("gemm_lse"); each part alone, and the single pass's loss and gradient against
    the two-pass kernel's."""
    from model.loss import IGNORE_INDEX, padded_vocab_size

    device = device or torch.device("cuda")
    if quack_missing("tiles --softmax (the head's chunk)", device, WIDTH):
        return
    from model import quack_linear, quack_lse
    from model.triton_cross_entropy import gradient_in_place, loss_and_gradient_in_place

    rows, vocab = head_chunk_shape()
    padded = padded_vocab_size(vocab)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(rows, WIDTH, device=device, generator=gen).bfloat16()
    weight = torch.zeros(padded, WIDTH, device=device, dtype=torch.bfloat16)
    weight[:vocab] = 0.1 * torch.randn(vocab, WIDTH, device=device, generator=gen)
    targets = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    targets[::50] = IGNORE_INDEX

    def product():
        return quack_linear.quack_product(hidden, weight)

    def statistics():
        return quack_lse.logits_and_tile_log_normalizers(hidden, weight, vocab)

    def two_pass():
        logits = product()
        return loss_and_gradient_in_place(logits, targets, vocab, IGNORE_INDEX), logits

    def one_pass():
        logits, lse = statistics()
        return gradient_in_place(logits, lse, targets, vocab, IGNORE_INDEX), logits

    logits, lse = statistics()
    parts = {"triton": {"quack's product": product,
                        "two-pass kernel": lambda: loss_and_gradient_in_place(logits, targets, vocab, IGNORE_INDEX)},
             "gemm_lse": {"quack's product with the log-sum-exp": statistics,
                          "single pass": lambda: gradient_in_place(logits, lse, targets, vocab, IGNORE_INDEX)}}
    print(f"\nthe head's chunk, {rows} x {WIDTH} -> {padded}, rows to loss and logits gradient:", flush=True)
    found = {name: measured(name, fn, args.repeats) for name, fn in (("triton", two_pass), ("gemm_lse", one_pass))}
    if None in found.values():
        return
    (expected_loss, expected_grad), base_ms = found["triton"]
    for name, ((got_loss, got_grad), ms) in found.items():
        timed = [(part, measured(part, fn, args.repeats)) for part, fn in parts[name].items()]  # the buffers' values
        pieces = ", ".join(f"{part} {result[1]:.3f}" for part, result in timed if result is not None)  # no longer matter
        print(f"  {name:<10} {ms:7.3f} ms  x{base_ms / ms:.3f} against triton  ({pieces})  loss, gradient against "
              f"triton {relative(got_loss, expected_loss):.1e} {relative(got_grad, expected_grad):.1e}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools bench tiles", description=__doc__.splitlines()[0])
    parser.add_argument("--mlp", action="store_true", help="quack's GELU epilogue products")
    parser.add_argument("--gelu", action="store_true", help="quack's GELU epilogue products under each GELU formula")
    parser.add_argument("--attention", action="store_true", help="FA4's SM90 forward tiles and backward configs")
    parser.add_argument("--softmax", action="store_true", help="the Triton chunk softmax's launch shapes")
    parser.add_argument("--products", action="store_true",
                        help="cuBLAS's wide-output products (head logits, qkv, output projection) against quack's tiles")
    parser.add_argument("--dact-outputs", action="store_true",
                        help="the dact product with both outputs against the gradient alone")
    parser.add_argument("--kept-derivative", action="store_true",
                        help="the MLP's GELU products against keeping the GELU's derivative from the forward")
    parser.add_argument("--weight-gradients", action="store_true",
                        help="the blocks' weight gradients: cuBLAS against quack's split-K")
    parser.add_argument("--layouts", nargs="+", default=["realistic", "one-doc"], choices=["realistic", "one-doc"])
    parser.add_argument("--only", nargs="*", default=None, help="with --attention: only these candidates by name")
    parser.add_argument("--microbatch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not (args.mlp or args.gelu or args.attention or args.softmax or args.products or args.dact_outputs
            or args.kept_derivative or args.weight_gradients):
        parser.error("say what to sweep: --mlp, --gelu, --attention, --softmax, --products, --dact-outputs, "
                     "--kept-derivative, --weight-gradients")
    if not torch.cuda.is_available():
        print("python -m tools bench tiles: needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"quack-kernels {flash4.installed_version(fused_mlp.QUACK_PACKAGE)}, "
          f"flash-attn-4 {flash4.installed_version(flash4.FA4_PACKAGE)}")
    if args.mlp:
        mlp(args)
    if args.gelu:
        gelu(args)
    if args.attention:
        attention(args)
    if args.softmax:
        softmax(args)
        head_chunk(args)
    if args.products:
        products(args)
    if args.dact_outputs:
        dact_outputs(args)
    if args.kept_derivative:
        kept_derivative(args)
    if args.weight_gradients:
        weight_gradients(args)
    return 0
