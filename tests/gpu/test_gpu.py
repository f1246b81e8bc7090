"""The CUDA fast paths against the plain ones: same function, within bf16 rounding. Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model import kernels
from model.kernels import flash4, fused_mlp
from model.kernels.attention import DocumentLayout, attend, document_offsets, varlen_attn
from model.decoder import ModelConfig
from model.families import build_model
from runfab.limits import GIB
from model.gpt import GPT
from model.kernels import ComputeConfig, Target
from model.loss import IGNORE_INDEX, token_loss_sum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EAGER = Target(torch.device("cuda"), torch.bfloat16)  # what models run under bf16 autocast here are built for
COMPILED = Target(torch.device("cuda"), torch.bfloat16, compiled=True)  # training's: the trunk compiled
FP32 = Target(torch.device("cuda"), torch.float32)  # a reference run as 32-true runs it: fp32 weights, no autocast
FA4_MISSING = flash4.fa4_unavailable_reason(COMPILED.gpu_capability(), 64) if torch.cuda.is_available() else "no GPU"
needs_fa4 = pytest.mark.skipif(FA4_MISSING is not None, reason=f"FlashAttention 4: {FA4_MISSING}")


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def packed_batch(rows: int, seq_len: int, vocab: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    positions = []
    for _ in range(rows):
        row, filled = [], 0
        while filled < seq_len:
            n = min(seq_len - filled, int(torch.randint(1, seq_len // 2, (1,), generator=generator)))
            row.append(torch.arange(n))
            filled += n
        positions.append(torch.cat(row))
    positions = torch.stack(positions)
    tokens = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    targets = torch.where(torch.roll(positions, -1, 1) != 0, torch.roll(tokens, -1, 1), IGNORE_INDEX)
    targets[:, -1] = IGNORE_INDEX
    batch = {"input_ids": tokens, "positions": positions, "targets": targets, "cu_seqlens": document_offsets(positions)}
    return {k: v.cuda() for k, v in batch.items()}


def twin_models(n_layer: int = 2, fast: dict | None = None, plain: dict | None = None,
                compiled: bool = False, reference: Target = EAGER) -> tuple[GPT, GPT]:
    """A fast model (PyTorch's varlen attention, chunked loss, unless ``fast`` says otherwise; built for compiled
    training with ``compiled``) and a plain eager one (SDPA with the document mask, the whole loss at once, unless
    ``plain`` says otherwise; built for ``reference``: FP32 runs it without autocast) with the same weights."""
    torch.manual_seed(0)
    shape = ModelConfig(vocab_size=512, n_layer=n_layer, n_head=4, n_embd=128, max_seq_len=256, init_std=0.05)
    fast = GPT(shape, ComputeConfig(**(dict(attention="varlen", loss_chunk_tokens=128) | (fast or {}))),
               COMPILED if compiled else EAGER).cuda()
    plain = GPT(shape, ComputeConfig(**(dict(attention="sdpa", loss_chunk_tokens=0) | (plain or {}))), reference).cuda()
    plain.load_state_dict(fast.state_dict())
    return fast, plain


@pytest.mark.skipif(varlen_attn is None, reason="torch.nn.attention.varlen is not in this PyTorch")
def test_varlen_and_chunked_loss_match_the_plain_path_forward_and_backward():
    fast, plain = twin_models()
    assert_same_loss_and_gradients(fast, plain, packed_batch(rows=4, seq_len=256, vocab=512, seed=1))


def assert_same_loss_and_gradients(fast: GPT, reference: GPT, batch: dict) -> None:
    """Forward and backward of both models on ``batch``, each under bf16 autocast where it was built for bf16 (a
    model built for FP32 runs in fp32 throughout): summed loss within 1e-3, every parameter's gradient within 2e-2
    (relative)."""
    results = []
    for model in (fast, reference):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=model.target.dtype == torch.bfloat16):
            loss = model.loss_sum(batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert relative_error(results[0][0], results[1][0]) < 1e-3
    for name, expected in results[1][1].items():
        assert relative_error(results[0][1][name], expected) < 2e-2, name


@pytest.mark.skipif(varlen_attn is None, reason="torch.nn.attention.varlen is not in this PyTorch")
def test_varlen_attention_never_crosses_documents():
    fast, _ = twin_models()
    assert_each_document_as_if_alone(fast, packed_batch(rows=2, seq_len=256, vocab=512, seed=2))


def assert_each_document_as_if_alone(model: GPT, batch: dict) -> None:
    """Packed rows give every document the logits it gets alone: attention never crosses documents."""
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed = model(batch["input_ids"], batch["positions"]).float()
        starts = batch["cu_seqlens"].tolist()
        flat_ids = batch["input_ids"].flatten()
        flat_logits = packed.flatten(0, 1)
        for a, b in zip(starts, starts[1:]):
            alone = model(flat_ids[a:b][None]).float()[0]  # one document alone (FA4: its dense causal kernel)
            assert relative_error(flat_logits[a:b], alone) < 1e-2


def test_chunked_loss_under_autocast_matches_the_plain_loss():
    torch.manual_seed(3)
    hidden = torch.randn(3000, 256, device="cuda", requires_grad=True)
    weight = (0.05 * torch.randn(50257, 256, device="cuda")).requires_grad_()
    targets = torch.randint(0, 50257, (3000,), device="cuda")
    targets[::7] = IGNORE_INDEX
    results = []
    for chunk in (0, 1024):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = token_loss_sum(hidden, weight, targets, chunk_tokens=chunk)
        results.append((loss.detach(), *torch.autograd.grad(loss, (hidden, weight))))
    for got, expected in zip(results[1], results[0]):
        assert relative_error(got, expected) < 1e-2


@pytest.mark.skipif(varlen_attn is None, reason="torch.nn.attention.varlen is not in this PyTorch")
def test_one_document_rows_use_fused_causal_sdpa_and_match_the_varlen_kernel(monkeypatch):
    fast, _ = twin_models()
    positions = torch.arange(256).expand(4, 256).cuda()
    tokens = torch.randint(0, 512, (4, 256), device="cuda")
    cu_seqlens = document_offsets(positions)
    # A fixed random direction, not the hidden states' squares: the final LayerNorm makes each row's sum of squares
    # constant, so that loss's gradients would be rounding noise with nothing to compare
    direction = torch.randn(4, 256, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    results = []
    for path in ("varlen", "sdpa"):
        fast.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if path == "varlen":  # the several-document path, forced, with the bf16 stream and output as below
                hidden = fast.trunk(tokens, positions, cu_seqlens, torch.bfloat16)
            else:
                calls = []
                monkeypatch.setattr("model.kernels.attention.varlen_attn", lambda *a, **k: calls.append(1))
                hidden = fast.hidden_states(tokens, positions, cu_seqlens)
                assert not calls  # one document per row never reaches the varlen kernel
        (hidden.float() * direction).mean().backward()
        results.append((hidden.detach(), {n: p.grad for n, p in fast.named_parameters()}))
    assert relative_error(results[1][0], results[0][0]) < 1e-2
    for name, expected in results[0][1].items():
        assert relative_error(results[1][1][name], expected) < 2e-2, name


def test_the_compiled_trunk_and_loss_match_eager_forward_and_backward():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fast, eager = twin_models(n_layer=3, fast=dict(attention="auto"),
                              plain=dict(attention="auto", loss_chunk_tokens=128), compiled=True)
    assert_same_loss_and_gradients(fast, eager, packed_batch(rows=4, seq_len=256, vocab=512, seed=5))
    assert counters["stats"]["unique_graphs"] <= 2  # the trunk, embeddings to final norm, and at most a kernel's own
    assert not counters["graph_break"]  # FA4's custom ops (when installed) trace into the graph
    if FA4_MISSING is None:
        assert fast.kernels_used()["attention"]["ran"]["packed rows"].startswith("FlashAttention 4 varlen")


def test_the_compiled_bf16_model_gives_the_fp32_models_loss_and_gradients_within_bf16_rounding():
    """Training's model (bf16 autocast, the residual stream in bf16, compiled) against the same weights in fp32
    throughout, as 32-true runs them: the whole step's rounding, the stream's included, stays within bf16's."""
    torch._dynamo.reset()
    fast, fp32 = twin_models(n_layer=3, fast=dict(attention="auto"), compiled=True, reference=FP32)
    batch = packed_batch(rows=4, seq_len=256, vocab=512, seed=6)
    assert_same_loss_and_gradients(fast, fp32, batch)
    seen = set()
    hook = fast.ln_f.register_forward_pre_hook(lambda _, args: seen.add(args[0].dtype))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        fast.eval().hidden_states(batch["input_ids"], batch["positions"], batch["cu_seqlens"])  # eager: hooks run
    hook.remove()
    assert seen == {torch.bfloat16}


def test_the_triton_chunk_kernel_matches_pytorchs_at_the_trainers_vocabulary():
    """One chunk of 4,096 x 50,304 bf16 logits (50,257 real columns), with ignored targets: the
    in-place Triton kernel's loss and gradient against the PyTorch function's."""
    from model.loss import chunk_loss_and_grad
    from model.kernels.triton_cross_entropy import loss_and_gradient_in_place

    gen = torch.Generator(device="cuda").manual_seed(21)
    logits = (3 * torch.randn(4096, 50304, device="cuda", generator=gen)).bfloat16()
    logits[:, 50257:] = 0
    targets = torch.randint(0, 50257, (4096,), device="cuda", generator=gen)
    targets[::7] = IGNORE_INDEX
    expected_loss, expected_grad = chunk_loss_and_grad(logits.clone(), targets, 50257, torch.bfloat16)
    got_loss = loss_and_gradient_in_place(logits, targets, 50257, IGNORE_INDEX)
    assert relative_error(got_loss, expected_loss) < 1e-6
    assert relative_error(logits, expected_grad) < 5e-3
    assert (logits[:, 50257:] == 0).all() and (logits[::7] == 0).all()


def test_the_compiled_model_with_the_two_pass_triton_loss_takes_the_plain_step():
    torch.manual_seed(0)  # vocabulary 500: the head is padded to 512 columns inside the loss
    shape = ModelConfig(vocab_size=500, n_layer=3, n_head=4, n_embd=128, max_seq_len=256, init_std=0.05)
    # the chunk kernel is chosen for compiled training only
    triton_model = GPT(shape, ComputeConfig(attention="sdpa", loss_chunk_tokens=384, loss="triton"), COMPILED).cuda()
    plain = GPT(shape, ComputeConfig(attention="sdpa", loss_chunk_tokens=0), EAGER).cuda()
    plain.load_state_dict(triton_model.state_dict())
    assert_same_loss_and_gradients(triton_model, plain, packed_batch(rows=4, seq_len=256, vocab=500, seed=9))
    assert triton_model.kernels_used()["loss"]["ran"] == "triton" and plain.kernels_used()["loss"]["ran"] == "eager"


# ----------------------------------------------------------------------------- FlashAttention 4


def lognormal_offsets(rows: int, t: int, mean: float, seed: int) -> torch.Tensor:
    """cu_seqlens of rows packed with lognormal documents (sigma 1, as the benchmark's records)."""
    generator = torch.Generator().manual_seed(seed)
    starts = []
    for r in range(rows):
        at = 0
        while at < t:
            starts.append(r * t + at)
            at += max(1, round(float(torch.empty(1).log_normal_(math.log(mean) - 0.5, 1.0, generator=generator))))
    return torch.tensor(starts + [rows * t], dtype=torch.int32)


def plain_attention(q, k, v, cu):
    """The plain path in fp32 on the bf16 inputs: SDPA with the document-causal mask, row by row."""
    b, t, h, hd = q.shape
    flat = cu.tolist()
    segment = torch.zeros(b * t, dtype=torch.int64, device=q.device)
    segment[torch.tensor(flat[1:-1], device=q.device).long()] = 1
    segment = segment.cumsum(0).view(b, t)
    mask = (segment[:, :, None] == segment[:, None, :]) & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    qs, ks, vs = (z.float().transpose(1, 2) for z in (q, k, v))
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[:, None]).transpose(1, 2)


@needs_fa4
@pytest.mark.parametrize("layout", ["realistic", "one-doc"])
def test_fa4_matches_the_plain_path_forward_and_gradients_at_the_trainers_shapes(layout):
    """12 heads of 64, rows of 4096 (2 rows: the fp32 reference holds the full score matrix)."""
    b, t, h, hd = 2, 4096, 12, 64
    cu = lognormal_offsets(b, t, 1000, seed=7) if layout == "realistic" else torch.arange(0, b * t + 1, t, dtype=torch.int32)
    cu = cu.cuda()
    positions = None if layout == "one-doc" else torch.ones(b, t, device="cuda")  # only "several documents" matters
    gen = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(b, t, 3 * h * hd, device="cuda", generator=gen).bfloat16().requires_grad_()
    grad = torch.randn(b, t, h, hd, device="cuda", generator=gen).bfloat16()

    def run(kernel):
        qkv.grad = None
        if kernel == "plain":
            out = plain_attention(*(z.view(b, t, h, hd) for z in qkv.split(h * hd, dim=-1)), cu)
        else:
            out = attend(qkv.view(b, t, 3 * h, hd), h, DocumentLayout(positions, cu if positions is not None else None),
                         kernel)
        out.backward(grad.to(out.dtype))
        return [out.detach()] + list(qkv.grad.float().split(h * hd, dim=-1))

    expected = run("plain")
    fa4 = run("fa4")
    torch2 = run("flash")  # PyTorch's kernels (FA2 varlen, or fused SDPA for one-document rows), for scale
    for name, got, theirs, want in zip(("out", "dq", "dk", "dv"), fa4, torch2, expected):
        error, baseline = relative_error(got, want), relative_error(theirs, want)
        assert error < 1e-2 and error < 2 * baseline + 1e-3, (name, error, baseline)


@needs_fa4
def test_fa4_varlen_never_crosses_documents_and_agrees_with_fa4_dense():
    torch.manual_seed(0)
    base = dict(vocab_size=512, n_layer=2, n_head=2, n_embd=128, max_seq_len=256, init_std=0.05)  # head dim 64
    fast = GPT(ModelConfig(**base), ComputeConfig(attention="fa4"), EAGER).cuda()
    assert_each_document_as_if_alone(fast, packed_batch(rows=2, seq_len=256, vocab=512, seed=2))
    ran = fast.kernels_used()["attention"]["ran"]
    assert ran["packed rows"].startswith("FlashAttention 4 varlen")
    assert ran["one-document rows"].startswith("FlashAttention 4 dense causal")


@needs_fa4
def test_the_compiled_trunk_runs_fa4_without_a_graph_break_and_matches_eager():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    shape = ModelConfig(vocab_size=512, n_layer=3, n_head=2, n_embd=128, max_seq_len=256, init_std=0.05)
    fast, eager = (GPT(shape, ComputeConfig(attention="fa4"), target).cuda() for target in (COMPILED, EAGER))
    eager.load_state_dict(fast.state_dict())
    for seed in (5, 6):  # two document counts: one graph (cu_seqlens is dynamic)
        assert_same_loss_and_gradients(fast, eager, packed_batch(rows=4, seq_len=256, vocab=512, seed=seed))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2  # the trunk, and at most a kernel's own


# ----------------------------------------------------------------------------- grouped-query attention, Llama


def grouped_plain_attention(q, k, v, cu):
    """``plain_attention`` with each key/value head repeated to its group of query heads: GQA's definition."""
    group = q.shape[2] // k.shape[2]
    return plain_attention(q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2), cu)


needs_varlen = pytest.mark.skipif(varlen_attn is None, reason="torch.nn.attention.varlen is not in this PyTorch")
GQA_KERNELS = [pytest.param("fa4", marks=needs_fa4), pytest.param("flash", marks=needs_varlen)]  # attend's names


@pytest.mark.parametrize("kernel", GQA_KERNELS)
@pytest.mark.parametrize("kv_heads", [1, 2, 12])
@pytest.mark.parametrize("layout", ["realistic", "one-doc"])
def test_each_kernel_takes_fewer_key_value_heads_natively_and_matches_the_plain_path(kernel, kv_heads, layout):
    """12 query heads of 64 over rows of 2048, with 1 (multi-query), 2 or 12 key/value heads: each kernel's output
    and the gradients of q, k and v against fp32 SDPA with the key/value heads repeated, as close as SDPA's own
    bf16 grouped-query path is (within 2x of its error)."""
    b, t, h, hd = 2, 2048, 12, 64
    cu = lognormal_offsets(b, t, 500, seed=11) if layout == "realistic" else torch.arange(0, b * t + 1, t,
                                                                                          dtype=torch.int32)
    cu = cu.cuda()
    positions = None if layout == "one-doc" else torch.ones(b, t, device="cuda")  # only "several documents" matters
    gen = torch.Generator(device="cuda").manual_seed(kv_heads)
    qkv = torch.randn(b, t, (h + 2 * kv_heads) * hd, device="cuda", generator=gen).bfloat16().requires_grad_()
    grad = torch.randn(b, t, h, hd, device="cuda", generator=gen).bfloat16()
    sizes = (h * hd, kv_heads * hd, kv_heads * hd)

    def run(kernel):
        qkv.grad = None
        if kernel == "plain":
            q, k, v = (z.reshape(b, t, -1, hd) for z in qkv.split(sizes, dim=-1))
            out = grouped_plain_attention(q, k, v, cu)
        else:
            layout_ = DocumentLayout(positions, cu if positions is not None else None)
            if kernel == "sdpa" and positions is not None:
                layout_ = DocumentLayout(document_positions(cu, b, t), None)  # SDPA builds its mask from positions
            out = attend(qkv.view(b, t, h + 2 * kv_heads, hd), kv_heads, layout_, kernel)
        out.backward(grad.to(out.dtype))
        return [out.detach()] + list(qkv.grad.float().split(sizes, dim=-1))

    expected, got, sdpa = run("plain"), run(kernel), run("sdpa")
    for name, mine, theirs, want in zip(("out", "dq", "dk", "dv"), got, sdpa, expected):
        error, baseline = relative_error(mine, want), relative_error(theirs, want)
        assert error < 1e-2 and error < 2 * baseline + 1e-3, (name, error, baseline)


def document_positions(cu: torch.Tensor, rows: int, t: int) -> torch.Tensor:
    """Each token's position in its document, from the flattened rows' document offsets."""
    flat = torch.arange(rows * t, device=cu.device)
    starts = cu[:-1].long()
    return (flat - starts[torch.searchsorted(starts, flat, right=True) - 1]).view(rows, t)


def llama_twins(n_kv_head: int, fast: dict, plain: dict | None = None, n_layer: int = 2, compiled: bool = False,
                reference: Target = EAGER):
    """Two Llamas of the same weights: ``fast`` (built for compiled training with ``compiled``) and ``plain`` (eager,
    SDPA with the mask, the whole loss at once, built for ``reference``: FP32 runs it without autocast)."""
    torch.manual_seed(0)
    shape = ModelConfig(family="llama", vocab_size=512, n_layer=n_layer, n_head=4, n_kv_head=n_kv_head, n_embd=256,
                        max_seq_len=256, init_std=0.05)
    fast_model = build_model(shape, ComputeConfig(**(dict(loss_chunk_tokens=128) | fast)),
                             COMPILED if compiled else EAGER).cuda()
    plain_model = build_model(shape, ComputeConfig(**(dict(attention="sdpa", loss_chunk_tokens=0) | (plain or {}))),
                              reference)
    plain_model.cuda().load_state_dict(fast_model.state_dict())
    return fast_model, plain_model


@pytest.mark.parametrize("kernel", [pytest.param("fa4", marks=needs_fa4), pytest.param("varlen", marks=needs_varlen)])
@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_a_llama_takes_the_plain_paths_step_and_keeps_documents_apart(kernel, n_kv_head):
    fast, plain = llama_twins(n_kv_head, dict(attention=kernel))
    assert_same_loss_and_gradients(fast, plain, packed_batch(rows=4, seq_len=256, vocab=512, seed=12))
    assert_each_document_as_if_alone(fast, packed_batch(rows=2, seq_len=256, vocab=512, seed=13))


@pytest.mark.parametrize("n_kv_head", [1, 4])
def test_a_compiled_llama_matches_eager_without_a_graph_break(n_kv_head):
    """The compiled trunk (RMSNorm, rotary positions and SwiGLU fused by inductor, the attention chosen by auto)
    against the same weights eager in fp32 throughout (32-true), the bf16 residual stream included."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fast, fp32 = llama_twins(n_kv_head, dict(attention="auto"), n_layer=3, compiled=True, reference=FP32)
    for seed in (14, 15):  # two document counts: one graph
        assert_same_loss_and_gradients(fast, fp32, packed_batch(rows=4, seq_len=256, vocab=512, seed=seed))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2
    assert fast.kernels_used()["mlp"]["ran"] == "torch"


# ----------------------------------------------------------------------------- quack's fused GELU GEMMs

QUACK_MISSING = fused_mlp.quack_unavailable_reason(COMPILED.gpu_capability(), torch.bfloat16, 768) \
    if torch.cuda.is_available() else "no GPU"
needs_quack = pytest.mark.skipif(QUACK_MISSING is not None, reason=f"quack: {QUACK_MISSING}")


@needs_quack
@pytest.mark.parametrize("compiled", [False, True])
def test_quacks_mlp_matches_pytorchs_forward_and_gradients_at_the_trainers_width(compiled):
    """8,192 tokens through fc 768 -> 3,072, exact GELU, proj 3,072 -> 768, fp32 weights under bf16 autocast as in
    training: quack's output and all three gradients, recomputing the activation in the backward or keeping the
    GELU's derivative from the forward, against an fp32 reference are as close as PyTorch's bf16 path's are (within
    1.5x of its error), and they agree with each other within bf16 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(31)
    x = torch.randn(4, 2048, 768, device="cuda", generator=gen).bfloat16().requires_grad_()
    fc = (0.02 * torch.randn(3072, 768, device="cuda", generator=gen)).requires_grad_()
    proj = (0.004 * torch.randn(768, 3072, device="cuda", generator=gen)).requires_grad_()
    dout = torch.randn(4, 2048, 768, device="cuda", generator=gen).bfloat16()
    reference = fused_mlp.torch_mlp(x.float(), fc, proj)
    expected = (reference, *torch.autograd.grad(reference, (x, fc, proj), dout.float()))
    results = {}
    for kernel in ("quack", fused_mlp.KEPT_DERIVATIVE, "torch"):
        fn = fused_mlp.kernel(kernel) or fused_mlp.torch_mlp
        fn = torch.compile(fn) if compiled else fn
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(x, fc, proj)
        results[kernel] = (out, *torch.autograd.grad(out, (x, fc, proj), dout))
    for kernel in ("quack", fused_mlp.KEPT_DERIVATIVE):
        for what, got, plain, exact in zip(("out", "dx", "dfc", "dproj"), results[kernel], results["torch"], expected):
            assert got.shape == exact.shape and got.dtype == plain.dtype, (kernel, what)
            assert relative_error(got, exact) <= 1.5 * relative_error(plain, exact) + 1e-4, (kernel, what)
            assert relative_error(got, plain) < 1e-2, (kernel, what)
    for got, kept in zip(results["quack"], results[fused_mlp.KEPT_DERIVATIVE]):  # the same function to bf16 rounding
        assert relative_error(kept, got) < 5e-3


@needs_quack
def test_the_models_gelu_in_quacks_epilogues_is_the_exact_gelu_to_bf16_rounding():
    """model/kernels/quack_gelu.py's formula inside quack's two GELU products at the trainer's width: the activation the
    dact product hands back is the exact GELU's bf16 rounding at least as often as PyTorch's F.gelu, and one bf16 step
    from it elsewhere; the input gradient and the forward's activation agree with quack's own erf GELU's."""
    from quack.gemm_interface import gemm_act, gemm_dact

    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(8192, 768, device="cuda", generator=gen).bfloat16()
    fc = (0.04 * torch.randn(3072, 768, device="cuda", generator=gen)).bfloat16()
    proj = (0.02 * torch.randn(768, 3072, device="cuda", generator=gen)).bfloat16()
    dout = torch.randn(8192, 768, device="cuda", generator=gen).bfloat16()
    preact = x @ fc.t()
    wide = preact.double()
    exact = wide * 0.5 * torch.special.erfc(-wide / 2 ** 0.5)
    dpre, post = gemm_dact(dout, proj, preact, activation=fused_mlp.ACTIVATION, tuned=False)[:2]
    dpre_erf, _ = gemm_dact(dout, proj, preact, activation="gelu_erf", tuned=False)[:2]
    share = (post == exact.bfloat16()).float().mean()
    pytorch_share = (torch.nn.functional.gelu(preact.float()).bfloat16() == exact.bfloat16()).float().mean()
    assert share >= pytorch_share - 1e-4, (float(share), float(pytorch_share))
    step = exact.abs().bfloat16().double() * 2.0 ** -7  # at least one bf16 step at each value
    assert bool(((post.double() - exact).abs() <= step)[wide > -6].all())
    assert relative_error(dpre, dpre_erf) < 2e-3
    forward = gemm_act(x, fc.t(), activation=fused_mlp.ACTIVATION, tuned=False)[1]
    forward_erf = gemm_act(x, fc.t(), activation="gelu_erf", tuned=False)[1]
    assert (forward == forward_erf).float().mean() > 0.999


@needs_quack
def test_the_compiled_model_with_quacks_gemms_matches_the_plain_path_without_a_graph_break():
    """quack's MLP epilogues in the compiled trunk, and on Hopper the head's logits with their log-sum-exp in the
    chunked loss, against the plain path."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # the first two blocks recompute the activation, the last keeps gelu' (on Hopper)
    fast, plain = twin_models(n_layer=3, fast=dict(mlp="quack", mlp_kept_derivatives=1), plain=dict(mlp="torch"),
                              compiled=True)
    for seed in (11, 12):
        assert_same_loss_and_gradients(fast, plain, packed_batch(rows=4, seq_len=256, vocab=512, seed=seed))
    hopper = torch.cuda.get_device_capability()[0] == kernels.LSE_COMPUTE_CAPABILITY
    used = fast.kernels_used()
    assert used["mlp"] == {"requested": "quack", "ran": "quack", "blocks_keeping_the_gelu_derivative": int(hopper)}
    assert used["loss"]["ran"] == ("quack" if hopper else "triton")
    assert plain.kernels_used()["mlp"]["ran"] == "torch"
    assert not counters["graph_break"], dict(counters["graph_break"])


@needs_quack
def test_quacks_logits_with_their_log_sum_exp_are_its_products_logits_and_their_log_sum_exp():
    """model/kernels/quack_lse.py at the trainer's vocabulary: the logits bit for bit those of quack's plain product;
    each row's log-sum-exp that of those stored logits; and the single-pass Triton kernel on them gives the two-pass
    kernel's loss and gradient."""
    from quack.gemm_interface import gemm

    from model.kernels import quack_lse
    from model.kernels.triton_cross_entropy import gradient_in_place, loss_and_gradient_in_place

    if torch.cuda.get_device_capability()[0] != kernels.LSE_COMPUTE_CAPABILITY:
        pytest.skip("the log-sum-exp epilogue is Hopper's")
    gen = torch.Generator(device="cuda").manual_seed(23)
    rows = torch.randn(4096, 768, device="cuda", generator=gen).bfloat16()
    weight = torch.zeros(50304, 768, device="cuda", dtype=torch.bfloat16)
    weight[:50257] = 0.2 * torch.randn(50257, 768, device="cuda", generator=gen)  # peaked rows: logits up to ~30
    targets = torch.randint(0, 50257, (4096,), device="cuda", generator=gen)
    targets[::7] = IGNORE_INDEX
    logits, tiles = quack_lse.logits_and_tile_log_normalizers(rows, weight, 50257)
    plain = gemm(rows, weight.t(), tuned=False)
    assert logits.shape == plain.shape and torch.equal(logits[:, :50257], plain[:, :50257])
    stored = torch.logsumexp(plain[:, :50257].double(), dim=-1)
    exact = torch.logsumexp((rows.double() @ weight[:50257].double().t()), dim=-1)
    lse = torch.logsumexp(tiles.double(), dim=-1)
    assert tiles.shape[0] == 4096 and tiles.shape[1] > 1  # per column tile, raw
    assert (lse - stored).abs().max() < 2e-5 < (exact - stored).abs().max()
    two_pass = plain.clone()
    expected_loss = loss_and_gradient_in_place(two_pass, targets, 50257, IGNORE_INDEX)
    got_loss = gradient_in_place(logits, tiles, targets, 50257, IGNORE_INDEX)
    assert relative_error(got_loss, expected_loss) < 1e-6
    assert relative_error(logits, two_pass) < 1e-4
    assert bool((logits[:, 50257:] == 0).all()) and bool((logits[::7] == 0).all())


@needs_quack
def test_the_compiled_model_takes_the_same_step_with_the_log_sum_exp_from_quacks_epilogue():
    """compute.loss quack (the logits with their log-sum-exp, then one Triton pass) against triton (cuBLAS's logits,
    then two), at a padded vocabulary."""
    torch.manual_seed(0)  # vocabulary 500: the head is padded to 512 columns inside the loss
    shape = ModelConfig(vocab_size=500, n_layer=3, n_head=4, n_embd=128, max_seq_len=256, init_std=0.05)
    lse_model, triton_model = (GPT(shape, ComputeConfig(attention="sdpa", loss_chunk_tokens=384, loss=kernel),
                                   COMPILED).cuda() for kernel in ("auto", "triton"))
    triton_model.load_state_dict(lse_model.state_dict())
    assert_same_loss_and_gradients(lse_model, triton_model, packed_batch(rows=4, seq_len=256, vocab=500, seed=10))
    hopper = torch.cuda.get_device_capability()[0] == kernels.LSE_COMPUTE_CAPABILITY
    ran = lse_model.kernels_used()["loss"]["ran"], triton_model.kernels_used()["loss"]["ran"]
    assert ran == ("quack" if hopper else "triton", "triton")


# ----------------------------------------------------------------------------- whole runs


def test_a_memory_window_dumps_a_snapshot_the_memory_viz_reads(tmp_path, monkeypatch):
    import io
    import json
    import pickle

    import train

    from runtime.batch_split import BatchSplit

    from runtime import device_policy


    from runtime import training_run
    from config import load_config
    from runfab.shipping import folder_bytes
    from tests.helpers import IN_PROCESS_RUN, Stdin, as_dotlist, records

    monkeypatch.chdir(tmp_path)
    # As in a fresh process: importing Lightning wrote inductor's /tmp default, Triton's is unset
    # (earlier tests in this process pointed both at their own outputs).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(device_policy.inductor_default_cache()))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    cfg = load_config("conf/smoke.yaml", [*as_dotlist(IN_PROCESS_RUN), f"output.root={tmp_path}", "trainer.max_steps=3",
                                          "trainer.val_every_steps=0", "observe.memory_update=2",
                                          "trainer.devices=1"])  # one process, also on a host of several GPUs
    monkeypatch.setattr("sys.stdout", io.StringIO())
    training_run.run_training(cfg, BatchSplit(8, 4, 1, train.EFFECTIVE_BATCH_SIZE), stdin=Stdin(io.BytesIO(records(600))))
    record = json.loads((tmp_path / "model/run_record.json").read_text())
    assert record["observations"] == ["memory/snapshot-update-2.pickle"]
    snapshot = pickle.loads((tmp_path / "run/memory/snapshot-update-2.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]
    events = [event for trace in snapshot["device_traces"] for event in trace]
    assert {"alloc", "free_completed"} <= {event["action"] for event in events}
    frames = {frame["name"] for event in events for frame in event.get("frames", [])}
    assert {"training_step", "loss_sum"} <= frames  # allocations carry the Python stack that made them
    cache = tmp_path / "data/compile-cache"  # the compiled trunk's caches: under the output, not /tmp
    assert list((cache / "inductor").rglob("*.py")) and list((cache / "triton").rglob("*.cubin"))
    reported = record["compile_cache"]  # and the run record says how much of the output they take
    assert reported["inductor"]["path"] == str(cache / "inductor") and reported["triton"]["path"] == str(cache / "triton")
    assert 0 < reported["triton"]["bytes"] <= folder_bytes(cache / "triton")


def test_the_allocator_cap_keeps_the_headroom_and_any_smaller_platform_fraction():
    from runtime import device_policy
    from config import load_config

    cfg = load_config("conf/smoke.yaml", ["trainer.memory_headroom_gib=4"])
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        own = device_policy.limit_gpu_memory(cfg, 0, device_policy.platform_memory_fraction())
        assert own == pytest.approx(1 - 4 * GIB / total)
        torch.cuda.set_per_process_memory_fraction(0.25, 0)  # as a platform would, before calling a hook
        assert device_policy.platform_memory_fraction() == pytest.approx(0.25)
        assert device_policy.limit_gpu_memory(cfg, 0, device_policy.platform_memory_fraction()) == pytest.approx(0.25)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(0.3 * total), dtype=torch.uint8, device="cuda")
        assert device_policy.limit_gpu_memory(cfg, 0, None, margin_gib=1.0) == pytest.approx(1 - 5 * GIB / total)  # probe
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def test_the_probe_reports_the_peak_gpu_memory_it_measured():
    import train
    from runtime import probe
    from config import load_config

    cfg = load_config("conf/smoke.yaml")
    try:
        result = probe.run_probe_local(cfg, microbatch=2, world=1, effective=train.EFFECTIVE_BATCH_SIZE)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert result["steps"] > 0
    assert 0 < result["peak_allocated_gib"] <= result["peak_reserved_gib"]


@needs_fa4
def test_the_probe_with_pytorchs_attention_measures_at_least_the_peak_with_fa4():
    """Under compute.attention auto the probe runs PyTorch's attention where training takes FA4: a
    lower peak than FA4's in the probe would pass a microbatch that training might not fit."""
    import gc

    import train
    from runtime import probe
    from config import load_config

    shape = ["model.n_embd=256", "model.n_head=4", "model.max_seq_len=1024"]  # head dimension 64, as FA4 needs
    peaks = {}
    for requested in ("auto", "fa4"):
        cfg = load_config("conf/smoke.yaml", [*shape, f"compute.attention={requested}"])
        try:
            result = probe.run_probe_local(cfg, microbatch=8, world=1, effective=train.EFFECTIVE_BATCH_SIZE)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
        peaks[requested] = result["peak_allocated_gib"]
        gc.collect()  # the first probe's model and optimizer gone before the second measures its peak
        torch.cuda.empty_cache()
    assert peaks["auto"] >= 0.99 * peaks["fa4"], peaks


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_one_and_two_gpus_train_the_same_updates_and_both_ranks_end_at_an_awkward_record_count(tmp_path):
    """The same stream through one GPU (microbatch 8 x accumulation 4) and two (8 x 2 each): every
    update's global loss and the final weights agree within bf16 rounding, and an input of 391
    records (no update boundary) ends both ranks at the same update, with exit 0 and no hang."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.helpers import ROOT as root
    lines = (root / "data/sample.jsonl").read_bytes().splitlines(keepends=True)
    records = b"".join(lines[:391])
    runs = {}
    for gpus in (1, 2):
        out = tmp_path / f"gpus{gpus}"
        args = ["--config", "conf/smoke.yaml", "--trainer.devices", str(gpus), "--microbatch", "8",
                "--trainer.max_steps", "-1", "--optim.schedule", "constant", "--metrics.interval_seconds", "0",
                "--trainer.val_every_steps", "0", "--data.val_fraction", "0"]
        result = subprocess.run([sys.executable, str(root / "train.py"), *args], input=records, capture_output=True,
                                timeout=300, env=dict(os.environ, RUNFABRIC_OUTPUT=str(out)), cwd=tmp_path)
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        record = json.loads((out / "model/run_record.json").read_text())
        assert record["input"]["end_of_input"] and record["optimizer_steps"] == record["input"]["updates"] >= 3
        assert record["world_size"] == gpus
        lines = [json.loads(line) for line in result.stdout.splitlines()]
        losses = [(line["step"], line["loss"]) for line in lines if "loss" in line]
        runs[gpus] = (losses, load_file(out / "model/model.safetensors"), record["input"]["input_sha256"])
    (one, weights_one, input_one), (two, weights_two, input_two) = runs[1], runs[2]
    assert input_one == input_two
    assert [step for step, _ in one] == [step for step, _ in two] == list(range(1, len(one) + 1))
    for (step, a), (_, b) in zip(one, two):
        assert b == pytest.approx(a, rel=2e-3), f"update {step}"
    for name, expected in weights_one.items():
        if not expected.any():  # the export's zero biases (GPT-2's Conv1D has them, our Linear does not)
            assert not weights_two[name].any(), name
            continue
        assert relative_error(weights_two[name], expected) < 1e-2, name
