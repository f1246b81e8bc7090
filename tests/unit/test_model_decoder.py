"""The decoder: exact size of the reference model, and documents that never see each other."""

from __future__ import annotations

import pytest
import torch

from config import ConfigError, load_config
from model.kernels.attention import DocumentLayout, document_causal_mask, document_offsets
from model.flops import count_parameters, training_flops
from model.decoder import ModelConfig
from model.families import build_model
from model.gpt import GPT
from model.kernels import ComputeConfig, Target


def tiny_model(seed: int = 0, **compute) -> GPT:
    torch.manual_seed(seed)
    model = GPT(ModelConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=32, max_seq_len=32, init_std=0.1),
                ComputeConfig(**compute))
    return model.eval()


def test_reference_config_has_exactly_126_716_160_parameters():
    cfg = load_config("conf/config.yaml")
    with torch.device("meta"):
        model = GPT(cfg.model)
    assert count_parameters(model) == 126_716_160
    assert model.wte.weight is model.lm_head_weight  # tied, counted once


def test_document_causal_mask_matches_brute_force():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]])
    mask = document_causal_mask(positions)[0, 0]
    starts = [0, 3, 5, 9]
    doc = [max(i for i, s in enumerate(starts) if s <= t) for t in range(10)]
    expected = torch.tensor([[j <= i and doc[i] == doc[j] for j in range(10)] for i in range(10)])
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("family, keys", [("gpt2", {}), ("llama", {"n_kv_head": 1}), ("llama", {"n_kv_head": 2}),
                                         ("llama", {"n_kv_head": 4})])
def test_packed_documents_give_the_logits_of_each_document_alone(family, keys):
    """Positions (learned, or the Llama's rotary angles) restart with each document, and attention stays inside it:
    without that the documents after the first would get other logits (checked for the Llama's rotations)."""
    torch.manual_seed(0)
    config = ModelConfig(family=family, vocab_size=97, n_layer=2, n_head=4, n_embd=32, max_seq_len=32, init_std=0.1,
                         **keys)
    model = build_model(config).eval()
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 11, 1, 15]
    docs = [torch.randint(0, 97, (n,), generator=generator) for n in lengths]
    row = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(row, positions)[0]
        start = 0
        for doc in docs:
            torch.testing.assert_close(packed[start : start + len(doc)], model(doc[None])[0], rtol=1e-5, atol=1e-5)
            start += len(doc)
        shifted = model(row)[0, 5:16]  # one document: the second one's tokens at positions 5..15
    assert (shifted - packed[5:16]).abs().max() > 1e-4


def test_changing_one_document_leaves_the_others_untouched():
    model = tiny_model()
    row = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    changed = row.clone()
    changed[0, :10] = (changed[0, :10] + 1) % 97
    with torch.no_grad():
        before, after = model(row, positions), model(changed, positions)
    assert torch.equal(before[0, 10:], after[0, 10:])
    assert not torch.allclose(before[0, :10], after[0, :10])
    # Without document positions the same change would leak into the second document.
    with torch.no_grad():
        leaked = model(changed)[0, 10:] - model(row)[0, 10:]
    assert leaked.abs().max() > 1e-4


def test_activation_checkpointing_gives_the_same_gradients():
    plain, checkpointed = tiny_model(), tiny_model(activation_checkpointing=True)
    row = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    for model in (plain, checkpointed):
        model.train()
        model(row).float().pow(2).mean().backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_document_offsets_are_the_starts_of_each_document_in_the_flattened_rows():
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]])
    assert document_offsets(positions).tolist() == [0, 3, 5, 9, 10]
    assert document_offsets(positions).dtype == torch.int32


def test_training_flops_follow_the_lab_formula():
    cfg = load_config("conf/config.yaml").model
    per_token = 6 * (12 * 12 * 768**2 + 50257 * 768)
    assert per_token == 741_192_192
    assert training_flops(cfg, tokens=4096, attention_pairs=0) == 4096 * per_token
    one_document = training_flops(cfg, tokens=4096, attention_pairs=4096**2)
    four_documents = training_flops(cfg, tokens=4096, attention_pairs=4 * 1024**2)
    assert one_document - four_documents == 12 * 12 * 768 * (4096**2 - 4 * 1024**2)


def test_rows_of_one_document_each_take_plain_causal_attention_with_the_same_result(monkeypatch):
    """cu_seqlens with one entry per row plus the end means one document per row: no mask is built."""
    model = tiny_model()
    ids = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(32).expand(3, 32)
    with torch.no_grad():
        masked = model.hidden_states(ids, positions)  # without cu_seqlens: the document-mask path
        monkeypatch.setattr("model.kernels.attention.document_causal_mask", lambda *a: (_ for _ in ()).throw(AssertionError("mask built")))
        plain = model.hidden_states(ids, positions, document_offsets(positions))
    torch.testing.assert_close(plain, masked, rtol=1e-5, atol=1e-5)
    two_docs = torch.cat([torch.arange(16), torch.arange(16)]).expand(3, 32)
    with torch.no_grad(), pytest.raises(AssertionError, match="mask built"):
        model.hidden_states(ids, two_docs, document_offsets(two_docs))  # several documents: the masked path


@pytest.mark.parametrize("family, keys", [("gpt2", {}), ("llama", {"n_kv_head": 1})])
def test_the_compiled_trunk_is_one_graph_and_matches_eager(family, keys):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    config = ModelConfig(family=family, vocab_size=128, n_layer=4, n_head=2, n_embd=32, max_seq_len=64, **keys)
    torch.manual_seed(0)
    fast, eager = (build_model(config, ComputeConfig(loss_chunk_tokens=0), Target(compiled=compiled))
                   for compiled in (True, False))
    eager.load_state_dict(fast.state_dict())
    fast.train(), eager.train()
    positions = torch.cat([torch.arange(20), torch.arange(44)]).repeat(2, 1)
    batch = {"input_ids": torch.randint(0, 128, (2, 64)), "positions": positions,
             "targets": torch.randint(0, 128, (2, 64)), "cu_seqlens": document_offsets(positions)}
    losses = []
    for model in (fast, eager):
        loss = model.loss_sum(batch)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p), q in zip(fast.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert counters["stats"]["unique_graphs"] == 1
    assert set(fast.state_dict()) == set(eager.state_dict())  # the compiled trunk adds no second copy


def test_the_layer_norm_is_pytorchs_and_no_config_key_chooses_another():
    with pytest.raises(ConfigError, match="norm_kernel"):
        load_config("conf/smoke.yaml", ["model.norm_kernel=quack"])


def test_the_model_section_is_the_shape_and_the_compute_section_how_it_runs():
    cfg = load_config("conf/smoke.yaml", ["compute.loss_chunk_tokens=64", "compute.attention=sdpa"])
    assert (cfg.compute.loss_chunk_tokens, cfg.compute.attention) == (64, "sdpa")
    with pytest.raises(ConfigError, match="compute.loss must be one of auto, quack, triton, not 'liger'"):
        load_config("conf/smoke.yaml", ["compute.loss=liger"])
    with pytest.raises(ConfigError, match="compute.loss_chunk_tokens must be >= 0, not -1"):
        load_config("conf/smoke.yaml", ["compute.loss_chunk_tokens=-1"])


def test_a_model_says_what_runs_each_part_from_its_build():
    model = tiny_model(loss_chunk_tokens=8)
    assert model.kernels_used() == {
        "attention": {"requested": "auto", "ran": {"packed rows": "SDPA with a document mask",
                                                   "one-document rows": "SDPA is_causal"}},
        "mlp": {"requested": "auto", "ran": "torch", "blocks_keeping_the_gelu_derivative": 0},
        "loss": {"requested": "auto", "ran": "eager"},
    }


def block_input_dtypes(model: GPT, row: torch.Tensor) -> tuple[set, torch.Tensor]:
    """The dtypes the blocks receive (the residual stream) in a bf16-autocast training forward, and its loss."""
    seen = set()
    hooks = [b.register_forward_pre_hook(lambda _, args: seen.add(args[0].dtype)) for b in model.blocks]
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(row).float().pow(2).mean()
    for hook in hooks:
        hook.remove()
    return seen, loss


def test_the_residual_stream_takes_the_compute_dtype_under_autocast_and_stays_close_to_fp32():
    row = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    model = tiny_model()
    seen, loss = block_input_dtypes(model, row)
    assert seen == {torch.bfloat16}
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    fp32_seen = set()
    hooks = [b.register_forward_pre_hook(lambda _, args: fp32_seen.add(args[0].dtype)) for b in model.blocks]
    with torch.no_grad():  # the same model without autocast (32-true): the stream stays in the weights' fp32
        fp32_loss = model(row).float().pow(2).mean()
    for hook in hooks:
        hook.remove()
    assert fp32_seen == {torch.float32}
    # The same model, rounded differently: close (bf16 has 8 bits of mantissa), not equal.
    assert loss != fp32_loss
    torch.testing.assert_close(loss.detach(), fp32_loss, rtol=2e-2, atol=0)


class _RecordingLinear(torch.nn.Linear):
    """A Linear layer that notes its calls."""

    calls: list = []

    def forward(self, x):
        _RecordingLinear.calls.append(self.weight.shape)
        return super().forward(x)


def test_eager_every_product_of_the_blocks_goes_through_their_linear_layers(monkeypatch):
    """The blocks are nanoGPT's modules: swapping a Linear layer (a hook, a quantized layer) changes what runs."""
    monkeypatch.setattr(_RecordingLinear, "calls", [])
    model = tiny_model()
    for block in model.blocks:
        for owner, name in ((block.attn, "qkv"), (block.attn, "proj"), (block.mlp, "fc"), (block.mlp, "proj")):
            layer = getattr(owner, name)
            swapped = _RecordingLinear(layer.in_features, layer.out_features, bias=False)
            swapped.load_state_dict(layer.state_dict())
            setattr(owner, name, swapped)
    row = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(7))
    reference = tiny_model()
    with torch.no_grad():
        torch.testing.assert_close(model(row), reference(row))
    d = model.config.n_embd
    assert _RecordingLinear.calls == [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * model.config.n_layer


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_built_for_the_cpu_holds_the_plain_kernels_and_no_forward_chooses_again(family, monkeypatch):
    from model import kernels
    from model.kernels import attention
    from model.loss import chunk_loss_and_grad

    llama = {"n_kv_head": 2} if family == "llama" else {}
    model = build_model(ModelConfig(family=family, vocab_size=97, n_layer=2, n_head=4, n_embd=32, max_seq_len=32,
                                    **llama), ComputeConfig(loss_chunk_tokens=8))
    assert model.target == Target(torch.device("cpu"), torch.float32, compiled=False) and model.compiled_trunk is None
    for block in model.blocks:  # before any forward: the plain kernels, as callables
        assert block.attn.attend.func is attention.attend and block.attn.attend.keywords == {"kernel": "sdpa"}
        assert block.mlp.kernel is None  # the block's own Linear modules
    assert model.head_loss.chunk_fn.args == (chunk_loss_and_grad,)

    def refused(*args):
        raise AssertionError("a forward chose a kernel")

    monkeypatch.setattr(kernels, "choose_kernels", refused)
    row = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(8))
    model.train()
    model.loss_sum({"input_ids": row, "targets": row}).backward()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(row)
    model.eval()
    with torch.no_grad():
        model(row)


def test_a_compiled_target_compiles_the_trunk_and_chooses_for_its_device_and_dtype(monkeypatch):
    from model import kernels

    chosen = []
    real = kernels.choose_kernels

    def recording(compute, target, shape):
        chosen.append(target)
        return real(compute, target, shape)

    monkeypatch.setattr(kernels, "choose_kernels", recording)
    target = Target(torch.device("cpu"), torch.bfloat16, compiled=True)
    model = GPT(ModelConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=32, max_seq_len=32), None, target)
    assert chosen == [target] and model.target == target and model.compiled_trunk is not None
    model.use_target()  # where the weights are, eager: what a tool that moves the model asks for
    assert chosen[-1] == Target() and model.compiled_trunk is None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_zero_init_proj_zeroes_the_output_projections_only_and_every_block_starts_as_the_identity(family):
    def built(zero: bool):
        torch.manual_seed(0)
        return build_model(ModelConfig(family=family, vocab_size=97, n_layer=2, n_head=4, n_embd=32, max_seq_len=32,
                                       init_std=0.1, zero_init_proj=zero))

    normal, zeroed = built(False), built(True)
    projections = {f"blocks.{i}.{part}.proj.weight" for i in range(2) for part in ("attn", "mlp")}
    assert {n for n, p in zeroed.named_parameters() if p.dim() == 2 and not p.any()} == projections
    assert all(normal.get_parameter(n).std() > 0 for n in projections)
    for name, p in zeroed.named_parameters():  # the same draws as the normal init everywhere else
        if name not in projections:
            assert torch.equal(p, normal.get_parameter(name)), name
    input_ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        skipped = zeroed.final_norm(zeroed.embed(input_ids, DocumentLayout(None, None)))
        assert torch.allclose(zeroed.hidden_states(input_ids), skipped)
    zeroed.loss_sum({"input_ids": input_ids, "targets": input_ids.roll(-1, 1)}).backward()
    assert all(zeroed.get_parameter(n).grad.abs().sum() > 0 for n in projections)  # they learn from the first step
