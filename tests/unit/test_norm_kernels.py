"""LayerNorm kernel selection, the fused add + LayerNorm custom ops, and the FP8 option's refusal, on CPU.

quack needs a Hopper or Blackwell GPU (tests/gpu/test_gpu.py runs it there). Here the selection runs
against fakes of the import and the GPU, and the custom ops run with a float32 reference behind them:
that checks their fake (shape) functions, their autograd formula and that torch.compile traces them
without a graph break, on any machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import norm_kernels
from config import ConfigError, load_config
from model.gpt import GPT, GPTConfig

from tests.helpers import fake_kernel_gpu

CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of the given compute capability and a quack that imports (or not)."""
    return fake_kernel_gpu(monkeypatch, norm_kernels, "quack_module", "_quack_error",
                           "quack does not import (ModuleNotFoundError)")


def test_quack_runs_on_hopper_and_blackwell_with_bf16_only_when_asked(fake_gpu):
    assert norm_kernels.choose("quack", CUDA, torch.bfloat16) == "quack"
    fake_gpu["capability"] = (10, 0)
    assert norm_kernels.choose("quack", CUDA, torch.bfloat16) == "quack"
    assert norm_kernels.choose("torch", CUDA, torch.bfloat16) == "torch"  # the default: measured faster
    assert GPTConfig().norm_kernel == "torch"


@pytest.mark.parametrize("capability, imports", [((8, 0), True), ((9, 0), False)])
def test_quack_where_it_cannot_run_is_an_error_that_says_why(fake_gpu, capability, imports):
    fake_gpu.update(capability=capability, imports=imports)
    with pytest.raises(RuntimeError, match="quack's LayerNorm cannot run"):
        norm_kernels.choose("quack", CUDA, torch.bfloat16)


def test_cpu_fp32_fp16_and_torch_never_import_quack(fake_gpu):
    """An explicit "quack" on the CPU (evaluation, smoke runs of a GPU config) takes PyTorch's LayerNorm."""
    for requested in ("torch", "quack"):
        assert norm_kernels.choose(requested, torch.device("cpu"), torch.float32) == "torch"
        assert norm_kernels.choose(requested, torch.device("cpu"), torch.bfloat16) == "torch"
        assert norm_kernels.choose(requested, CUDA, torch.float32) == "torch"
        assert norm_kernels.choose(requested, CUDA, torch.float16) == "torch"
    assert norm_kernels.choose("torch", CUDA, torch.bfloat16) == "torch"
    assert fake_gpu["imported"] == 0


def test_the_config_names_the_norm_kernel_choices():
    with pytest.raises(ConfigError, match="model.norm_kernel must be one of torch, quack"):
        load_config("conf/smoke.yaml", ["model.norm_kernel=apex"])


def test_the_model_records_the_layer_norm_it_ran():
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, max_seq_len=32))
    with torch.no_grad():
        model.hidden_states(torch.randint(0, 64, (2, 32)))
    assert model.norm_kernel_used == norm_kernels.describe("torch")
    assert norm_kernels.describe("quack").startswith("quack fused residual-add + LayerNorm")


# ----------------------------------------------------------------------------- the custom ops


def reference_forward(delta, residual, weight, bias, eps, out_dtype):
    """The forward op's contract in float32."""
    summed = delta.float() + residual.float()
    out = F.layer_norm(summed, weight.shape, weight.float(), bias.float(), eps)
    mean = summed.mean(-1)
    rstd = torch.rsqrt(summed.var(-1, unbiased=False) + eps)
    return out.to(out_dtype), summed.to(residual.dtype), mean, rstd


def reference_backward(grad_out, grad_sum, summed, weight, mean, rstd, delta_dtype):
    """LayerNorm's input gradient written out (not autograd), plus the stream's incoming gradient."""
    x_hat = (summed.float() - mean[:, None]) * rstd[:, None]
    g = grad_out.float()
    wdy = g * weight.float()
    dx = (wdy - wdy.mean(-1, keepdim=True) - x_hat * (x_hat * wdy).mean(-1, keepdim=True)) * rstd[:, None]
    if grad_sum is not None:
        dx = dx + grad_sum.float()
    grad_residual = dx.to(summed.dtype) if delta_dtype != summed.dtype else summed.new_empty(0)
    return dx.to(delta_dtype), grad_residual, (g * x_hat).sum(0).to(weight.dtype), g.sum(0).to(weight.dtype)


@pytest.fixture
def reference_ops(monkeypatch):
    monkeypatch.setitem(norm_kernels.IMPLEMENTATION, "forward", reference_forward)
    monkeypatch.setitem(norm_kernels.IMPLEMENTATION, "backward", reference_backward)


@pytest.mark.parametrize("delta_dtype", [torch.float32, torch.bfloat16])
def test_the_ops_autograd_matches_torch_add_and_layer_norm(reference_ops, delta_dtype):
    """Forward, the sum, and gradients of both inputs, weight and bias, with a gradient arriving
    through both outputs (the normalized one and the stream)."""
    torch.manual_seed(0)
    delta = torch.randn(6, 5, 32).to(delta_dtype).requires_grad_()
    residual = torch.randn(6, 5, 32, requires_grad=True)
    norm = torch.nn.LayerNorm(32)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    g_out, g_sum = torch.randn(6, 5, 32), torch.randn(6, 5, 32)
    results = []
    for path in ("ops", "torch"):
        for t in (delta, residual, norm.weight, norm.bias):
            t.grad = None
        if path == "ops":
            out, summed = norm_kernels.add_layer_norm(delta, residual, norm.weight, norm.bias, norm.eps)
        else:
            summed = residual + delta
            out = norm(summed)
        ((out.float() * g_out).sum() + (summed * g_sum).sum()).backward()
        results.append([out.detach().float(), summed.detach(),
                        *(t.grad.float() for t in (delta, residual, norm.weight, norm.bias))])
    assert delta.grad.dtype == delta_dtype and residual.grad.dtype == torch.float32
    for name, got, expected in zip(("out", "sum", "delta", "residual", "weight", "bias"), *results):
        tolerance = 1e-2 if delta_dtype == torch.bfloat16 and name == "delta" else 1e-4
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance, msg=name)


def test_the_quack_path_trains_like_the_torch_path_and_compiles_without_a_graph_break(reference_ops, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(norm_kernels, "choose", lambda requested, device, dtype: requested)
    config = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=32, max_seq_len=32, loss_chunk_tokens=0)
    torch.manual_seed(0)
    fused, plain = GPT(GPTConfig(**config, norm_kernel="quack")), GPT(GPTConfig(**config, norm_kernel="torch"))
    plain.load_state_dict(fused.state_dict())
    assert list(fused.state_dict()) == list(plain.state_dict())  # same weights, same names: export unchanged
    ids = torch.randint(0, 64, (2, 32))
    batch = {"input_ids": ids, "positions": torch.arange(32).expand(2, 32), "targets": torch.roll(ids, -1, 1)}
    torch._dynamo.reset()
    counters.clear()
    fused.compile_trunk()
    losses = []
    for model in (fused, plain):
        loss = model.loss_sum(batch)
        loss.backward()
        losses.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(losses[0][0], losses[1][0], rtol=1e-5, atol=1e-4)
    for name, expected in losses[1][1].items():
        torch.testing.assert_close(losses[0][1][name], expected, rtol=1e-4, atol=1e-5, msg=name)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert fused.norm_kernel_used.startswith("quack")


# ----------------------------------------------------------------------------- FP8


def test_fp8_is_refused_without_a_cuda_gpu():
    from runtime import device_policy

    cfg = load_config("conf/smoke.yaml", ["model.fp8=true"])
    with pytest.raises(ConfigError, match="model.fp8 is true but it needs a CUDA GPU"):
        device_policy.build_module(cfg, None)
