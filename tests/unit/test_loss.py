"""The LM head + cross-entropy: the chunked loss against the plain one, and which kernel runs.

The optional kernels (liger-kernel, cut-cross-entropy) need CUDA and bf16; tests/gpu/test_gpu.py
compares them with the plain path there. Here the choice runs against fakes of their import, and
the call into Liger runs against a float reference standing in for its autograd function.
"""

from __future__ import annotations

import types

import pytest
import torch

from config import ConfigError, load_config
from model import loss, quack_linear
from model.loss import IGNORE_INDEX, token_loss_sum

CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


def test_chunked_loss_matches_the_plain_loss_and_its_gradients():
    torch.manual_seed(4)
    hidden = torch.randn(2, 37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(53, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 53, (2, 37))
    targets[0, 5:9] = IGNORE_INDEX
    plain = token_loss_sum(hidden, weight, targets)
    plain_grads = torch.autograd.grad(3.0 * plain, (hidden, weight))
    for chunk in (1, 8, 36, 100):  # 100: the whole batch is one chunk
        chunked = token_loss_sum(hidden, weight, targets, chunk_tokens=chunk)
        torch.testing.assert_close(chunked, plain)
        for got, expected in zip(torch.autograd.grad(3.0 * chunked, (hidden, weight)), plain_grads):
            torch.testing.assert_close(got, expected)
    with torch.no_grad():
        torch.testing.assert_close(token_loss_sum(hidden, weight, targets, chunk_tokens=8), plain)


@pytest.fixture
def packages(monkeypatch):
    """Which optional loss packages import: ``state[kernel]`` True or False; imports are counted."""
    state = {"liger": False, "cce": False, "imported": []}

    def import_module(name):
        kernel = next(k for k, (_, module) in loss.PACKAGES.items() if module == name)
        state["imported"].append(kernel)
        if not state[kernel]:
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
        return types.SimpleNamespace()

    monkeypatch.setattr(loss.importlib, "import_module", import_module)
    monkeypatch.setattr(loss, "_modules", {})
    monkeypatch.setattr(loss, "_errors", {})
    return state


def test_cpu_and_non_bf16_runs_take_the_chunked_loss_whatever_is_requested(packages):
    packages.update(liger=True, cce=True)
    for requested in loss.CHOICES:
        assert loss.choose(requested, torch.device("cpu"), torch.bfloat16) == "chunked"
        assert loss.choose(requested, CUDA, torch.float32) == "chunked"
        assert loss.choose(requested, CUDA, torch.float16) == "chunked"
    assert packages["imported"] == []


def test_an_explicit_kernel_runs_where_its_package_imports_and_is_an_error_where_not(packages):
    packages["cce"] = True
    assert loss.choose("cce", CUDA, torch.bfloat16) == "cce"
    with pytest.raises(RuntimeError, match="model.loss_kernel is 'liger' but liger-kernel does not import.*Install liger-kernel"):
        loss.choose("liger", CUDA, torch.bfloat16)
    assert loss.choose("chunked", CUDA, torch.bfloat16) == "chunked"
    assert packages["imported"] == ["cce", "liger"]  # the default never imports a package


def test_the_config_names_the_loss_kernel_choices_and_defaults_to_the_chunked_loss():
    assert load_config("conf/smoke.yaml").model.loss_kernel == "chunked"
    with pytest.raises(ConfigError, match="model.loss_kernel must be one of chunked, liger, cce, not 'quack'"):
        load_config("conf/smoke.yaml", ["model.loss_kernel=quack"])


def test_liger_gets_bf16_operands_the_sum_reduction_and_fp32_accumulation(monkeypatch):
    """The call into Liger's autograd function, with a float reference in its place: its arguments,
    and the gradients reaching the fp32 weight and hidden states through the bf16 casts."""
    calls = []

    class Reference(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w, targets, bias, ce_weight, ignore_index, z_scale, smoothing, reduction, softcap, z_loss,
                    accumulation):
            calls.append((h.dtype, w.dtype, bias, ce_weight, ignore_index, z_scale, smoothing, reduction, softcap,
                          z_loss, accumulation))
            with torch.enable_grad():
                h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
                value = torch.nn.functional.cross_entropy(h32 @ w32.t(), targets, ignore_index=ignore_index, reduction="sum")
                ctx.grads = [g.to(torch.bfloat16) for g in torch.autograd.grad(value, (h32, w32))]
            return value.detach(), None, None, None

        @staticmethod
        def backward(ctx, grad, *unused):
            return ctx.grads[0] * grad, ctx.grads[1] * grad, *([None] * 10)

    monkeypatch.setitem(loss._modules, "liger", types.SimpleNamespace(LigerFusedLinearCrossEntropyFunction=Reference))
    torch.manual_seed(5)
    hidden = torch.randn(24, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (24,))
    targets[3] = IGNORE_INDEX
    fused = token_loss_sum(hidden, weight, targets, chunk_tokens=8, kernel="liger")
    fused_grads = torch.autograd.grad(2.0 * fused, (hidden, weight))
    plain = token_loss_sum(hidden, weight, targets)
    plain_grads = torch.autograd.grad(2.0 * plain, (hidden, weight))
    assert calls == [(torch.bfloat16, torch.bfloat16, None, None, IGNORE_INDEX, 0.0, 0.0, "sum", None, False, torch.float32)]
    torch.testing.assert_close(fused, plain, rtol=2e-2, atol=0.0)
    for got, expected in zip(fused_grads, plain_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=5e-2, atol=5e-2)
    with torch.no_grad():  # validation never calls the package
        torch.testing.assert_close(token_loss_sum(hidden, weight, targets, chunk_tokens=8, kernel="liger"), plain)
    assert len(calls) == 1


def test_the_chunk_function_is_pytorch_when_eager_and_a_triton_kernel_in_compiled_cuda_training(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # a Hopper GPU
    cases = {(False, "triton", CUDA, "torch"): "eager",  # the probe
             (False, "gemm_lse", CUDA, "quack"): "eager",
             (True, "triton", CUDA, "torch"): "triton",
             (True, "triton", cpu, "torch"): "compiled",  # Triton is CUDA's
             (True, "compiled", CUDA, "quack"): "compiled",
             (True, "gemm_lse", CUDA, "quack"): "gemm_lse",
             (True, "gemm_lse", CUDA, "torch"): "triton"}  # the log-sum-exp needs quack's logits
    assert {case: loss.chunk_softmax_ran(*case) for case in cases} == cases
    assert loss.chunk_softmax_ran(True, "gemm_lse", CUDA, "quack", torch.float16) == "triton"  # it rounds to bf16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert loss.chunk_softmax_ran(True, "gemm_lse", CUDA, "quack") == "triton"  # quack passes Blackwell pairs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert loss.chunk_function(True, "gemm_lse", CUDA, "quack") is loss.gemm_lse_chunk_loss_and_grad
    for compiled, softmax, device, linear, expected in [
            (False, "triton", CUDA, "quack", loss.chunk_loss_and_grad),
            (True, "triton", CUDA, "quack", loss.triton_chunk_loss_and_grad),
            (True, "gemm_lse", CUDA, "torch", loss.triton_chunk_loss_and_grad),
            (True, "triton", cpu, "torch", loss.compiled_chunk_loss_and_grad()),
            (True, "compiled", CUDA, "torch", loss.compiled_chunk_loss_and_grad())]:
        chosen = loss.chunk_function(compiled, softmax, device, linear)
        assert chosen.func is loss.product_then_softmax
        assert chosen.args == (quack_linear.PRODUCT[linear], expected), (compiled, softmax, device, linear)


def test_the_config_names_the_softmax_choices_and_defaults_to_gemm_lse():
    assert load_config("conf/smoke.yaml").model.loss_softmax == "gemm_lse"
    with pytest.raises(ConfigError, match="model.loss_softmax must be one of triton, gemm_lse, compiled, not 'cuda'"):
        load_config("conf/smoke.yaml", ["model.loss_softmax=cuda"])


def test_the_log_sum_exp_epilogues_rounding_is_bf16s_round_to_nearest_even():
    """model/quack_lse.py folds each logit as its Veltkamp split rounds it; the store rounds to nearest even. Every
    fp32 value of four whole binades (around 1, negative, the smallest normal, and 2^23-2^24, past any logit) holds
    2^15 ties each; below them (subnormal, under 1.2e-38) the split may miss bf16's grid by less than its spacing,
    2^-133, which changes no exponential."""
    import numpy as np

    from model import quack_lse

    def binades(*starts):
        return torch.from_numpy(np.concatenate([np.arange(start, start + 2**23, dtype=np.uint32) for start in starts])
                                .view(np.float32))

    normal = binades(0x3F800000, 0xC1000000, 0x00800000, 0x4B000000)
    torch.testing.assert_close(quack_lse.rounded_like_the_epilogue(normal), normal.bfloat16().float(), rtol=0, atol=0)
    subnormal = binades(0x00000000)
    assert (quack_lse.rounded_like_the_epilogue(subnormal) - subnormal.bfloat16().float()).abs().max() < 2.0**-133
    assert "mul.rn.f32 c, $1, 0f47800080;" in quack_lse._ROUND_TO_BF16  # 65537.0's bits, in the kernel's split


def test_the_reference_for_quacks_logits_with_their_log_sum_exp_leaves_the_padding_and_rounds_first():
    torch.manual_seed(5)
    rows = torch.randn(6, 16).bfloat16()
    weight = torch.zeros(128, 16, dtype=torch.bfloat16)
    weight[:100] = torch.randn(100, 16)
    logits, tiles = loss.reference_logits_and_tile_log_normalizers(rows, weight, 100, tile_columns=32)
    assert logits.dtype == torch.bfloat16 and bool(logits[:, 100:].isnan().all())  # unwritten, as quack leaves them
    torch.testing.assert_close(logits[:, :100], rows @ weight[:100].t(), rtol=0, atol=0)
    assert tiles.shape == (6, 4) and tiles.dtype == torch.float32  # 32, 32, 32 and the ragged 4 columns
    torch.testing.assert_close(tiles[:, 3], torch.logsumexp(logits[:, 96:100].float(), dim=-1))
    torch.testing.assert_close(torch.logsumexp(tiles, dim=-1), torch.logsumexp(logits[:, :100].float(), dim=-1))


TRITON_INTERPRETED_CHECK = r"""
import torch
from model import loss
from model.loss import IGNORE_INDEX, chunk_loss_and_grad
from model.quack_linear import torch_product
from model.triton_cross_entropy import gradient_in_place, loss_and_gradient_in_place

torch.manual_seed(3)
rows, vocab, padded = 29, 1000, 1024  # several blocks of 256 columns, the last one part padding
logits = 4 * torch.randn(rows, padded)
logits[:, vocab:] = 0  # what the zero padding rows of the head give
targets = torch.randint(0, vocab, (rows,))
targets[::4] = IGNORE_INDEX
targets[1] = vocab - 1  # the last real column, in the block that holds padding
for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
    chunk = logits.to(dtype)
    expected_loss, expected_grad = chunk_loss_and_grad(chunk.clone(), targets, vocab, dtype)
    got_loss = loss_and_gradient_in_place(chunk, targets, vocab, IGNORE_INDEX, block_columns=256, warps=4)
    torch.testing.assert_close(got_loss, expected_loss, rtol=1e-6, atol=1e-4)
    assert chunk.dtype == dtype and (chunk.float() - expected_grad.float()).abs().max() <= tolerance
    assert (chunk[:, vocab:] == 0).all() and (chunk[::4] == 0).all()  # padding and ignored rows: no gradient

# the single pass, given each row's log-sum-exp, and the chunk function around it (quack's GEMM by its reference)
loss.logits_and_tile_log_normalizers = loss.reference_logits_and_tile_log_normalizers
hidden, weight = torch.randn(rows, 16), torch.zeros(padded, 16)
weight[:vocab] = torch.randn(vocab, 16)
for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
    expected_loss, expected_grad = loss.product_then_softmax(torch_product, chunk_loss_and_grad, hidden.to(dtype),
                                                            weight.to(dtype), targets, vocab, dtype)
    got_loss, got_grad = loss.gemm_lse_chunk_loss_and_grad(hidden.to(dtype), weight.to(dtype), targets, vocab, dtype)
    torch.testing.assert_close(got_loss, expected_loss, rtol=1e-6, atol=1e-4)
    assert got_grad.dtype == dtype and (got_grad.float() - expected_grad.float()).abs().max() <= tolerance
    assert (got_grad[:, vocab:] == 0).all() and (got_grad[::4] == 0).all()  # NaN past vocab never read

# the kernel folds each row's tile values as the whole row's log-sum-exp: given by tiles or whole, the same
logits, tiles = loss.reference_logits_and_tile_log_normalizers(hidden.bfloat16(), weight.bfloat16(), vocab)
assert tiles.shape == (rows, 6)  # 5 x 192 + 40 columns
by_tiles, whole = logits.clone(), logits.clone()
loss_by_tiles = gradient_in_place(by_tiles, tiles, targets, vocab, IGNORE_INDEX, block_columns=256)
loss_whole = gradient_in_place(whole, torch.logsumexp(tiles, dim=-1), targets, vocab, IGNORE_INDEX, block_columns=256)
torch.testing.assert_close(loss_by_tiles, loss_whole, rtol=1e-6, atol=1e-4)
assert (by_tiles.float() - whole.float()).abs().max() <= 8e-3 and (by_tiles[:, vocab:] == 0).all()
print("same")
"""


def test_the_triton_chunk_kernels_match_the_pytorch_chunk_function_in_tritons_interpreter():
    """The two kernels' arithmetic on the CPU, through Triton's interpreter (where Triton is installed;
    tests/gpu runs it compiled on a GPU)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (it comes with CUDA builds of PyTorch)")
    env = os.environ | {"TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_INTERPRETED_CHECK], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-2000:]
