"""qkv's forward product and the head's logits through quack's GEMM (``model.linear_kernel``).

quack needs a Hopper or Blackwell GPU; tests/gpu compares the compiled model with the plain path there. Here the
model's routing runs against a recording stand-in for quack's product, and the autograd function around it against
a reference for quack's GEMM.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from config import ConfigError, load_config
from model import fused_mlp, loss, quack_linear
from model.gpt import GPT, GPTConfig

CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


def test_the_config_names_the_choices_and_quack_where_it_cannot_run_is_an_error_naming_the_setting(monkeypatch):
    assert load_config("conf/smoke.yaml").model.linear_kernel == "auto"
    with pytest.raises(ConfigError, match="model.linear_kernel must be one of auto, quack, torch, not 'cublas'"):
        load_config("conf/smoke.yaml", ["model.linear_kernel=cublas"])
    with pytest.raises(RuntimeError, match="model.linear_kernel is 'quack' but quack's GEMMs cannot run: it needs a "
                                           "CUDA device, not cpu"):
        quack_linear.choose("quack", torch.device("cpu"), torch.bfloat16, True, 768)
    assert quack_linear.choose("auto", torch.device("cpu"), torch.bfloat16, True, 768) == "torch"
    monkeypatch.setattr(fused_mlp, "quack_unavailable_reason", lambda device, dtype, width: None)
    assert quack_linear.choose("auto", CUDA, torch.bfloat16, True, 768) == "quack"
    assert quack_linear.choose("auto", CUDA, torch.bfloat16, False, 768) == "torch"  # the probe, evaluation
    assert quack_linear.choose("torch", CUDA, torch.bfloat16, True, 768) == "torch"


def test_compiled_training_routes_qkv_and_every_chunk_of_logits_through_quack_and_evaluation_does_not(monkeypatch):
    calls = []

    def recording(rows, weight):
        calls.append((tuple(rows.shape), tuple(weight.shape)))
        return quack_linear.torch_product(rows, weight)

    monkeypatch.setattr(fused_mlp, "quack_unavailable_reason", lambda device, dtype, width: None)
    monkeypatch.setitem(quack_linear.PRODUCT, "quack", recording)
    monkeypatch.setattr(GPT, "compute_dtype", lambda self, device: torch.bfloat16)  # as under CUDA autocast
    monkeypatch.setattr(loss, "compiled_chunk_loss_and_grad", lambda: loss.chunk_loss_and_grad)  # CPU: not compiled
    torch.manual_seed(0)
    shape = dict(vocab_size=64, n_layer=3, n_head=2, n_embd=16, max_seq_len=8, residual_in_fp32=True,
                 loss_chunk_tokens=6, mlp_kernel="torch")
    model = GPT(GPTConfig(**shape))
    plain = GPT(GPTConfig(**shape, linear_kernel="torch"))
    plain.load_state_dict(model.state_dict())
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "targets": torch.randint(0, 64, (2, 8))}
    results = []
    for m in (model, plain):
        m._compiled_trunk = m._trunk  # compiled training's route, without compiling (the GPU tests compile)
        total = m.loss_sum(batch)
        results.append((total, *torch.autograd.grad(total, list(m.parameters()))))
    qkv, logits = ((16, 16), (48, 16)), ((6, 16), (128, 16))  # the head's weight padded to 128 rows
    assert calls == [qkv] * 3 + [logits, logits, ((4, 16), (128, 16))], calls
    assert model.linear_kernel == "quack" and plain.linear_kernel == "torch"
    for got, expected in zip(*results):  # the stand-in computes what cuBLAS does: the same loss and gradients
        torch.testing.assert_close(got, expected)
    model.eval()
    with torch.no_grad():
        model.loss_sum(batch)
    assert len(calls) == 6 and model.linear_kernel == "quack"  # evaluation took cuBLAS; the record keeps training's


def test_quacks_product_is_its_gemm_on_the_transposed_weight_at_the_default_tile(monkeypatch):
    seen = {}

    def gemm(a, b, tuned):
        seen.update(b_shape=tuple(b.shape), tuned=tuned)
        return a @ b

    fake = types.ModuleType("quack.gemm_interface")
    fake.gemm = gemm
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", fake)
    rows, weight = torch.randn(5, 8), torch.randn(24, 8)
    torch.testing.assert_close(quack_linear.quack_product(rows, weight), rows @ weight.t())
    assert seen == {"b_shape": (8, 24), "tuned": False}


@pytest.mark.parametrize("compiled", [False, True])
def test_the_quack_linear_gives_pytorchs_output_and_gradients_with_a_reference_for_quacks_product(monkeypatch,
                                                                                                  compiled):
    """quack's product replaced by what it computes (fp64 on the CPU): the autograd function around it, which saves
    the operands and runs the backward's products, must give F.linear's output and both gradients, also traced by
    torch.compile without a graph break."""
    monkeypatch.setitem(quack_linear.PRODUCT, "quack", lambda rows, weight: rows @ weight.t())
    torch.manual_seed(5)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, 8, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 5, 24, dtype=torch.float64)
    quack = lambda x, w: quack_linear.linear(x, w, "quack")  # noqa: E731
    results = []
    for fn in (torch.compile(quack, backend="aot_eager", fullgraph=True) if compiled else quack,
               torch.nn.functional.linear):
        out = fn(x, weight)
        results.append((out, *torch.autograd.grad(out, (x, weight), dout)))
    for got, expected in zip(*results):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected)
