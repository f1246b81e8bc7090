"""Where and how a process computes: devices and ranks, precision, the data-parallel strategy, GPU
and host memory limits, and the compile caches' place (the Trainer built from them: trainer.py).

Training, the probe and every data-parallel worker take these decisions through the same
functions, so a probe that fits means training fits.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch

from model.kernels import Target, gpu
from runtime import host_budget
from config import ConfigError, RunConfig
from runfab.limits import CPU_CORES, GIB
from lit_module import DecoderTrainingModule

log = logging.getLogger("train")


def world_size(cfg: RunConfig) -> int:
    """Data-parallel ranks: ``trainer.devices`` if set, else every visible GPU (1 on CPU)."""
    if cfg.trainer.devices is not None:
        return cfg.trainer.devices
    return max(1, torch.cuda.device_count()) if resolve_accelerator(cfg) == "gpu" else 1


def local_device() -> int:
    """This process's CUDA index: its local rank in a worker (set by launcher.py), else 0."""
    return int(os.environ.get("LOCAL_RANK", 0))


def resolve_accelerator(cfg: RunConfig) -> str:
    if cfg.trainer.accelerator == "gpu" and not cuda_present():
        raise ConfigError("trainer.accelerator is gpu, but no CUDA GPU is visible to this process (check "
                          "CUDA_VISIBLE_DEVICES and the torch build); use trainer.accelerator auto or cpu")
    if cfg.trainer.accelerator != "auto":
        return cfg.trainer.accelerator
    return "gpu" if cuda_present() else "cpu"


def cuda_present() -> bool:
    """Whether CUDA devices exist, asked through NVML while CUDA is not initialized: the process
    that starts the workers must not initialize CUDA, or it could not fork them (launcher.py)."""
    if torch.cuda.is_initialized():
        return torch.cuda.is_available()
    return torch.cuda.device_count() > 0  # NVML first; the CUDA runtime only if NVML cannot answer


def compiles(cfg: RunConfig, accelerator: str) -> bool:
    """Whether training compiles the trunk: ``trainer.compile``, by default on GPUs only."""
    return cfg.trainer.compile if cfg.trainer.compile is not None else accelerator == "gpu"


def resolve_precision(cfg: RunConfig, accelerator: str) -> str:
    return cfg.trainer.precision or ("bf16-mixed" if accelerator == "gpu" else "32-true")


# The dtype the model computes in under each precision: autocast's (mixed) or its weights' (true)
COMPUTE_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
                  "16-mixed": torch.float16, "16-true": torch.float16, "64-true": torch.float64}


def _no_advertisement(record: logging.LogRecord) -> bool:
    """Lightning's tip to install its hosted logger: the loggers here are chosen in observe.loggers."""
    return not record.getMessage().startswith("💡 Tip:")


def setup_process(cfg: RunConfig) -> None:
    """Logging to stderr, quiet about what we chose on purpose, seeded."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[%(asctime)s %(name)s] %(message)s")
    for name in ("train", "datamodule", "callbacks", "model", "pipeline", "runfab", "runtime", "lightning.pytorch"):
        logging.getLogger(name).setLevel(cfg.log_level.upper())  # log_level: what stderr tells
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_no_advertisement)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*Consider setting `persistent_workers`.*")
    L.seed_everything(cfg.seed, verbose=False)


class SameStreamDDP(L.pytorch.strategies.DDPStrategy):
    """Lightning wraps the model in DDP on a side CUDA stream; DDP keeps the gradient accumulators it
    made there, and PyTorch then warns at every backward that their stream does not match the
    stream producing the gradients ("may incur unnecessary synchronization"; its advice: wrap on the
    stream the forward runs on). This wraps on the current stream, as that warning asks."""

    def _setup_model(self, model):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)


def resolve_strategy(cfg: RunConfig, accelerator: str, world: int) -> str | L.pytorch.strategies.DDPStrategy:
    """Lightning's default for one rank, else DDP (``ddp_strategy``)."""
    return "auto" if world == 1 else ddp_strategy(cfg, accelerator)


def ddp_strategy(cfg: RunConfig, accelerator: str) -> L.pytorch.strategies.DDPStrategy:
    """DDP joining the launcher's processes. Gradients are views into DDP's buckets (no copy into
    them, one gradient-sized buffer less per GPU); buckets of ``trainer.ddp_bucket_cap_mb``."""
    return SameStreamDDP(
        process_group_backend="nccl" if accelerator == "gpu" else "gloo",
        gradient_as_bucket_view=True, bucket_cap_mb=cfg.trainer.ddp_bucket_cap_mb,
    )


def build_module(cfg: RunConfig, device: torch.device | None, compiled: bool = False) -> DecoderTrainingModule:
    """The LightningModule, its weights initialized on ``device`` (None: the CPU): on a GPU no full fp32 copy of
    the model is ever made in host memory, and no core spends seconds drawing 127M random numbers. Its kernels are
    chosen there, once (``model.kernels.Target``): for ``device``, the precision's compute dtype, and the compiled
    trunk of training (``compiled``; the compile caches' place, ``prepare_compile``, comes first) or eager."""
    accelerator = "gpu" if device is not None and device.type == "cuda" else "cpu"
    target = Target(device or torch.device("cpu"), COMPUTE_DTYPES[resolve_precision(cfg, accelerator)], compiled)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return DecoderTrainingModule(cfg.model, cfg.optim, cfg.compute, target)


def check_host_memory(cfg: RunConfig, world: int, microbatch: int) -> None:
    """Refuse, before any data is read or worker started, a run whose host memory cannot fit: a GPU
    count over the job's budget, or a CPU run (activations in host memory) over what the machine has."""
    if resolve_accelerator(cfg) != "gpu":
        problem = host_budget.cpu_memory_problem(cfg.model, microbatch, world, host_budget.available_host_bytes(),
                                                 cfg.compute.loss_chunk_tokens)
    else:
        written = host_budget.output_bytes(cfg) + host_budget.observation_bytes(cfg)  # the output folder is RAM too
        problem = host_budget.host_budget_problem(cfg.trainer.host_memory_budget_gib, world, written)
        if problem is None and cfg.trainer.host_memory_budget_gib > 0:
            log.info(host_budget.projected(world, written).line(cfg.trainer.host_memory_budget_gib))
    if problem is not None:
        raise ConfigError(problem)


def prepare_compile(folder: Path, world: int) -> None:
    """Inductor, Triton and FlashAttention 4 (CuTe DSL) caches go to the output's disposable data/
    folder (RunFab's /tmp holds 256 MiB), and compilation uses few subprocesses: RunFab has 2 cores
    and 8 GiB for the whole job, and each compile worker holds a few hundred MB of RAM.

    A cache folder the environment names is kept, unless it is the library's own default: importing
    Lightning already makes inductor write its /tmp default into the environment."""
    folder.mkdir(parents=True, exist_ok=True)
    for variable, default, ours in (("TORCHINDUCTOR_CACHE_DIR", inductor_default_cache(), folder / "inductor"),
                                    ("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache", folder / "triton")):
        named = os.environ.get(variable)
        if named is None or Path(named).absolute() == default.absolute():
            os.environ[variable] = str(ours)
    gpu.use_cache_folder(folder)  # FA4's kernels, compiled at first use
    _move_precompiled_headers(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1 if world > 1 else min(CPU_CORES, len(os.sched_getaffinity(0)))


def _move_precompiled_headers(inductor_folder: Path) -> None:
    """Inductor's precompiled C++ headers (150 MB, for CPU kernels) ignore TORCHINDUCTOR_CACHE_DIR:
    their folder is fixed under the temp folder when the code cache is imported. Moved with the rest
    where this torch has that module attribute."""
    from torch._inductor import codecache

    if hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR"):
        codecache._HEADER_DIR = str(inductor_folder / "precompiled_headers")
        codecache._HEADER_LOCK_DIR = str(inductor_folder / "precompiled_headers" / "locks")


# What a compiling GPU worker imports for torch.compile (about 550 modules: dynamo, AOTAutograd,
# inductor and its Triton code generator, sympy). Imported once in the process that forks the
# workers, they are shared by all of them instead of imported by each.
COMPILER_MODULES = (
    "torch._dynamo", "torch._dynamo.backends.inductor", "torch._dynamo.backends.distributed",
    "torch._functorch.aot_autograd", "torch._inductor.compile_fx", "torch._inductor.graph",
    "torch._inductor.lowering", "torch._inductor.select_algorithm", "torch._inductor.codegen.triton",
)


def preload_worker_modules(cfg: RunConfig, compile_folder: Path, world: int) -> None:
    """Before workers are forked: import here the compiler every compiling GPU worker would
    otherwise import for itself, so that its memory is shared and its import time paid once; and
    set the compile caches' place, which the workers inherit.

    FlashAttention 4 is not preloaded: importing it initializes CUDA (tvm_ffi calls
    ``torch.cuda.is_available()`` and quack, which it imports, reads the compute capability), and a
    process that has initialized CUDA cannot fork workers that use it. Each worker imports it itself."""
    accelerator = resolve_accelerator(cfg)
    if accelerator != "gpu" or not compiles(cfg, accelerator):
        return
    prepare_compile(compile_folder, world)
    for name in COMPILER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as error:  # an older torch lays the compiler out differently: the worker imports it
            log.debug("not preloaded: %s (%s)", name, error)


def inductor_default_cache() -> Path:
    """The folder inductor picks when TORCHINDUCTOR_CACHE_DIR is unset (/tmp/torchinductor_<user>)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir())


# GPU memory limits.
#
# Training and the probe run under the same allocator settings and the same cap, so a probe that
# fits means training fits. A platform may limit memory in two ways, and both reach every worker:
# PYTORCH_CUDA_ALLOC_CONF in the environment (inherited by the workers as is, and then ours is not
# applied), and torch.cuda.set_per_process_memory_fraction called in this process before a hook
# (read here and handed to the workers, which apply the smaller of it and our headroom cap).
# Host limits (cgroups, rlimits) apply to the whole process tree by themselves.

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def use_allocator_settings(cfg: RunConfig) -> None:
    """Our allocator settings, unless the platform chose its own; set before CUDA starts, inherited by workers."""
    if not cfg.trainer.cuda_alloc_conf or ALLOC_CONF_ENV in os.environ:
        return
    if torch.cuda.is_initialized():
        log.warning("CUDA was initialized before train.py could set %s=%s; the allocator keeps its settings",
                    ALLOC_CONF_ENV, cfg.trainer.cuda_alloc_conf)
        return
    os.environ[ALLOC_CONF_ENV] = cfg.trainer.cuda_alloc_conf


def platform_memory_fraction() -> float | None:
    """The GPU memory fraction the platform set in this process before calling a hook, if any.

    Only read when CUDA is already initialized: asking would otherwise initialize it.
    """
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None or not torch.cuda.is_initialized():
        return None
    fraction = min(getter(i) for i in range(torch.cuda.device_count()))
    return fraction if fraction < 1 else None


def limit_gpu_memory(cfg: RunConfig, device: int, platform_fraction: float | None, margin_gib: float = 0.0) -> float:
    """Cap this process's allocator on ``device`` at its memory less the headroom (and at the
    platform's fraction), less ``margin_gib`` more for the probe."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = 1.0 - cfg.trainer.memory_headroom_gib * GIB / total
    if platform_fraction is not None:
        fraction = min(fraction, platform_fraction)
    fraction -= margin_gib * GIB / total
    if fraction <= 0:
        raise ConfigError(f"trainer.memory_headroom_gib ({cfg.trainer.memory_headroom_gib}) leaves no memory on "
                          f"a {total / GIB:.1f} GiB GPU")
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    log.info("GPU %d: allocator capped at %.1f of %.1f GiB (headroom %.1f GiB, margin %.1f GiB, platform fraction %s, "
             "%s=%s)", device, fraction * total / GIB, total / GIB, cfg.trainer.memory_headroom_gib, margin_gib,
             platform_fraction, ALLOC_CONF_ENV, os.environ.get(ALLOC_CONF_ENV))
    return fraction

