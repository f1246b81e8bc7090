"""Which MLP kernel runs (``compute.mlp``), and that the model routes through it.

quack's GEMMs need a Hopper or Blackwell GPU; tests/gpu compares them with the plain path there.
Here the choice runs against fakes of its availability, the model's route against recording
stand-ins for quack's MLP functions, and those functions against references for quack's GEMMs.
"""

from __future__ import annotations

import functools

import pytest
import torch

from config import ConfigError, load_config
from model import kernels
from model.kernels import fused_mlp
from model.decoder import ModelConfig
from model.gpt import GPT
from model.kernels import ComputeConfig, Target

CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


HOPPER, BLACKWELL = (9, 0), (10, 0)


@pytest.fixture
def quack_runs_here(monkeypatch):
    monkeypatch.setattr(fused_mlp, "quack_imports", lambda: None)  # quack installed


def mlp_kernels(requested: str, device, dtype, compiled: bool, width: int = 768, n_layer: int = 2,
                capability=HOPPER):
    """The MLP kernels of a model built for ``device``; a CUDA device is a GPU of ``capability``."""
    compute = ComputeConfig(mlp=requested, mlp_kept_derivatives=0)  # kept derivatives: their own test
    target = Target(device, dtype, compiled, capability if device.type == "cuda" else None)
    return kernels.mlp_kernels(compute, target, n_layer, width)


def test_eager_runs_and_the_torch_setting_take_pytorch_whatever_is_installed(quack_runs_here):
    for requested in kernels.MLP_CHOICES:
        assert mlp_kernels(requested, CUDA, torch.bfloat16, False) == ("torch", "torch")  # the probe, evaluation
    assert mlp_kernels("torch", CUDA, torch.bfloat16, True) == ("torch", "torch")
    assert mlp_kernels("auto", CUDA, torch.bfloat16, True) == ("quack", "quack")
    assert mlp_kernels("quack", CUDA, torch.bfloat16, True) == ("quack", "quack")


def test_auto_falls_back_to_pytorch_and_quack_is_an_error_where_it_cannot_run(monkeypatch):
    assert mlp_kernels("auto", torch.device("cpu"), torch.float32, True) == ("torch", "torch")
    with pytest.raises(RuntimeError, match="compute.mlp is 'quack' but it cannot run: it needs a CUDA device"):
        mlp_kernels("quack", torch.device("cpu"), torch.bfloat16, True)
    assert "compute capability 8.0" in fused_mlp.quack_unavailable_reason((8, 0), torch.bfloat16, 768)
    assert mlp_kernels("auto", CUDA, torch.bfloat16, True, capability=(8, 0)) == ("torch", "torch")
    assert "bf16 or fp16, not torch.float32" in fused_mlp.quack_unavailable_reason(HOPPER, torch.float32, 768)
    assert "width 100 is not a multiple of 8" in fused_mlp.quack_unavailable_reason(HOPPER, torch.bfloat16, 100)
    monkeypatch.setattr(fused_mlp, "quack_imports", lambda: "quack.gemm_interface does not import (ModuleNotFoundError: x)")
    assert fused_mlp.quack_unavailable_reason(HOPPER, torch.bfloat16, 768) == \
        "quack.gemm_interface does not import (ModuleNotFoundError: x)"
    assert mlp_kernels("auto", CUDA, torch.bfloat16, True) == ("torch", "torch")


def test_a_cute_dsl_outside_site_packages_is_named_as_the_reason_quack_cannot_run():
    assert fused_mlp.dsl_location_problem("/venv/lib/python3.12/site-packages/cutlass/__init__.py") is None
    assert fused_mlp.dsl_location_problem("/usr/lib/python3/dist-packages/cutlass/__init__.py") is None
    problem = fused_mlp.dsl_location_problem("/tmp/fa4site/cutlass/__init__.py")
    assert "outside a site-packages folder (/tmp/fa4site/cutlass)" in problem and "--target folder named" in problem


def test_the_config_names_the_mlp_choices():
    assert load_config("conf/smoke.yaml").compute.mlp in kernels.MLP_CHOICES
    with pytest.raises(ConfigError, match="compute.mlp must be one of auto, quack, torch, not 'cutlass'"):
        load_config("conf/smoke.yaml", ["compute.mlp=cutlass"])


@pytest.fixture
def compiled_on_the_cpu(monkeypatch):
    """torch.compile through dynamo and AOTAutograd without inductor's code generation (seconds on a CPU)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()


# What compiled CUDA training in bf16 builds its model for, on a GPU of the given compute capability, with the
# kernels' CPU stand-ins (quack_runs_here, recording_mlps)
def compiled_bf16(capability: tuple[int, int] = BLACKWELL) -> Target:
    return Target(torch.device("cpu"), torch.bfloat16, compiled=True, capability=capability)


def recording_mlps(monkeypatch, calls: list) -> None:
    """quack's two MLP functions replaced by PyTorch's MLP, each noting its calls (dynamo replays the appends)."""
    for name in ("quack_mlp", "quack_kept_derivative_mlp"):
        def mlp(x, fc_weight, proj_weight, name=name):
            calls.append(name)
            return fused_mlp.torch_mlp(x, fc_weight, proj_weight)
        monkeypatch.setattr(fused_mlp, name, mlp)


def compiled_pair(kept: int, capability: tuple[int, int] = BLACKWELL) -> tuple[GPT, GPT]:
    """A model built for compiled bf16 training and a plain one with the same weights, both run in fp32 here."""
    torch.manual_seed(0)
    shape = ModelConfig(vocab_size=64, n_layer=3, n_head=2, n_embd=16, max_seq_len=8)
    model = GPT(shape, ComputeConfig(mlp_kept_derivatives=kept), compiled_bf16(capability))
    plain = GPT(shape, ComputeConfig(mlp="torch"), compiled_bf16(capability))
    plain.load_state_dict(model.state_dict())
    return model.train(), plain.train()


def test_compiled_training_routes_every_block_through_the_chosen_kernel_and_records_it(quack_runs_here,
                                                                                       compiled_on_the_cpu, monkeypatch):
    calls = []
    recording_mlps(monkeypatch, calls)
    model, plain = compiled_pair(kept=6)  # no block keeps the derivative: that needs Hopper
    ids = torch.randint(0, 64, (2, 8))
    hidden = model.hidden_states(ids)
    assert calls == ["quack_mlp"] * 3 and model.kernels_used()["mlp"]["ran"] == "quack"
    torch.testing.assert_close(hidden, plain.hidden_states(ids))  # the stand-in is PyTorch's MLP: the same function
    assert plain.kernels_used()["mlp"]["ran"] == "torch" and len(calls) == 3
    model.eval()
    with torch.no_grad():
        model.hidden_states(ids)  # evaluation is eager, with the kernels the model was built with
    assert calls == ["quack_mlp"] * 6 and model.kernels_used()["mlp"]["ran"] == "quack"


@pytest.mark.parametrize("compiled", [False, True])
def test_the_epilogue_mlp_gives_pytorchs_output_and_gradients_with_a_reference_for_quacks_gemms(monkeypatch, compiled):
    """quack's two fused products replaced by what they compute (fp64 on the CPU): the autograd function around
    them, which saves, casts and multiplies the rest, must give the plain MLP's output and all three gradients,
    also traced by torch.compile, where the backward's product is a custom op seen through its shape function."""
    import sys
    import types

    def gemm_act(a, b, activation):
        assert activation == fused_mlp.ACTIVATION
        preact = a @ b
        return preact, torch.nn.functional.gelu(preact)

    def gemm_dact(a, b, preact, activation):
        assert activation == fused_mlp.ACTIVATION
        return torch.ops.aten.gelu_backward(a @ b, preact), torch.nn.functional.gelu(preact)

    fake = types.ModuleType("quack.gemm_interface")
    fake.gemm_act = lambda a, b, activation, tuned: gemm_act(a, b, activation)
    fake.gemm_dact = lambda a, b, preact, activation, tuned, config: gemm_dact(a, b, preact, activation)
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", fake)
    assert_gives_pytorchs_mlp(fused_mlp.quack_mlp, compiled, seed=4)


def assert_gives_pytorchs_mlp(implementation, compiled: bool, seed: int) -> None:
    """``implementation``'s output and its gradients for x and both weights are the plain MLP's, in fp64, eager or
    traced by torch.compile (aot_eager, one graph)."""
    torch.manual_seed(seed)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    fc = torch.randn(32, 8, dtype=torch.float64, requires_grad=True)
    proj = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 5, 8, dtype=torch.float64)
    results = []
    fast = torch.compile(implementation, backend="aot_eager", fullgraph=True) if compiled else implementation
    for fn in (fast, fused_mlp.torch_mlp):
        out = fn(x, fc, proj)
        results.append((out, *torch.autograd.grad(out, (x, fc, proj), dout)))
    for got, expected in zip(*results):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected)


@pytest.fixture
def fake_gemm_config(monkeypatch):
    """quack.gemm_config with a GemmConfig that records its arguments; the pinned configs made from it are dropped
    after the test."""
    import sys
    import types

    fake = types.ModuleType("quack.gemm_config")
    fake.GemmConfig = types.SimpleNamespace
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_config", fake)
    fused_mlp.pinned_dact_config.cache_clear()
    yield
    fused_mlp.pinned_dact_config.cache_clear()


def test_the_backward_product_pins_its_tile_on_hopper_only(fake_gemm_config):
    """The 128 x 128 tile is Hopper's (compute capability 9); Blackwell (10) and the CPU keep quack's own default
    (None). Every call gets the same config object: quack keys its cached launch by the pinned config's identity."""
    assert fused_mlp.dact_config(torch.device("cpu")) is None
    assert fused_mlp.pinned_dact_config(10) is None
    config = fused_mlp.pinned_dact_config(9)
    assert (config.tile_m, config.tile_n, config.pingpong, config.device_capacity) == (128, 128, True, 9)
    assert fused_mlp.pinned_dact_config(9) is config


@pytest.fixture
def reference_kept_derivative_gemms(monkeypatch):
    """model.kernels.quack_gelu's two epilogue GEMMs for blocks that keep the GELU's derivative, replaced by what they
    compute, in the operands' dtype: fc's product with the activation and gelu' as outputs, and proj's
    input-gradient product scaled by the kept gelu'. Records each call's operand dtypes."""
    from model.kernels import quack_gelu

    calls = []

    def keeping(a, b, out, tuned):
        preact = a @ b
        out["derivative"].copy_(torch.ops.aten.gelu_backward(torch.ones_like(preact), preact))
        calls.append(("forward", out["derivative"].dtype))
        return {"D": torch.nn.functional.gelu(preact), "derivative": out["derivative"]}

    def scaling(a, b, C, tuned):
        calls.append(("backward", C.dtype))
        return {"D": (a @ b) * C}

    monkeypatch.setattr(quack_gelu, "gelu_keeping_derivative", keeping, raising=False)
    monkeypatch.setattr(quack_gelu, "times_derivative", scaling, raising=False)
    return calls


@pytest.mark.parametrize("compiled", [False, True])
def test_the_mlp_keeping_the_gelu_derivative_gives_pytorchs_output_and_gradients(reference_kept_derivative_gemms,
                                                                                 compiled):
    """The autograd function around the two GEMMs (saving the activation and the derivative in place of the
    pre-activation, the backward product scaling by it) gives the plain MLP's output and all three gradients in
    fp64, also traced by torch.compile, where the products are custom ops seen through their shape functions."""
    assert_gives_pytorchs_mlp(fused_mlp.quack_kept_derivative_mlp, compiled, seed=5)
    assert reference_kept_derivative_gemms == [("forward", torch.float64), ("backward", torch.float64)]


def test_under_bf16_the_derivative_is_kept_in_fp16():
    """fp16's 3 more mantissa bits: the derivative's own rounding 8x below the gradient's; other dtypes keep theirs."""
    assert fused_mlp.derivative_dtype(torch.bfloat16) == torch.float16
    assert fused_mlp.derivative_dtype(torch.float16) == torch.float16
    assert fused_mlp.derivative_dtype(torch.float64) == torch.float64


def test_the_last_blocks_keep_the_derivative_with_quacks_mlp_on_hopper_only(monkeypatch):
    from model.kernels import quack_gelu

    kept = fused_mlp.KEPT_DERIVATIVE
    assert not hasattr(quack_gelu, "times_derivative")  # quack's frontend did not build the epilogues here
    assert not fused_mlp.block_kernels("quack", 3, 2, HOPPER).count(kept)
    monkeypatch.setattr(quack_gelu, "times_derivative", object(), raising=False)  # as where quack's frontend built it
    assert fused_mlp.block_kernels("quack", 4, 2, HOPPER) == ("quack", "quack", kept, kept)
    assert fused_mlp.block_kernels("quack", 3, 6, HOPPER) == (kept,) * 3  # at most every block
    assert fused_mlp.block_kernels("quack", 3, 0, HOPPER) == ("quack",) * 3
    assert fused_mlp.block_kernels("torch", 3, 2, HOPPER) == ("torch",) * 3
    assert fused_mlp.block_kernels("quack", 3, 2, BLACKWELL) == ("quack",) * 3  # Blackwell's epilogues take pairs
    assert not fused_mlp.kept_derivative_runs(None)  # no CUDA device


def test_compiled_training_routes_the_last_blocks_through_the_kept_derivative_mlp_and_records_it(quack_runs_here,
                                                                                                  compiled_on_the_cpu,
                                                                                                  monkeypatch):
    calls = []
    recording_mlps(monkeypatch, calls)
    from model.kernels import quack_gelu

    monkeypatch.setattr(quack_gelu, "times_derivative", object(), raising=False)  # as where quack's frontend built it
    model, plain = compiled_pair(kept=2, capability=HOPPER)
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model.hidden_states(ids), plain.hidden_states(ids))
    assert calls == ["quack_mlp", "quack_kept_derivative_mlp", "quack_kept_derivative_mlp"]
    assert model.kernels_used()["mlp"] == {"requested": "auto", "ran": "quack", "blocks_keeping_the_gelu_derivative": 2}
    assert plain.kernels_used()["mlp"] == {"requested": "torch", "ran": "torch", "blocks_keeping_the_gelu_derivative": 0}


def test_a_negative_count_of_kept_derivatives_is_refused():
    with pytest.raises(ConfigError, match="compute.mlp_kept_derivatives must be >= 0, not -1"):
        load_config("conf/smoke.yaml", ["compute.mlp_kept_derivatives=-1"])


def test_the_record_calls_the_mlp_quacks_where_every_block_keeps_the_derivative():
    every_block = kernels.Kernels(attention="sdpa", mlp=(fused_mlp.KEPT_DERIVATIVE,) * 2, loss="eager")
    assert every_block.described(ComputeConfig())["mlp"] == {"requested": "auto", "ran": "quack",
                                                             "blocks_keeping_the_gelu_derivative": 2}
    plain = kernels.Kernels(attention="sdpa", mlp=("torch",) * 2, loss="eager")
    assert plain.described(ComputeConfig())["mlp"]["ran"] == "torch"
