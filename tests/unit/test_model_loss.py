"""The LM head + cross-entropy: the chunked loss against the plain one, and which chunk kernel runs.

The Triton and quack chunk kernels need CUDA; tests/gpu/test_gpu.py compares them with the plain
path there. Here the choice runs for GPUs a Target describes, against a fake of quack's availability, and the
kernels' arithmetic through Triton's interpreter where Triton is installed.
"""

from __future__ import annotations

import pytest
import torch

from config import ConfigError, load_config
from model import kernels, loss
from model.kernels import ComputeConfig, Target, fused_mlp
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


def loss_kernel(requested: str, device, compiled: bool = True, dtype=torch.bfloat16, capability=(9, 0)) -> str:
    """The loss kernel of a model built for ``device``; a CUDA device is a GPU of ``capability`` (Hopper's)."""
    target = Target(device, dtype, compiled, capability if device.type == "cuda" else None)
    return kernels.loss_kernel(ComputeConfig(loss=requested), target, 768)


def test_eager_runs_and_the_cpu_take_pytorch_and_compiled_cuda_training_a_triton_kernel(monkeypatch):
    monkeypatch.setattr(fused_mlp, "quack_imports", lambda: None)  # quack installed
    for requested in kernels.LOSS_CHOICES:
        assert loss_kernel(requested, CUDA, compiled=False) == "eager"  # the probe, evaluation
        assert loss_kernel(requested, torch.device("cpu")) == "eager"  # Triton is CUDA's
    assert loss_kernel("auto", CUDA) == loss_kernel("quack", CUDA) == "quack"
    assert loss_kernel("triton", CUDA) == "triton"
    assert loss_kernel("auto", CUDA, dtype=torch.float16) == "triton"  # the epilogue rounds the logits to bf16
    assert loss_kernel("auto", CUDA, capability=(10, 0)) == "triton"  # quack passes Blackwell's epilogues pairs
    with pytest.raises(RuntimeError, match="compute.loss is 'quack' but it cannot run: its epilogue takes the single "
                                           "values Hopper's GEMMs pass"):
        loss_kernel("quack", CUDA, capability=(10, 0))


def test_without_quack_auto_takes_the_two_pass_kernel_and_quack_by_name_is_an_error(monkeypatch):
    monkeypatch.setattr(fused_mlp, "quack_imports", lambda: "quack does not import")
    assert loss_kernel("auto", CUDA) == "triton"
    with pytest.raises(RuntimeError, match="compute.loss is 'quack' but it cannot run: quack does not import"):
        loss_kernel("quack", CUDA)


def test_each_kernel_names_its_chunk_function():
    assert loss.chunk_function("quack") is loss.quack_chunk_loss_and_grad
    for kernel, softmax in (("eager", loss.chunk_loss_and_grad), ("triton", loss.triton_chunk_loss_and_grad)):
        chosen = loss.chunk_function(kernel)
        assert chosen.func is loss.product_then_softmax and chosen.args == (softmax,)


def test_the_config_names_the_loss_choices_and_defaults_to_auto():
    assert load_config("conf/smoke.yaml").compute.loss == "auto"
    with pytest.raises(ConfigError, match="compute.loss must be one of auto, quack, triton, not 'cuda'"):
        load_config("conf/smoke.yaml", ["compute.loss=cuda"])


def test_the_models_loss_takes_its_chunks_and_its_kernel_from_the_compute_section():
    from model.decoder import ModelConfig
    from model.gpt import GPT

    torch.manual_seed(2)
    shape = ModelConfig(vocab_size=53, n_layer=1, n_head=2, n_embd=16, max_seq_len=16)
    chunked, plain = GPT(shape, ComputeConfig(loss_chunk_tokens=5)), GPT(shape, ComputeConfig(loss_chunk_tokens=0))
    plain.load_state_dict(chunked.state_dict())
    batch = {"input_ids": torch.randint(0, 53, (2, 16)), "targets": torch.randint(0, 53, (2, 16))}
    results = []
    for model in (chunked, plain):
        value = model.loss_sum(batch)
        results.append((value, *torch.autograd.grad(value, (model.wte.weight, model.blocks[0].mlp.fc.weight))))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)
    assert chunked.kernels_used()["loss"] == {"requested": "auto", "ran": "eager"}


def test_the_log_sum_exp_epilogues_rounding_is_bf16s_round_to_nearest_even():
    """model/kernels/quack_lse.py folds each logit as its Veltkamp split rounds it; the store rounds to nearest even.
    Every fp32 value of four whole binades (around 1, negative, the smallest normal, and 2^23-2^24, past any logit)
    holds 2^15 ties each; below them (subnormal, under 1.2e-38) the split may miss bf16's grid by less than its spacing,
    2^-133, which changes no exponential."""
    import numpy as np

    from model.kernels import quack_lse

    def binades(*starts):
        return torch.from_numpy(np.concatenate([np.arange(start, start + 2**23, dtype=np.uint32) for start in starts])
                                .view(np.float32))

    normal = binades(0x3F800000, 0xC1000000, 0x00800000, 0x4B000000)
    torch.testing.assert_close(quack_lse.rounded_like_the_epilogue(normal), normal.bfloat16().float(), rtol=0, atol=0)
    subnormal = binades(0x00000000)
    assert (quack_lse.rounded_like_the_epilogue(subnormal) - subnormal.bfloat16().float()).abs().max() < 2.0**-133
    assert "mul.rn.f32 c, $1, 0f47800080;" in quack_lse.ROUND_TO_BF16_PTX  # 65537.0's bits, in the kernel's split


REFERENCE_TILE_COLUMNS = 192  # quack's default tile width for the head's product on Hopper


def reference_logits_and_tile_log_normalizers(rows: torch.Tensor, padded_weight: torch.Tensor, vocab_size: int,
                                              tile_columns: int = REFERENCE_TILE_COLUMNS):
    """What ``model.kernels.quack_lse.logits_and_tile_log_normalizers`` computes, in PyTorch: the logits in the rows' dtype
    (NaN past the vocabulary, where quack's are left unwritten), and each row's log-sum-exp of those logits within
    each tile of ``tile_columns`` of its first ``vocab_size`` columns (the last tile ragged), in fp32 [rows, tiles]."""
    logits = rows @ padded_weight.t()
    logits[:, vocab_size:] = float("nan")
    tiles = logits[:, :vocab_size].float().split(tile_columns, dim=1)
    return logits, torch.stack([torch.logsumexp(tile, dim=-1) for tile in tiles], dim=1)


def test_the_reference_for_quacks_logits_with_their_log_sum_exp_leaves_the_padding_and_rounds_first():
    torch.manual_seed(5)
    rows = torch.randn(6, 16).bfloat16()
    weight = torch.zeros(128, 16, dtype=torch.bfloat16)
    weight[:100] = torch.randn(100, 16)
    logits, tiles = reference_logits_and_tile_log_normalizers(rows, weight, 100, tile_columns=32)
    assert logits.dtype == torch.bfloat16 and bool(logits[:, 100:].isnan().all())  # unwritten, as quack leaves them
    torch.testing.assert_close(logits[:, :100], rows @ weight[:100].t(), rtol=0, atol=0)
    assert tiles.shape == (6, 4) and tiles.dtype == torch.float32  # 32, 32, 32 and the ragged 4 columns
    torch.testing.assert_close(tiles[:, 3], torch.logsumexp(logits[:, 96:100].float(), dim=-1))
    torch.testing.assert_close(torch.logsumexp(tiles, dim=-1), torch.logsumexp(logits[:, :100].float(), dim=-1))


TRITON_INTERPRETED_CHECK = r"""
import sys
import types

import torch
from model import loss
from model.loss import IGNORE_INDEX, chunk_loss_and_grad
from model.kernels.triton_cross_entropy import gradient_in_place, loss_and_gradient_in_place
from tests.unit.test_loss import reference_logits_and_tile_log_normalizers

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
import model
model.kernels.quack_lse = sys.modules["model.kernels.quack_lse"] = types.SimpleNamespace(
    logits_and_tile_log_normalizers=reference_logits_and_tile_log_normalizers)
hidden, weight = torch.randn(rows, 16), torch.zeros(padded, 16)
weight[:vocab] = torch.randn(vocab, 16)
for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
    expected_loss, expected_grad = loss.chunk_function("eager")(hidden.to(dtype), weight.to(dtype), targets, vocab,
                                                                dtype)
    got_loss, got_grad = loss.chunk_function("quack")(hidden.to(dtype), weight.to(dtype), targets, vocab, dtype)
    torch.testing.assert_close(got_loss, expected_loss, rtol=1e-6, atol=1e-4)
    assert got_grad.dtype == dtype and (got_grad.float() - expected_grad.float()).abs().max() <= tolerance
    assert (got_grad[:, vocab:] == 0).all() and (got_grad[::4] == 0).all()  # NaN past vocab never read

# the kernel folds each row's tile values as the whole row's log-sum-exp: given by tiles or whole, the same
logits, tiles = reference_logits_and_tile_log_normalizers(hidden.bfloat16(), weight.bfloat16(), vocab)
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
    from tests.helpers import ROOT

    done = subprocess.run([sys.executable, "-c", TRITON_INTERPRETED_CHECK], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-2000:]
