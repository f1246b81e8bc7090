"""The decoder families and the one factory every user builds a model with."""

from __future__ import annotations

from model.decoder import Decoder, ModelConfig
from model.gpt import GPT
from model.kernels import ComputeConfig, Target
from model.llama import Llama

FAMILY_CLASSES = {"gpt2": GPT, "llama": Llama}


def build_model(config: ModelConfig, compute: ComputeConfig | None = None, target: Target | None = None) -> Decoder:
    """The decoder ``config.family`` names, of ``config``'s shape, computing as ``compute`` says, with the kernels
    chosen for ``target`` (None: where its weights are built, in their dtype, eager)."""
    return FAMILY_CLASSES[config.family](config, compute, target)
