"""model/kernels/quack_gelu.py's GELU formula, in PyTorch's arithmetic (the kernels' own run in tests/gpu)."""

import math
import sys
import types

import pytest
import torch

from model.kernels import quack_gelu


def exact_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.special.erfc(-x.double() / math.sqrt(2.0))


def test_the_cdf_and_density_are_within_fp32_reach_of_fp64_everywhere():
    """A wrong coefficient, sign or folded constant moves these by far more than 4e-7."""
    x = torch.linspace(-12, 12, 480_001)
    cdf, density = quack_gelu.cdf_and_density(x)
    assert (cdf.double() - exact_cdf(x)).abs().max() < 4e-7
    assert (density.double() - torch.exp(-x.double() ** 2 / 2) / math.sqrt(2 * math.pi)).abs().max() < 1e-7
    gradient = cdf + x * density  # gelu'(x), as the dact epilogue forms it
    reference = torch.ops.aten.gelu_backward(torch.ones_like(x, dtype=torch.float64), x.double())
    assert (gradient.double() - reference).abs().max() < 5e-7


def test_negative_inputs_keep_their_relative_precision_to_minus_six():
    x = torch.linspace(-6, -0.01, 60_000)
    cdf, _ = quack_gelu.cdf_and_density(x)
    relative = (cdf.double() - exact_cdf(x)).abs() / exact_cdf(x)
    assert relative.max() < 8e-3  # under a bf16 step: the tail is not 1 - Phi(|x|)


def test_in_bf16_the_gelu_rounds_as_the_exact_one_at_least_as_often_as_pytorchs():
    x = (2.0 * torch.randn(1_000_000, generator=torch.Generator().manual_seed(3))).bfloat16().float()
    exact = (x.double() * exact_cdf(x)).bfloat16()
    ours = (x * quack_gelu.cdf_and_density(x)[0]).bfloat16()
    pytorch = torch.nn.functional.gelu(x).bfloat16()
    ours_share, pytorch_share = (ours == exact).float().mean(), (pytorch == exact).float().mean()
    assert ours_share >= pytorch_share and ours_share > 0.99


def test_register_puts_the_gelu_and_its_derivative_in_quacks_two_tables(monkeypatch):
    tables = types.SimpleNamespace(act_fn_map={"gelu_erf": "quack's"}, dact_fn_map={"gelu_erf": "quack's"})
    monkeypatch.setitem(sys.modules, "quack", types.SimpleNamespace(activation=tables))
    monkeypatch.setattr(quack_gelu, "cute", object())
    monkeypatch.setattr(quack_gelu, "gelu", "forward", raising=False)
    monkeypatch.setattr(quack_gelu, "dgelu", "derivative", raising=False)
    quack_gelu.register("mine")
    assert tables.act_fn_map == {"gelu_erf": "quack's", "mine": "forward"}
    assert tables.dact_fn_map == {"gelu_erf": "quack's", "mine": "derivative"}


def test_register_without_the_cute_dsl_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(quack_gelu, "cute", None)
    with pytest.raises(RuntimeError, match="nvidia-cutlass-dsl"):
        quack_gelu.register("mine")
