"""The two-way map between each family's weights and its Hugging Face model's (``GPT2LMHeadModel``,
``LlamaForCausalLM``, or ``Qwen3ForCausalLM`` for a Llama with ``qk_norm``, whose names are Llama's plus q_norm
and k_norm): one table per family, our state-dict name to transformers' name(s).

``to_hf`` gives a model's weights under Hugging Face's names (what the export writes and the history digests);
``load_hf`` puts such weights back into a model of the same shape (what ``tools evaluate`` scores). Where one of our
products holds several of Hugging Face's (Llama's ``qkv``: q_proj, k_proj, v_proj; ``gate_up``: gate_proj, up_proj)
the table lists them in the order of our rows. GPT-2's Conv1D layers store [in, out], the transpose of our
``nn.Linear``, and have biases where ours have none: those are written as zeros, the same function. A tied head has
no tensor of its own (the embedding's name stands for both). Imports torch only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

WEIGHTS_NAME = "model.safetensors"  # the file of an exported model's weights, under Hugging Face's names


@dataclass(frozen=True)
class Entry:
    """Where one of our tensors goes: ``names`` (Hugging Face's, ``{}`` the block index), ``rows`` (how our rows
    split among several names, from the model config), ``conv1d`` (stored transposed, with a zero bias)."""

    names: tuple[str, ...]
    rows: Callable | None = None
    conv1d: bool = False


def _one(name: str, conv1d: bool = False) -> Entry:
    return Entry((name,), conv1d=conv1d)


GPT2 = {
    "wte.weight": _one("transformer.wte.weight"),
    "wpe.weight": _one("transformer.wpe.weight"),
    "ln_f.weight": _one("transformer.ln_f.weight"),
    "ln_f.bias": _one("transformer.ln_f.bias"),
    "blocks.{}.ln_1.weight": _one("transformer.h.{}.ln_1.weight"),
    "blocks.{}.ln_1.bias": _one("transformer.h.{}.ln_1.bias"),
    "blocks.{}.attn.qkv.weight": _one("transformer.h.{}.attn.c_attn.weight", conv1d=True),  # [q | k | v] as ours
    "blocks.{}.attn.proj.weight": _one("transformer.h.{}.attn.c_proj.weight", conv1d=True),
    "blocks.{}.ln_2.weight": _one("transformer.h.{}.ln_2.weight"),
    "blocks.{}.ln_2.bias": _one("transformer.h.{}.ln_2.bias"),
    "blocks.{}.mlp.fc.weight": _one("transformer.h.{}.mlp.c_fc.weight", conv1d=True),
    "blocks.{}.mlp.proj.weight": _one("transformer.h.{}.mlp.c_proj.weight", conv1d=True),
}

# The rotary positions are Hugging Face's rotate-half convention already: q and k need no permutation.
LLAMA = {
    "wte.weight": _one("model.embed_tokens.weight"),
    "norm.weight": _one("model.norm.weight"),
    "lm_head.weight": _one("lm_head.weight"),
    "blocks.{}.attn_norm.weight": _one("model.layers.{}.input_layernorm.weight"),
    "blocks.{}.attn.qkv.weight": Entry(
        tuple(f"model.layers.{{}}.self_attn.{p}_proj.weight" for p in "qkv"),
        rows=lambda c: (c.n_head * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim)),
    "blocks.{}.attn.proj.weight": _one("model.layers.{}.self_attn.o_proj.weight"),
    "blocks.{}.attn.q_norm.weight": _one("model.layers.{}.self_attn.q_norm.weight"),  # qk_norm: Qwen3's names
    "blocks.{}.attn.k_norm.weight": _one("model.layers.{}.self_attn.k_norm.weight"),
    "blocks.{}.mlp_norm.weight": _one("model.layers.{}.post_attention_layernorm.weight"),
    "blocks.{}.mlp.gate_up.weight": Entry(("model.layers.{}.mlp.gate_proj.weight", "model.layers.{}.mlp.up_proj.weight"),
                                          rows=lambda c: (c.mlp_width, c.mlp_width)),
    "blocks.{}.mlp.proj.weight": _one("model.layers.{}.mlp.down_proj.weight"),
}

TABLES = {"gpt2": GPT2, "llama": LLAMA}
BLOCK = re.compile(r"blocks\.(\d+)\.")


def _entries(model: nn.Module):
    """(our tensor, its Entry, its block index or "") for each tensor of ``model``'s state dict."""
    table = TABLES[model.config.family]
    for name, tensor in model.state_dict().items():
        found = BLOCK.match(name)
        key = BLOCK.sub("blocks.{}.", name, count=1) if found else name
        if key not in table:
            raise KeyError(f"{name} has no Hugging Face name: model.hf's {model.config.family} table lists "
                           f"{', '.join(table)}; add the new tensor there")
        yield tensor, table[key], found[1] if found else ""


def _exported(t: torch.Tensor) -> torch.Tensor:
    """fp32, contiguous and on CPU, so the file is the same whatever precision/device trained it."""
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous()


def to_hf(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights (fp32, on CPU) under the Hugging Face names of its family."""
    out: dict[str, torch.Tensor] = {}
    for tensor, entry, index in _entries(model):
        names = [name.format(index) for name in entry.names]
        parts = tensor.split(entry.rows(model.config)) if entry.rows else (tensor,)
        for name, part in zip(names, parts, strict=True):
            out[name] = _exported(part.t() if entry.conv1d else part)
            if entry.conv1d:
                out[name.removesuffix(".weight") + ".bias"] = torch.zeros(part.shape[0], dtype=torch.float32)
    return out


def load_hf(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copies Hugging Face-named ``weights`` of ``model``'s family into ``model``. A missing name raises KeyError, a
    tensor of another shape RuntimeError; GPT-2's Conv1D biases are not read (ours are zero: ``to_hf`` of the
    loaded model tells whether the weights were exactly ours)."""
    with torch.no_grad():
        for tensor, entry, index in _entries(model):
            parts = [weights[name.format(index)] for name in entry.names]
            value = torch.cat(parts) if len(parts) > 1 else parts[0]
            tensor.copy_(value.t() if entry.conv1d else value)
