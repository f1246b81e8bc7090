"""RunFab's memory probe: the real model and optimizer, worst-case rows, two optimizer steps, every device.

Reads no stdin, writes no files, prints no metrics, leaves no process; a CUDA out-of-memory
error propagates so RunFab can reject the microbatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import numbers
import sys

import numpy as np
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from callbacks.memory_stages import MemoryStages
from runtime import launcher
from runtime.batch_split import probe_accumulation
from callbacks.runfab_metrics import peak_memory
from config import BUNDLE_ROOT, ConfigError, RunConfig, as_dict
from model.kernels import attention
from pipeline.packing import Row, collate_rows
from runtime.device_policy import (
    build_module, check_host_memory, limit_gpu_memory, local_device, platform_memory_fraction,
    resolve_accelerator, setup_process, use_allocator_settings, world_size,
)
from runtime.trainer import build_trainer

log = logging.getLogger(__name__)

PROBE_PASSES = 2  # over the probe batches: the second pass runs with the optimizer state allocated


def probe_batches(microbatch: int, seq_len: int, vocab_size: int, update_microbatches: int) -> list[dict]:
    """Full rows through both attention paths training takes: one document per row (fused causal
    SDPA, the most attention work) and two documents per row (the varlen kernel), built by the
    training collate so they are what training sees."""
    rng = np.random.default_rng(0)
    whole = np.arange(seq_len, dtype=np.int32)
    halves = np.concatenate([np.arange(seq_len // 2), np.arange(seq_len - seq_len // 2)]).astype(np.int32)
    batches = []
    for positions in (whole, halves):
        rows = [Row(rng.integers(0, vocab_size, seq_len, dtype=np.int32), positions) for _ in range(microbatch)]
        batch = collate_rows(rows)
        batch["update_target_tokens"] = batch["target_tokens"] * update_microbatches
        batches.append(batch)
    return batches


def probe_model_config(cfg: RunConfig) -> RunConfig:
    """The configuration the eager probe builds: with ``compute.attention: auto``, PyTorch's flash kernels
    (varlen and fused causal SDPA) stand where training takes FA4. Their peak memory in the probe is
    FA4's (docs/PERFORMANCE.md) and they need no compilation, which costs FA4 seconds per probe; an
    explicit "fa4" is probed as it is, so a probe finds FA4 missing before training would. Without
    PyTorch's varlen kernel the packed rows would take SDPA's document mask (more memory): kept."""
    if cfg.compute.attention != "auto" or attention.varlen_attn is None:
        return cfg
    return dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, attention="varlen"))


def run_probe(cfg: RunConfig, microbatch: int, effective: int) -> dict:
    """Two real optimizer steps (the second with AdamW state allocated) on worst-case rows, on every device.

    With several devices the probe runs in one worker per device under the same data-parallel
    setup as training; a worker's CUDA out-of-memory error is raised here as one. Reads no stdin,
    writes no files, leaves no process.
    """
    if isinstance(microbatch, bool) or not isinstance(microbatch, numbers.Integral) or not 1 <= microbatch <= effective:
        raise ConfigError(f"microbatch must be a whole number in 1..{effective}, not {microbatch!r}")
    world = world_size(cfg)
    setup_process(cfg)  # first: the host-memory check logs its budget line
    check_host_memory(cfg, world, microbatch)
    use_allocator_settings(cfg)
    platform_fraction = platform_memory_fraction()
    if world == 1 and not cfg.trainer.worker_processes:
        return run_probe_local(cfg, microbatch, 1, effective, platform_fraction)
    spec = {"config": as_dict(cfg), "microbatch": microbatch, "effective": effective, "probe": True,
            "platform_memory_fraction": platform_fraction}
    with launcher.worker_group(world, spec, BUNDLE_ROOT, cfg.trainer.worker_start) as group:
        try:
            group.wait()
        except launcher.WorkerFailed as failure:
            if "OutOfMemoryError" in str(failure):
                raise torch.OutOfMemoryError(str(failure)) from None
            raise
    return {"microbatch": microbatch, "world_size": world}


def run_probe_local(cfg: RunConfig, microbatch: int, world: int, effective: int, platform_fraction: float | None = None,
                    compiled: bool = False) -> dict:
    """The probe in this process: one device, or one rank of ``world``. Accumulates over two
    microbatches when the effective batch allows, so gradients are held while the next forward
    runs, as in training. The GPU memory cap is training's (limit_gpu_memory).

    It runs eager, to stay far inside RunFab's 120 s, with PyTorch's attention kernels where
    training's choice is automatic (``probe_model_config``), under a cap ``trainer.probe_margin_gib``
    tighter than training's: the compiled model training runs may need a little more (the
    benchmark's --memory-sweep measures how much; ``compiled`` exists for it, and keeps training's
    kernels)."""
    if not compiled:
        cfg = probe_model_config(cfg)
    accelerator = resolve_accelerator(cfg)
    # Taken now: after fit, Lightning has moved the module back to the CPU.
    device = torch.device("cuda", local_device()) if accelerator == "gpu" else torch.device("cpu")
    if accelerator == "gpu":
        limit_gpu_memory(cfg, device.index, platform_fraction, 0.0 if compiled else cfg.trainer.probe_margin_gib)
    accumulation = probe_accumulation(effective, microbatch, world)
    kinds = probe_batches(microbatch, cfg.model.max_seq_len, cfg.model.vocab_size, accumulation * world)
    batches = DataLoader(kinds * PROBE_PASSES, batch_size=None)
    trainer = build_trainer(
        cfg, accelerator, world, max_steps=len(kinds) * PROBE_PASSES // accumulation, accumulate_grad_batches=accumulation,
        limit_val_batches=0, enable_progress_bar=False, callbacks=[MemoryStages()],
    )
    module = build_module(cfg, device if accelerator == "gpu" else None, compiled=compiled)
    if accelerator == "gpu":
        torch.cuda.reset_peak_memory_stats()
    with contextlib.redirect_stdout(sys.stderr):
        try:
            trainer.fit(module, train_dataloaders=batches)
            stopped = trainer.received_sigterm  # a SIGTERM after Lightning's last look still stops the probe
        except SIGTERMException:  # Lightning's handler ends fit by a SystemExit without a code: exit status 0
            stopped = True
    if stopped:
        raise launcher.Interrupted("received SIGTERM during the probe: it was stopped, so it has no result")
    result = {"microbatch": microbatch, "steps": trainer.global_step} | peak_memory(device)
    log.info("%s", found_sentence(result, device, world))
    log.info("probe figures: %s", json.dumps(result))  # for tools (tools/bundle/emulate.py reads the peaks)
    return result


def found_sentence(result: dict, device: torch.device, world: int) -> str:
    """What the probe found, for a person: it fitted, on what, at which peak."""
    where = f"rank {local_rank}'s {device}" if (local_rank := local_device()) or world > 1 else str(device)
    peak = (f", at a peak of {result['peak_allocated_gib']:.2f} GiB allocated and {result['peak_reserved_gib']:.2f} "
            "GiB reserved" if "peak_allocated_gib" in result else "")
    return (f"probe passed: microbatch {result['microbatch']} of worst-case rows trained {result['steps']} optimizer "
            f"steps on {where} without running out of memory{peak}")

