"""The Llama family (model.family llama): documents apart under rotary positions, grouped-query attention, its
config's refusals, its FLOPs and host-memory counts from its real shapes, and its kernels."""

from __future__ import annotations

import logging
import math
import re
import subprocess
import sys

import pytest
import torch

from config import ConfigError, load_config
from lit_module import DecoderTrainingModule, OptimConfig
from model import kernels, rope
from model.kernels.attention import DocumentLayout, attend, document_offsets
from model.decoder import ModelConfig
from model.families import build_model
from model.flops import count_parameters, matrix_parameters, training_flops
from model.kernels import ComputeConfig, Target
from model.llama import Llama
from runtime import host_budget

from tests.helpers import ROOT

CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


def tiny_llama(seed: int = 0, n_kv_head: int | None = 2, tie_embeddings: bool = True, rope_theta: float = 10000.0,
               qk_norm: bool = False, **compute) -> Llama:
    torch.manual_seed(seed)
    config = ModelConfig(family="llama", vocab_size=97, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=32,
                         max_seq_len=32, init_std=0.1, tie_embeddings=tie_embeddings, rope_theta=rope_theta,
                         qk_norm=qk_norm)
    return build_model(config, ComputeConfig(**compute)).eval()


def test_the_factory_builds_the_family_the_config_names():
    assert type(build_model(ModelConfig(family="llama", vocab_size=16, n_layer=1, n_head=2, n_embd=8,
                                        max_seq_len=8))) is Llama
    assert type(build_model(ModelConfig(vocab_size=16, n_layer=1, n_head=2, n_embd=8, max_seq_len=8))).__name__ == "GPT"


def reference_grouped_attention(q, k, v, positions):
    """Causal attention within documents with every key/value head repeated to its group of query heads, one
    (row, head) at a time: grouped-query attention's definition, with none of attend's kernels."""
    b, t, h, hd = q.shape
    group = h // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    segment = torch.cumsum(positions == 0, dim=-1)
    out = torch.empty_like(q)
    for row in range(b):
        allowed = (segment[row][:, None] == segment[row][None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
        for head in range(h):
            scores = q[row, :, head] @ k[row, :, head].T / math.sqrt(hd)
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[row, :, head] = weights @ v[row, :, head]
    return out


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_grouped_query_attention_equals_attention_with_the_key_value_heads_repeated(kv_heads, packed):
    generator = torch.Generator().manual_seed(kv_heads)
    b, t, h, hd = 2, 12, 4, 8
    qkv = torch.randn(b, t, h + 2 * kv_heads, hd, generator=generator)
    positions = (torch.cat([torch.arange(5), torch.arange(7)]) if packed else torch.arange(t)).expand(b, t)
    layout = DocumentLayout(positions if packed else None, document_offsets(positions) if packed else None)
    got = attend(qkv, kv_heads, layout, "sdpa")
    q, k, v = qkv.split((h, kv_heads, kv_heads), dim=2)
    torch.testing.assert_close(got, reference_grouped_attention(q, k, v, positions), rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_gives_the_same_gradients():
    plain, checkpointed = tiny_llama(), tiny_llama(activation_checkpointing=True)
    row = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16)
    for model in (plain, checkpointed):
        model.train()
        model(row, positions).float().pow(2).mean().backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_an_untied_head_is_its_own_matrix_and_decays_while_the_embedding_does_not():
    tied, untied = tiny_llama(), tiny_llama(tie_embeddings=False)
    assert tied.lm_head_weight is tied.wte.weight
    assert untied.lm_head_weight is not untied.wte.weight
    assert count_parameters(untied) - count_parameters(tied) == 97 * 32
    module = DecoderTrainingModule(untied.config, OptimConfig())
    decayed, kept = ({id(p) for p in group["params"]} for group in module.parameter_groups())
    assert id(module.model.lm_head_weight) in decayed and id(module.model.wte.weight) in kept
    assert all(id(p) in kept for name, p in module.model.named_parameters() if name.endswith("norm.weight"))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_makes_attention_blind_to_the_scale_of_each_heads_query_and_key(qk_norm):
    """RMSNorm over each head's q and k: scaling one head's query rows or one key head's rows changes nothing with
    qk_norm (its weights are per position in the head, not per head), and changes the logits without it."""
    model = tiny_llama(qk_norm=qk_norm)
    input_ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        if qk_norm:
            for norm in (model.blocks[0].attn.q_norm, model.blocks[0].attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
        before = model(input_ids)
        qkv = model.blocks[0].attn.qkv.weight  # rows: 4 query heads, 2 key heads, 2 value heads of 8
        qkv[8:16] *= 7.0  # query head 1
        qkv[40:48] *= 3.0  # key head 1
        after = model(input_ids)
    if qk_norm:
        assert {n for n, _ in model.named_parameters() if "_norm" in n and ".attn." in n} == {
            f"blocks.{i}.attn.{w}_norm.weight" for i in (0, 1) for w in "qk"}
        assert (after - before).abs().max().item() < 1e-4
    else:
        assert (after - before).abs().max().item() > 1e-2


@pytest.mark.parametrize("override, says", [
    ("model.n_kv_head=3", "model.n_head (4) must be divisible by model.n_kv_head (3)"),
    ("model.n_embd=36", "the head dimension, 9) must be even"),
    ("model.family=mamba", "model.family must be one of gpt2, llama, not 'mamba'"),
])
def test_a_llama_that_cannot_run_is_refused_naming_the_key(override, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config("conf/llama-smoke.yaml", [override])


@pytest.mark.parametrize("override", ["model.n_kv_head=2", "model.intermediate_size=64", "model.rope_theta=500",
                                      "model.tie_embeddings=false", "model.qk_norm=true"])
def test_gpt2_refuses_a_llama_key_away_from_its_default_naming_it(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(f"{key} is a llama key: gpt2 ")):
        load_config("conf/smoke.yaml", [override])


def test_the_default_swiglu_width_is_llamas_rule_of_two_thirds_of_four_widths_rounded_up_to_256():
    for width in (128, 768, 4096):
        config = ModelConfig(family="llama", n_embd=width, n_head=8)
        assert config.mlp_width % 256 == 0 and 0 <= config.mlp_width - 8 * width // 3 < 256


def test_the_llama_preset_is_the_gpt2_presets_size_and_its_flops_count_its_own_products():
    cfg = load_config("conf/llama-150m.yaml").model
    with torch.device("meta"):
        model = build_model(cfg)
        gpt2 = build_model(load_config("conf/config.yaml").model)
    assert abs(count_parameters(model) / count_parameters(gpt2) - 1) < 0.005
    products = sum(m.weight.numel() for m in model.blocks.modules() if isinstance(m, torch.nn.Linear))
    assert matrix_parameters(cfg) == products + cfg.vocab_size * cfg.n_embd
    assert cfg.kv_heads < cfg.n_head  # the k and v products are narrower than q's
    one_document = training_flops(cfg, tokens=4096, attention_pairs=4096**2)
    assert one_document == 6 * (products + cfg.vocab_size * cfg.n_embd) * 4096 + 12 * cfg.n_layer * cfg.n_embd * 4096**2


@pytest.mark.parametrize("preset", ["conf/smoke.yaml", "conf/llama-smoke.yaml"])
def test_the_cpu_memory_estimate_counts_the_built_models_parameters(preset):
    cfg = load_config(preset).model
    with torch.device("meta"):
        built = count_parameters(build_model(cfg))
    heads = 1 if cfg.tie_embeddings else 2
    padding = (-(-cfg.vocab_size // 128) * 128 - cfg.vocab_size) * cfg.n_embd * heads
    if cfg.family == "llama":
        assert host_budget.cpu_parameters(cfg) - padding == built
    else:  # GPT-2's count, as it was measured against, stays what it was: close to the built model's
        assert abs(host_budget.cpu_parameters(cfg) - padding - built) < 0.01 * built


def test_the_mlp_of_compiled_llama_training_is_pytorchs_and_the_log_says_why(monkeypatch):
    monkeypatch.setattr("model.kernels.fused_mlp.quack_imports", lambda: None)  # quack installed: it runs for gpt2
    hopper = Target(CUDA, torch.bfloat16, compiled=True, capability=(9, 0))
    assert kernels.mlp_kernels(ComputeConfig(), hopper, 3, 128, "llama") == ("torch",) * 3
    assert kernels.mlp_kernels(ComputeConfig(mlp_kept_derivatives=0), hopper, 3, 128, "gpt2") == ("quack",) * 3
    with pytest.raises(RuntimeError, match="compute.mlp is 'quack' but it cannot run: quack's MLP has GPT-2's GELU"):
        kernels.mlp_kernels(ComputeConfig(mlp="quack"), hopper, 3, 128, "llama")
    # The fallback's log line comes once a process: a process of its own sees it.
    code = ("import logging, sys, torch; logging.basicConfig(stream=sys.stdout, level=logging.INFO)\n"
            "from model import kernels; from model.kernels import ComputeConfig, Target\n"
            "kernels.mlp_kernels(ComputeConfig(), Target(compiled=True), 3, 128, 'llama')")
    said = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "compute.mlp: quack not used (quack's MLP has GPT-2's GELU in its epilogues, not SwiGLU" in said
    assert said.rstrip().endswith("torch instead")


def test_a_model_built_for_compiled_training_says_what_runs_each_part(caplog):
    with caplog.at_level(logging.INFO, logger="model.decoder"):
        model = build_model(tiny_llama().config, ComputeConfig(loss_chunk_tokens=8), Target(compiled=True))
    assert model.kernels_used()["mlp"] == {"requested": "auto", "ran": "torch", "blocks_keeping_the_gelu_derivative": 0}
    assert "mlp: PyTorch (cuBLAS products, SwiGLU and RMSNorm by inductor or eager)" in caplog.text


def per_forward_angles(self, positions, length):
    """The rotary angles as every forward computed them before the table: cos and sin of the batch's positions."""
    if positions is None:
        positions = torch.arange(length)[None]
    return rope.rotary_cos_sin(positions, self.head_dim, self.theta)


def test_the_rotary_table_gives_exactly_the_angles_computed_per_forward_and_the_same_logits(monkeypatch):
    model = tiny_llama(rope_theta=500.0).train()
    row = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(4))
    packed = torch.cat([torch.arange(7), torch.arange(17)]).expand(2, 24)
    for positions in (packed, None):
        for looked_up, computed in zip(model.rotary(positions, 24), per_forward_angles(model.rotary, positions, 24)):
            assert looked_up.dtype == torch.float32 and torch.equal(looked_up.expand_as(computed), computed)
    logits = [model(row, positions) for positions in (packed, None)]
    grads = torch.autograd.grad(sum(out.sum() for out in logits), list(model.parameters()))
    monkeypatch.setattr(rope.RotaryTable, "forward", per_forward_angles)
    before = [model(row, positions) for positions in (packed, None)]
    assert all(torch.equal(a, b) for a, b in zip(logits, before))
    for a, b in zip(grads, torch.autograd.grad(sum(out.sum() for out in before), list(model.parameters()))):
        assert torch.equal(a, b)


def test_a_forward_evaluates_no_cos_or_sin():
    model = tiny_llama()
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(torch.zeros(2, 16, dtype=torch.long), torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16))
        model(torch.zeros(2, 16, dtype=torch.long))
    ran = {event.key for event in profile.key_averages()}
    assert "aten::embedding" in ran and not ran & {"aten::cos", "aten::sin"}


def test_the_rotary_table_stays_exact_through_casts_and_meta_builds_and_is_not_in_the_state_dict():
    expected = tiny_llama().rotary
    cast = tiny_llama().to(torch.bfloat16).rotary  # what a "bf16-true" precision does to the module
    with torch.device("meta"):
        on_meta = tiny_llama()
    materialized = on_meta.to_empty(device="cpu").rotary
    for table in (cast, materialized):
        assert table.cos.dtype == table.sin.dtype == torch.float32
        assert torch.equal(table.cos, expected.cos) and torch.equal(table.sin, expected.sin)
    assert expected.cos.shape == (32, 8)
    assert not [name for name in tiny_llama().state_dict() if "rotary" in name]
