"""The run record: what ran, where, on which data and settings, and what came of it.

A small JSON kept beside the exported model, so a result can always be traced back to the
exact code, input and configuration that produced it. It is written into the export's staging
folder (callbacks/export.py), so a model folder never appears without its record.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import lightning as L
import torch

from model.kernels import gpu
from callbacks.observe import ObservationWindows
from callbacks.runfab_metrics import RunFabMetrics
from model.flops import count_parameters
from pipeline.fingerprints import sha256_file
from runfab import created_files
from runfab.limits import MIB
from runfab.shipping import folder_bytes, shipped_files, source_commit

log = logging.getLogger(__name__)

LIBRARIES = ("torch", "lightning", "transformers", "tokenizers", "tiktoken", "safetensors", "torchmetrics", "omegaconf",
             "numpy", "flash-attn-4", "quack-kernels", "nvidia-cutlass-dsl")


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["cuda"] = torch.version.cuda
    return versions


def source_hashes(root: Path) -> dict[str, str]:
    """SHA-256 of the bundle's code and configuration, which is what actually ran.

    These are the shipped files (``shipping.shipped_files``) less the data sample under ``data/``, which is
    input rather than code: the record's ``input`` section fingerprints what was read.
    """
    return {rel: sha256_file(root / rel) for rel in shipped_files(root)
            if not rel.startswith("data/") and (root / rel).is_file()}


def dataset_descriptor(root: Path) -> dict | None:
    """RunFab's runfabric.dataset.json (source, revision, split) when the bundle has one."""
    path = root / "runfabric.dataset.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        return {"unreadable": str(error)}


RECORD_NAME = "run_record.json"


def optimizers_held(trainer: L.Trainer) -> list[dict]:
    """Each optimizer that steps the model (AdamW alone, or Muon and AdamW under optim.name muon): its first
    group's peak learning rate, how many parameters it holds, and each of its groups' peak learning rate,
    weight decay and parameters (AdamW's embeddings and head have a group of their own under optim.embed_lr
    and optim.head_lr)."""
    def peak(group: dict) -> float:
        return group.get("initial_lr", group["lr"])

    held = []
    for optimizer in trainer.optimizers:
        for part in getattr(optimizer, "optimizers", (optimizer,)):
            groups = [{"lr": peak(g), "weight_decay": g.get("weight_decay", 0.0),
                       "parameters": sum(p.numel() for p in g["params"])} for g in part.param_groups]
            held.append({"name": type(part).__name__, "lr": groups[0]["lr"],
                         "parameters": sum(g["parameters"] for g in groups), "groups": groups})
    return held


def logger_locations(trainer: L.Trainer) -> dict[str, dict]:
    """Where each of the Trainer's loggers keeps the run: its folder, and for W&B the run's page (its URL;
    none when W&B runs offline, whose folder ``wandb sync`` uploads later)."""
    from lightning.pytorch.loggers import WandbLogger

    found: dict[str, dict] = {}
    for logger in trainer.loggers:
        if not isinstance(logger, WandbLogger):
            found[type(logger).__name__] = {"folder": getattr(logger, "log_dir", None)}
            continue
        run = getattr(sys.modules.get("wandb"), "run", None)  # the logger's run, started with its first point
        if run is None:
            continue
        try:
            url = run.url
        except Exception:  # noqa: BLE001 - an offline run has no page, and some W&B versions raise for it
            url = None
        found["wandb"] = {"url": url or None, "folder": str(Path(run.dir).parent) if run.dir else None}
    return found


class RunRecord:
    """Builds ``run_record.json`` when training ends; the export writes it with the model (``write``)."""

    def __init__(self, bundle_root: Path, static: dict, input_summary, compiled: bool = False,
                 early_end=lambda: None, metrics: RunFabMetrics | None = None,
                 observer: ObservationWindows | None = None, sections=lambda: {}) -> None:
        """``input_summary()`` gives what happened to the input; ``early_end()`` why training ended
        before its input or limit (a signal, an input error), or None: the status is then
        ``partial: <why>``. ``metrics`` and ``observer`` are the run's other callbacks, whose
        figures and files the record reports; ``sections()`` gives more of the record's sections."""
        self.compiled = compiled  # training compiles: report the size of its caches
        self.bundle_root = Path(bundle_root)
        self.static = static  # config, batch settings, tokenizer: known before training
        self.input_summary = input_summary
        self.metrics, self.observer = metrics, observer
        self.started = time.time()
        self.early_end = early_end
        self.sections = sections

    @property
    def status(self) -> str:
        why = self.early_end()
        return f"partial: {why}" if why else "completed"

    def build(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        gpu = torch.cuda.get_device_name(pl_module.device) if pl_module.device.type == "cuda" else None
        metrics, observer = self.metrics, self.observer
        return {
            "status": self.status,
            "started_unix": round(self.started, 3),
            "wall_seconds": round(time.time() - self.started, 3),
            **self.static,
            "precision": trainer.precision,
            "world_size": trainer.world_size,
            "optimizer_steps": trainer.global_step,
            "model_family": pl_module.model.config.family,
            "parameters": count_parameters(pl_module.model),
            "optimizers": optimizers_held(trainer),
            "final_metrics": metrics.last_record if metrics else None,
            "summary": metrics.summary(trainer, pl_module) if metrics else None,
            "observations": observer.files if observer else [],
            "loggers": logger_locations(trainer),
            "compile_cache": self.compile_cache_usage(),
            "kernels": pl_module.model.kernels_used(),
            "input": self.input_summary() if self.input_summary else None,
            "dataset": dataset_descriptor(self.bundle_root),
            "environment": {
                "libraries": library_versions(),
                "platform": platform.platform(),
                "gpu": gpu,
                "argv": sys.argv,
            },
            "sources_sha256": source_hashes(self.bundle_root),
            "git": source_commit(self.bundle_root),  # null in an unpacked bundle: the hashes identify the code
            **self.sections(),
        }

    def compile_cache_usage(self) -> dict | None:
        """Where the compile caches went and their size: they share RunFab's 3 GiB of output with the
        model (runtime.device_policy.prepare_compile puts them there, unless the environment names other folders)."""
        if not self.compiled:
            return None
        usage = {}
        folders = {name: Path(os.environ[variable]) if variable in os.environ else None
                   for name, variable in (("inductor", "TORCHINDUCTOR_CACHE_DIR"), ("triton", "TRITON_CACHE_DIR"))}
        folders |= gpu.cache_usage_folders()  # FlashAttention 4's and the CuTe DSL's, when training wrote them
        for name, folder in folders.items():
            if folder is not None and folder.is_dir():
                usage[name] = {"path": str(folder), "bytes": folder_bytes(folder)}
                log.info("%s compile cache: %.1f MiB in %s", name, usage[name]["bytes"] / MIB, folder)
        return usage

    def write(self, trainer: L.Trainer, pl_module: L.LightningModule, folder: Path) -> Path:
        """Write the record into ``folder``: the staging folder of the model export, published with it."""
        path = folder / RECORD_NAME
        created_files.write_text(path, json.dumps(self.build(trainer, pl_module), indent=2, default=str) + "\n")
        log.debug("run record written with the model (%s)", RECORD_NAME)
        return path
