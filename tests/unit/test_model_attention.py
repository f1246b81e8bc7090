"""Kernel selection and the FlashAttention 4 custom ops, on CPU.

FA4 itself needs a Hopper or Blackwell GPU (tests/gpu/test_gpu.py runs it there). Here the selection
runs for GPUs a Target describes (its compute capability) against a fake of FA4's import, and the
custom ops run with a float32 reference of FA4's interface behind them: that checks the calls into
FA4, the ops' fake (shape) functions, their autograd formula and that torch.compile traces them
without a graph break, on any machine.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from model import kernels
from model.kernels import attention, flash4, gpu
from model.kernels.attention import document_offsets
from model.decoder import ModelConfig
from model.families import build_model
from model.gpt import GPT
from model.kernels import ComputeConfig, Target

CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


# ----------------------------------------------------------------------------- selection


@pytest.fixture
def fa4_import(monkeypatch):
    """An FA4 that imports unless ``state["imports"]`` is False; ``state["imported"]`` counts the tries. (Whether
    the package is installed is the one thing faked: the GPU is the Target's compute capability.)"""
    state = {"imports": True, "imported": 0}

    def import_problem():
        state["imported"] += 1
        return None if state["imports"] else "flash_attn.cute does not import (ModuleNotFoundError)"

    monkeypatch.setattr(flash4, "fa4_import_problem", import_problem)
    return state


def attention_kernel(requested: str, device, dtype, head_dim: int, capability=None) -> str:
    target = Target(device, dtype, capability=capability if device.type == "cuda" else None)
    return kernels.attention_kernel(ComputeConfig(attention=requested), target, head_dim)


def test_auto_takes_fa4_on_hopper_and_blackwell_when_it_imports(fa4_import):
    assert attention_kernel("auto", CUDA, torch.bfloat16, 64, (9, 0)) == "fa4"
    assert attention_kernel("fa4", CUDA, torch.float16, 64, (9, 0)) == "fa4"
    assert attention_kernel("auto", CUDA, torch.bfloat16, 64, (10, 0)) == "fa4"


@pytest.mark.parametrize("capability, imports, head_dim, says", [
    ((8, 0), True, 64, "compute capability 8.0 is not one FA4 supports"),
    ((9, 0), False, 64, "flash_attn.cute does not import"),
    ((9, 0), True, 160, "head dimension 160 is not a multiple of 8 up to 128")])
def test_auto_keeps_pytorchs_kernels_where_fa4_cannot_run_and_fa4_says_why(fa4_import, capability, imports, head_dim,
                                                                           says):
    fa4_import.update(imports=imports)
    assert attention_kernel("auto", CUDA, torch.bfloat16, head_dim, capability) == "flash"
    with pytest.raises(RuntimeError, match=f"compute.attention is 'fa4' but it cannot run: {says}"):
        attention_kernel("fa4", CUDA, torch.bfloat16, head_dim, capability)


def test_cpu_fp32_and_explicit_choices_never_import_fa4(fa4_import):
    assert attention_kernel("auto", torch.device("cpu"), torch.float32, 64) == "sdpa"
    assert attention_kernel("auto", CUDA, torch.float32, 64, (9, 0)) == "sdpa"  # FA4 and FA2 want half precision
    assert attention_kernel("varlen", CUDA, torch.bfloat16, 64, (9, 0)) == "flash"
    assert attention_kernel("sdpa", CUDA, torch.bfloat16, 64, (9, 0)) == "sdpa"
    assert fa4_import["imported"] == 0


def test_the_model_records_and_describes_the_kernel_of_each_batch_kind():
    model = GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, max_seq_len=32))
    with torch.no_grad():
        model.hidden_states(torch.randint(0, 64, (2, 32)))
    assert model.kernels_used()["attention"] == {
        "requested": "auto", "ran": {"one-document rows": "SDPA is_causal", "packed rows": "SDPA with a document mask"}}
    assert attention.describe("fa4", packed=True).startswith("FlashAttention 4 varlen")
    assert attention.describe("fa4", packed=False).startswith("FlashAttention 4 dense causal")
    assert attention.describe("flash", packed=True) == "varlen_attn (FlashAttention 2)"


def test_fa4_caches_go_under_the_output_in_training_and_nowhere_otherwise(monkeypatch, tmp_path):
    for variable in (*gpu.CACHE_VARIABLES.values(), "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
                     "CUTE_DSL_DISABLE_FILE_CACHING", "QUACK_CACHE_ENABLED"):
        monkeypatch.delenv(variable, raising=False)
    gpu.use_cache_folder(None)
    gpu.prepare_environment()  # the probe, tests: memory only, no folder made anywhere
    assert os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] == "1" and os.environ["CUTE_DSL_CACHE_DIR"] == os.devnull
    assert os.environ["QUACK_CACHE_ENABLED"] == "0"  # quack's .o cache would default to /tmp
    assert gpu.cache_usage_folders() == {}

    for variable in ("CUTE_DSL_DISABLE_FILE_CACHING", "CUTE_DSL_CACHE_DIR", "QUACK_CACHE_ENABLED"):
        monkeypatch.delenv(variable)
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "mine"))  # a folder someone chose stays
    gpu.use_cache_folder(tmp_path / "data/compile-cache")  # what device_policy.prepare_compile does
    gpu.prepare_environment()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert gpu.cache_usage_folders() == {
        "flash-attn": tmp_path / "mine", "cute-dsl": tmp_path / "data/compile-cache/cute-dsl",
        "quack": tmp_path / "data/compile-cache/quack"}
    gpu.use_cache_folder(None)


def test_prepare_compile_hands_its_folder_to_fa4(monkeypatch, tmp_path):
    from runtime import device_policy

    for variable in (*gpu.CACHE_VARIABLES.values(), "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
                     "CUTE_DSL_DISABLE_FILE_CACHING", "QUACK_CACHE_ENABLED"):
        monkeypatch.delenv(variable, raising=False)
    gpu.use_cache_folder(None)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # leave inductor's settings alone
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    device_policy.prepare_compile(tmp_path / "data/compile-cache", 1)
    gpu.prepare_environment()
    assert set(gpu.cache_usage_folders().values()) == {
        tmp_path / "data/compile-cache" / name for name in gpu.CACHE_VARIABLES}
    gpu.use_cache_folder(None)


# ----------------------------------------------------------------------------- the custom ops


def _segments(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(row, start, end) of each document; dense rows are one document each."""
    if cu_seqlens is None:
        return [(row, 0, q.shape[1]) for row in range(q.shape[0])]
    bounds = cu_seqlens.tolist()
    return [(0, a, b) for a, b in zip(bounds, bounds[1:])]


def _probabilities(q, k, a, b):
    """Causal softmax of one document's scores [H, t, t], and the scale."""
    scale = 1 / math.sqrt(q.shape[-1])
    scores = torch.einsum("thd,shd->hts", q[a:b], k[a:b]) * scale
    return scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf")), scale


def _as_many_heads(z, heads):
    """Key or value heads repeated to the query heads' count: grouped-query attention's definition."""
    return z.repeat_interleave(heads // z.shape[-2], dim=-2)


def reference_forward(q, k, v, cu_seqlens, max_seqlen):
    """FA4's contract in float32: causal attention per document, each key/value head serving a group of
    consecutive query heads, and the log-sum-exp FA4 returns ([B, H, T] dense, [H, total] varlen)."""
    dense = cu_seqlens is None
    k, v = (_as_many_heads(z, q.shape[-2]) for z in (k, v))
    qs, ks, vs = (z.float() if dense else z.float()[None] for z in (q, k, v))
    out = torch.empty_like(qs)
    lse = torch.empty(qs.shape[0], qs.shape[2], qs.shape[1])
    for row, a, b in _segments(q, cu_seqlens):
        scores, _ = _probabilities(qs[row], ks[row], a, b)
        lse[row, :, a:b] = torch.logsumexp(scores, dim=-1)
        out[row, a:b] = torch.einsum("hts,shd->thd", scores.softmax(-1), vs[row, a:b])
    return (out.to(q.dtype), lse) if dense else (out[0].to(q.dtype), lse[0])


def reference_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, dq_out, dk_out, dv_out):
    """The textbook gradients (custom ops run below autograd, so no autograd here), written into
    the ``*_out`` views of one buffer, as FA4 writes them; a key/value head's gradient sums its group's."""
    dense = cu_seqlens is None
    group = q.shape[-2] // k.shape[-2]
    k, v = (_as_many_heads(z, q.shape[-2]) for z in (k, v))
    qs, ks, vs, dos = (z.float() if dense else z.float()[None] for z in (q, k, v, dout))
    dq, dk, dv = (torch.zeros_like(z) for z in (qs, ks, vs))
    for row, a, b in _segments(q, cu_seqlens):
        scores, scale = _probabilities(qs[row], ks[row], a, b)
        p = scores.softmax(-1)
        d_out = dos[row, a:b]
        dv[row, a:b] = torch.einsum("hts,thd->shd", p, d_out)
        dp = torch.einsum("thd,shd->hts", d_out, vs[row, a:b])
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq[row, a:b] = torch.einsum("hts,shd->thd", ds, ks[row, a:b])
        dk[row, a:b] = torch.einsum("hts,thd->shd", ds, qs[row, a:b])
    dk, dv = (z.unflatten(-2, (-1, group)).sum(-2) for z in (dk, dv))
    grads = (dq, dk, dv) if dense else (dq[0], dk[0], dv[0])
    for buffer, grad in zip((dq_out, dk_out, dv_out), grads):
        buffer.copy_(grad)


class ReferenceFA4:
    """flash_attn.cute.interface's two calls the custom ops make, by the references above."""

    @staticmethod
    def _flash_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, return_lse):
        assert causal and return_lse and cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
        return reference_forward(q, k, v, cu_seqlens_q, max_seqlen_q)

    @staticmethod
    def _flash_attn_bwd(q, k, v, out, dout, lse, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        dq, dk, dv):
        assert causal and cu_seqlens_q is cu_seqlens_k
        reference_backward(dout, q, k, v, out, lse, cu_seqlens_q, max_seqlen_q, dq, dk, dv)
        return dq, dk, dv


@pytest.fixture
def reference_fa4(monkeypatch):
    monkeypatch.setattr(flash4, "fa4_interface", lambda: ReferenceFA4)


def packed_qkv(seed: int, kv_heads: int = 2):
    """Projection outputs [B, T, (H + 2 KV) hd] of 4 query heads, and positions of two documents a row."""
    generator = torch.Generator().manual_seed(seed)
    b, t, h, hd = 2, 24, 4, 8
    qkv = torch.randn(b, t, (h + 2 * kv_heads) * hd, generator=generator, requires_grad=True)
    positions = torch.cat([torch.arange(7), torch.arange(17)]).expand(b, t)
    return qkv, positions, (b, t, h, hd)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("packed", [False, True])
def test_the_custom_op_passes_pytorchs_op_checks(reference_fa4, packed, kv_heads):
    generator = torch.Generator().manual_seed(0)
    shape = (40, 2 + 2 * kv_heads, 8) if packed else (2, 20, 2 + 2 * kv_heads, 8)
    qkv = torch.randn(shape, generator=generator, requires_grad=True)
    cu = torch.tensor([0, 13, 40], dtype=torch.int32) if packed else None
    torch.library.opcheck(flash4.fa4_forward, (qkv, kv_heads, cu, 20 if packed else 0))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_attend_through_fa4_matches_the_plain_path_and_compiles_without_a_graph_break(reference_fa4, packed,
                                                                                     kv_heads):
    from torch._dynamo.utils import counters

    qkv, positions, (b, t, h, hd) = packed_qkv(seed=1, kv_heads=kv_heads)
    positions = positions if packed else None
    cu = document_offsets(positions) if packed else None
    grad = torch.randn(b, t, h, hd, generator=torch.Generator().manual_seed(2))

    def attend(qkv, cu, kernel):
        return attention.attend(qkv.view(b, t, h + 2 * kv_heads, hd), kv_heads, attention.DocumentLayout(positions, cu),
                                kernel)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)  # fullgraph: a break raises
    results = []
    for fn, kernel in ((attend, "sdpa"), (attend, "fa4"), (compiled, "fa4")):
        qkv.grad = None
        out = fn(qkv, cu, kernel)
        out.backward(grad)
        results.append((out.detach(), qkv.grad.clone()))
    for out, dqkv in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dqkv, results[0][1], rtol=1e-5, atol=1e-5)
    assert not counters["graph_break"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_compiled_trunk_with_fa4_is_one_graph_for_every_document_count(reference_fa4, family):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    llama = dict(n_kv_head=1) if family == "llama" else {}
    config = ModelConfig(family=family, vocab_size=64, n_layer=3, n_head=2, n_embd=32, max_seq_len=32, **llama)
    model, plain = build_model(config), build_model(config)
    plain.load_state_dict(model.state_dict())
    for block in model.blocks:
        block.attn.attend = attention.kernel("fa4")  # what a model built for a GPU where FA4 runs holds
    trunk = torch.compile(model.trunk, backend="aot_eager")
    for split in (5, 11):
        positions = torch.cat([torch.arange(split), torch.arange(32 - split)]).expand(2, 32)
        cu = document_offsets(positions)
        torch._dynamo.mark_dynamic(cu, 0)
        ids = torch.randint(0, 64, (2, 32))
        torch.testing.assert_close(trunk(ids, positions, cu), plain.trunk(ids, positions, cu), rtol=1e-4, atol=1e-5)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1


def test_the_fa4_import_is_lazy():
    """Importing the model (and so train.py) never loads the CuTe DSL: it takes seconds."""
    import subprocess
    import sys

    code = ("import sys, model.families, model.kernels.flash4; "
            "print('flash_attn' in sys.modules, 'cutlass' in sys.modules)")
    from tests.helpers import ROOT as root
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
