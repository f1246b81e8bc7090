"""FP8 training of the blocks' matrix products through torchao (``model.fp8``).

torchao's ``Float8Linear`` with tensorwise scaling leaves the casts to inductor, which can fuse them
into the producers (LayerNorm, GELU) inside the compiled trunk. Only the blocks' ``nn.Linear`` layers
are converted (qkv, attention projection, MLP fc and projection): the LM head is the tied embedding,
computed by the loss. The parameters stay the same fp32 tensors under the same names, so the
optimizer, checkpoints and the export do not change.
"""

from __future__ import annotations

import importlib
import logging

import torch
from torch import nn

from config import ConfigError

log = logging.getLogger(__name__)

MIN_COMPUTE_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later


def unavailable_reason(device: torch.device | None) -> str | None:
    """None when torchao's float8 training can run on ``device``, else why not."""
    if device is None or device.type != "cuda":
        return f"it needs a CUDA GPU, and this run computes on {'the CPU' if device is None else device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_COMPUTE_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} has no FP8 tensor cores (8.9 or later needed)"
    try:
        importlib.import_module("torchao.float8")
    except Exception as error:  # noqa: BLE001 - missing package, or one built for another PyTorch
        return f"torchao.float8 does not import ({type(error).__name__}: {str(error)[:200]})"
    return None


def convert_blocks(blocks: nn.Module, device: torch.device | None) -> int:
    """Swap the Linear layers under ``blocks`` for torchao's Float8Linear (tensorwise scaling), in
    place, before torch.compile; returns how many were converted. Refuses with a ConfigError where it
    cannot run, before any data is read."""
    reason = unavailable_reason(device)
    if reason is not None:
        raise ConfigError(f"model.fp8 is true but {reason}. Set model.fp8=false, or install torchao "
                          f"(README: FP8 for the blocks' matrix products) on an FP8-capable GPU.")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    before = sum(isinstance(m, nn.Linear) for m in blocks.modules())
    convert_to_float8_training(blocks, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    log.info("fp8: %d Linear layers of the blocks train with torchao float8 (tensorwise scaling)", before)
    return before
