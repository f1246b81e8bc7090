"""The GPU a kernel runs on, and where the optional kernel packages keep what they compile.

``compute_capability`` and ``installed_version`` answer whether an optional kernel can run; the CuTe DSL (FA4's
and quack's compiler) and quack compile at first use, and ``use_cache_folder`` (called by
``runtime.device_policy.prepare_compile``) makes those compilations persist under the output's disposable
``data/compile-cache/`` folder; without it (the probe, tests, evaluation) they stay in memory and nothing is
written, not even the CuTe DSL's default ``/tmp`` cache. ``prepare_environment`` runs before any of those packages
is imported.
"""

from __future__ import annotations

import logging
import os
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The caches' environment variables, read once when flash_attn.cute, quack and the CuTe DSL are imported.
CACHE_VARIABLES = {
    "flash-attn": "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",  # FA4's compiled kernels (.o), when enabled
    "cute-dsl": "CUTE_DSL_CACHE_DIR",  # the CuTe DSL's own IR cache (default /tmp/<user>/cutlass_python_cache)
    "quack": "QUACK_CACHE_DIR",  # quack's compiled GEMMs (.o; default /tmp/<user>/quack_cache, on by default)
}
_cache_folder: Path | None = None


def use_cache_folder(folder: Path | None) -> None:
    """FA4's and the CuTe DSL's compile caches go under ``folder`` (the output's data/compile-cache),
    unless the environment already names folders; None: in memory only. Takes effect if FA4 was not
    imported yet."""
    global _cache_folder
    _cache_folder = None if folder is None else Path(folder)
    if "flash_attn.cute" in sys.modules:
        log.info("FlashAttention 4 was imported before its cache folder was set: its kernels stay in memory")


def prepare_environment() -> None:
    """Point the CuTe DSL (FA4's and quack's compiler) and quack at this process's caches, or at none.
    Read when they are imported, so it is called first."""
    if _cache_folder is not None:  # training: compiled kernels persist under the output
        for name, variable in CACHE_VARIABLES.items():
            os.environ.setdefault(variable, str(_cache_folder / name))
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    else:  # probe, tests, evaluation: in memory only. With file caching off the DSL never creates
        # its cache folder, so naming one spares the /tmp folder it would otherwise make on import.
        os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
        os.environ.setdefault("CUTE_DSL_CACHE_DIR", os.devnull)
        os.environ.setdefault("QUACK_CACHE_ENABLED", "0")


def compute_capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability: whether a kernel written for Hopper or Blackwell runs on it (read through
    ``Target.gpu_capability``, where a Target may also describe a GPU it does not ask)."""
    return torch.cuda.get_device_capability(device)


@lru_cache(maxsize=None)
def installed_version(package: str) -> str | None:
    """An optional package's version for the log and the run record, or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cache_usage_folders() -> dict[str, Path]:
    """FA4's and the CuTe DSL's cache folders when this process persists them (training)."""
    if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") != "1":
        return {}
    return {name: Path(os.environ[variable]) for name, variable in CACHE_VARIABLES.items() if variable in os.environ}
