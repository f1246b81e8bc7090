"""model.hf's tables map each family's weights to Hugging Face's names and back without loss."""

import pytest
import torch

from model import hf
from model.decoder import ModelConfig
from model.families import build_model

SHAPES = {
    "gpt2": ModelConfig(vocab_size=50, n_layer=2, n_head=4, n_embd=32, max_seq_len=16),
    "llama": ModelConfig(family="llama", vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, max_seq_len=16,
                         intermediate_size=48),
    "llama untied": ModelConfig(family="llama", vocab_size=50, n_layer=2, n_head=4, n_kv_head=1, n_embd=32,
                                max_seq_len=16, tie_embeddings=False),
    "llama qk_norm": ModelConfig(family="llama", vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                                 max_seq_len=16, qk_norm=True),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_ours_to_hugging_face_and_back_is_the_same_model(shape):
    torch.manual_seed(0)
    ours = build_model(SHAPES[shape])
    torch.manual_seed(1)
    loaded = build_model(SHAPES[shape])
    hf.load_hf(loaded, hf.to_hf(ours))
    assert ours.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_llama_products_split_into_hugging_faces_in_the_order_of_our_rows():
    config = SHAPES["llama"]
    model = build_model(config)
    weights = hf.to_hf(model)
    q, kv = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    qkv, gate_up = model.blocks[1].attn.qkv.weight, model.blocks[1].mlp.gate_up.weight
    assert torch.equal(weights["model.layers.1.self_attn.q_proj.weight"], qkv[:q])
    assert torch.equal(weights["model.layers.1.self_attn.k_proj.weight"], qkv[q:q + kv])
    assert torch.equal(weights["model.layers.1.self_attn.v_proj.weight"], qkv[q + kv:])
    assert torch.equal(weights["model.layers.1.mlp.gate_proj.weight"], gate_up[:48])
    assert torch.equal(weights["model.layers.1.mlp.up_proj.weight"], gate_up[48:])
    assert "lm_head.weight" not in weights  # tied: the embedding's name stands for both


def test_gpt2_conv1d_layers_are_transposed_with_zero_biases():
    model = build_model(SHAPES["gpt2"])
    weights = hf.to_hf(model)
    assert torch.equal(weights["transformer.h.0.mlp.c_fc.weight"], model.blocks[0].mlp.fc.weight.t())
    assert torch.equal(weights["transformer.h.0.mlp.c_fc.bias"], torch.zeros(4 * 32))


def test_a_missing_tensor_names_what_is_missing():
    model = build_model(SHAPES["llama"])
    weights = hf.to_hf(model)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        hf.load_hf(model, weights)


def test_a_tensor_without_a_hugging_face_name_is_an_error_that_says_where_to_add_it():
    model = build_model(SHAPES["llama"])
    model.blocks[0].attn.register_buffer("q_scale", torch.ones(3))
    with pytest.raises(KeyError, match="model.hf's llama table"):
        hf.to_hf(model)
