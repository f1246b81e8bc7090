"""RunFab entry point and local command line: config in, Lightning Trainer out.

RunFab imports this file, calls ``probe_batch(microbatch)`` in fresh processes, then
``train(microbatch, accumulation)`` with records on stdin. ``python train.py`` runs the very
same path locally. Importing it only defines things: no stdin, no CUDA, no files, no model.

stdout carries RunFab's metric lines and nothing else; everything for people goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import importlib.util
import json
import logging
import numbers
import os
import shutil
import sys
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

import attention_kernels
import hostmem
import launcher
from callbacks.export import ExportModel
from callbacks.graceful_stop import GracefulStop
from callbacks.observe import ObservationWindows
from callbacks.run_record import RunRecord, sha256_file
from callbacks.runfab_metrics import NonFiniteLossError, RunFabMetrics, peak_memory
from config import (
    BUNDLE_ROOT, ConfigError, RunConfig, as_dict, bundle_path, load_config, load_config_dict, training_time_limit,
)
from datamodule import (
    Row, StreamingDataModule, StreamSettings, UnusableInputError, UpdateFeeder, ValidationPool, collate_rows, open_input,
    summary_line,
)
from lit_module import LitGPT
from model import GPT, count_parameters, training_flops
from tokenizer import TextEncoder

EFFECTIVE_BATCH_SIZE = 32

PROBE_PASSES = 2  # over the probe batches: the second pass runs with the optimizer state allocated
USER_ERRORS = (
    ConfigError, UnusableInputError, NonFiniteLossError, FileNotFoundError, launcher.WorkerFailed, launcher.Interrupted,
    launcher.InputFailed,
)

log = logging.getLogger("train")


# ----------------------------------------------------------------------------- RunFab hooks


def probe_batch(microbatch: int) -> None:
    """Fit ``microbatch`` worst-case rows with the real model and optimizer; CUDA OOM propagates."""
    run_probe(load_config(), microbatch)


def train(microbatch: int, accumulation: int) -> dict:
    """Train on stdin (or the bundled sample) with RunFab's choice of batch split, then export."""
    return run_training(load_config(), microbatch, accumulation)


# ----------------------------------------------------------------------------- building blocks


def world_size(cfg: RunConfig) -> int:
    """Data-parallel ranks: ``trainer.devices`` if set, else every visible GPU (1 on CPU)."""
    if cfg.trainer.devices is not None:
        return cfg.trainer.devices
    return max(1, torch.cuda.device_count()) if resolve_accelerator(cfg) == "gpu" else 1


def local_device() -> int:
    """This process's CUDA index: its local rank in a worker (set by launcher.py), else 0."""
    return int(os.environ.get("LOCAL_RANK", 0))


def check_batch(microbatch: int, accumulation: int, world: int) -> None:
    for name, value in (("microbatch", microbatch), ("accumulation", accumulation)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ConfigError(f"{name} must be a whole number of rows, not {value!r} ({type(value).__name__})")
    if microbatch < 1 or accumulation < 1 or microbatch * accumulation * world != EFFECTIVE_BATCH_SIZE:
        raise ConfigError(
            f"microbatch ({microbatch}) x accumulation ({accumulation}) x GPUs ({world}) must equal "
            f"EFFECTIVE_BATCH_SIZE ({EFFECTIVE_BATCH_SIZE}) rows per optimizer update"
        )


def resolve_accelerator(cfg: RunConfig) -> str:
    if cfg.trainer.accelerator != "auto":
        return cfg.trainer.accelerator
    return "gpu" if torch.cuda.is_available() else "cpu"


def resolve_precision(cfg: RunConfig, accelerator: str) -> str:
    return cfg.trainer.precision or ("bf16-mixed" if accelerator == "gpu" else "32-true")


def setup_process(cfg: RunConfig) -> None:
    """Logging to stderr, quiet about what we chose on purpose, seeded."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[%(asctime)s %(name)s] %(message)s")
    for name in ("train", "datamodule", "callbacks", "model", "attention_kernels", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.INFO)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*Consider setting `persistent_workers`.*")
    L.seed_everything(cfg.seed, verbose=False)


def lightning_trainer(cfg: RunConfig, accelerator: str, world: int, **overrides) -> L.Trainer:
    """The Trainer arguments shared by training and the probe, so both run the same settings.

    With several ranks the processes already exist (launcher.py started them), so Lightning's
    DDP strategy joins them instead of launching any.
    """
    arguments = dict(
        accelerator=accelerator,
        devices=world,
        strategy="auto" if world == 1 else ddp_strategy(cfg, accelerator),
        precision=resolve_precision(cfg, accelerator),
        max_epochs=1,  # the stream is one pass
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        gradient_clip_val=None,  # LitGPT.configure_gradient_clipping clips with optim.grad_clip
    )
    arguments.update(overrides)
    return L.Trainer(**arguments)


class SameStreamDDP(L.pytorch.strategies.DDPStrategy):
    """Lightning wraps the model in DDP on a side CUDA stream; DDP keeps the gradient accumulators it
    made there, and PyTorch then warns at every backward that their stream does not match the
    stream producing the gradients ("may incur unnecessary synchronization"; its advice: wrap on the
    stream the forward runs on). This wraps on the current stream, as that warning asks."""

    def _setup_model(self, model):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)


def ddp_strategy(cfg: RunConfig, accelerator: str) -> L.pytorch.strategies.DDPStrategy:
    """DDP joining the launcher's processes. Gradients are views into DDP's buckets (no copy into
    them, one gradient-sized buffer less per GPU); buckets of ``trainer.ddp_bucket_cap_mb``."""
    return SameStreamDDP(
        process_group_backend="nccl" if accelerator == "gpu" else "gloo",
        gradient_as_bucket_view=True, bucket_cap_mb=cfg.trainer.ddp_bucket_cap_mb,
    )


def build_module(cfg: RunConfig, device: torch.device | None) -> LitGPT:
    """The LightningModule, its weights initialized on ``device``: on a GPU no full fp32 copy of the
    model is ever made in host memory, and no core spends seconds drawing 127M random numbers."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return LitGPT(cfg.model, cfg.optim)


def check_host_memory(cfg: RunConfig, world: int, in_workers: bool) -> None:
    """Refuse, before any data is read or worker started, a GPU count whose host memory cannot fit."""
    if resolve_accelerator(cfg) != "gpu":
        return  # the projection is of CUDA processes; CPU workers hold far less
    problem = hostmem.host_budget_problem(cfg.trainer.host_memory_budget_gib, world, in_workers)
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
    attention_kernels.use_cache_folder(folder)  # FA4's kernels, compiled at first use
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1 if world > 1 else min(2, len(os.sched_getaffinity(0)))


def inductor_default_cache() -> Path:
    """The folder inductor picks when TORCHINDUCTOR_CACHE_DIR is unset (/tmp/torchinductor_<user>)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir())


# ----------------------------------------------------------------------------- GPU memory limits
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
    fraction = 1.0 - cfg.trainer.memory_headroom_gib * 2**30 / total
    if platform_fraction is not None:
        fraction = min(fraction, platform_fraction)
    fraction -= margin_gib * 2**30 / total
    if fraction <= 0:
        raise ConfigError(f"trainer.memory_headroom_gib ({cfg.trainer.memory_headroom_gib}) leaves no memory on "
                          f"a {total / 2**30:.1f} GiB GPU")
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    log.info("GPU %d: allocator capped at %.1f of %.1f GiB (headroom %.1f GiB, margin %.1f GiB, platform fraction %s, "
             "%s=%s)", device, fraction * total / 2**30, total / 2**30, cfg.trainer.memory_headroom_gib, margin_gib,
             platform_fraction, ALLOC_CONF_ENV, os.environ.get(ALLOC_CONF_ENV))
    return fraction


def experiment_loggers(cfg: RunConfig, folder: Path) -> list:
    """Lightning loggers named in ``observe.loggers``; they receive the metric lines, never stdout."""
    loggers = []
    for name in cfg.observe.loggers:
        if name == "csv":
            loggers.append(L.pytorch.loggers.CSVLogger(folder, name="csv"))
        elif name == "tensorboard":
            if not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
                raise ConfigError("observe.loggers has tensorboard, which is not installed: pip install tensorboard")
            loggers.append(L.pytorch.loggers.TensorBoardLogger(folder, name="tensorboard"))
        elif name == "wandb":
            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("observe.loggers has wandb, which is not installed: pip install wandb, then wandb login")
            os.environ.setdefault("WANDB_CONSOLE", "off")  # W&B must not wrap stdout, which carries RunFab's lines
            loggers.append(L.pytorch.loggers.WandbLogger(save_dir=folder, project=os.environ.get("WANDB_PROJECT", "runfab")))
    return loggers


# ----------------------------------------------------------------------------- output folder

LOCK_NAME = ".run.lock"
PREVIOUS_MODEL = "previous-model"


@contextlib.contextmanager
def claimed_output(root: Path):
    """Hold the output folder for one run: a second run on it is refused (its model and metrics
    would mix with this one's), and a model left by an earlier run is moved to ``previous-model/``
    so that ``model/`` only ever holds this run's result, or nothing if this run fails early."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = (root / LOCK_NAME).open("a+")
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"the output root {root} is a file, not a folder; set RUNFABRIC_OUTPUT (or output.root) "
                          "to a folder") from None
    except OSError as error:
        raise ConfigError(f"cannot write to the output root {root} ({error.strerror}); set RUNFABRIC_OUTPUT "
                          "(or output.root) to a writable folder") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            raise ConfigError(f"another run (pid {holder}) is using the output folder {root}; give each run its own "
                              "RUNFABRIC_OUTPUT (or output.root), or wait until it ends") from None
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        model_dir = root / "model"
        if model_dir.exists():
            previous = root / PREVIOUS_MODEL
            shutil.rmtree(previous, ignore_errors=True)
            model_dir.rename(previous)
            log.warning("an earlier run's model was in %s; it is now in %s", model_dir, previous)
        try:
            yield
        finally:
            (root / LOCK_NAME).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- training


def stream_settings(cfg: RunConfig, encoder: TextEncoder, microbatch: int, accumulation: int, world: int) -> StreamSettings:
    return StreamSettings(
        data=cfg.data, seq_len=cfg.model.max_seq_len, vocab_size=cfg.model.vocab_size, eos_id=encoder.eos_id,
        seed=cfg.seed, microbatch=microbatch, accumulation=accumulation, world_size=world,
        max_updates=cfg.trainer.max_steps if cfg.trainer.max_steps > 0 else None,
    )


def load_encoder(cfg: RunConfig) -> TextEncoder:
    path = bundle_path(cfg.data.tokenizer)
    if not path.is_file():
        raise ConfigError(f"data.tokenizer {path} not found; train one with `python train.py tokenizer`")
    encoder = TextEncoder(path, num_threads=cfg.data.tokenizer_threads)
    if encoder.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer {path.name} has {encoder.vocab_size} tokens but model.vocab_size is "
            f"{cfg.model.vocab_size}; the model's vocabulary must be at least the tokenizer's"
        )
    return encoder


def check_output_budget(cfg: RunConfig) -> None:
    """Refuse, before any training, a run whose deliverables cannot fit RunFab's output space.

    The export is fp32 safetensors (4 bytes a parameter); a Lightning checkpoint holds weights
    and AdamW's two moments (12 bytes a parameter), twice while the newest replaces the last.
    Observation files get 8x what the reference model's took on an H200: 2.1 MB of trace per
    profiled update, 0.9 MB per memory snapshot.
    """
    with torch.device("meta"):  # the real parameter count, without allocating anything
        parameters = count_parameters(GPT(cfg.model))
    need = 4 * parameters + (2 * 12 * parameters if cfg.trainer.checkpoint_every_steps > 0 else 0)
    observed = len(cfg.observe.profiled()) * (16 << 20) + ((8 << 20) if cfg.observe.memory_update > 0 else 0)
    if need + observed > cfg.output.budget_bytes:
        raise ConfigError(
            f"the output would need about {(need + observed) / 2**30:.2f} GiB (model export"
            f"{', two checkpoints' if cfg.trainer.checkpoint_every_steps > 0 else ''}"
            f"{', observation files' if observed else ''}) but output.budget_bytes allows "
            f"{cfg.output.budget_bytes / 2**30:.2f} GiB; disable trainer.checkpoint_every_steps, profile fewer "
            "updates (observe.profile_updates) or shrink the model"
        )


def run_training(cfg: RunConfig, microbatch: int, accumulation: int, stdin=None) -> dict:
    """Validate, then train in this process (one device) or through data-parallel workers."""
    world = world_size(cfg)
    check_batch(microbatch, accumulation, world)
    check_output_budget(cfg)
    in_workers = world > 1 or bool(cfg.trainer.worker_processes)
    check_host_memory(cfg, world, in_workers)
    setup_process(cfg)
    with claimed_output(Path(cfg.output.root)):
        use_allocator_settings(cfg)
        platform_fraction = platform_memory_fraction()
        encoder = load_encoder(cfg)
        settings = stream_settings(cfg, encoder, microbatch, accumulation, world)
        feeder = UpdateFeeder(
            lambda: open_input(bundle_path(cfg.data.sample_path), stdin, cfg.data.source), settings,
            encoder.encode_batch_arrays, ValidationPool(cfg.data.val_max_tokens),
            report_every=cfg.metrics.interval_seconds if world > 1 else None,
        )
        if in_workers:
            result = train_data_parallel(cfg, microbatch, accumulation, world, feeder, platform_fraction)
        else:
            datamodule = StreamingDataModule(
                feeder.iterate, feeder.pool, settings, pin_memory=resolve_accelerator(cfg) == "gpu",
                on_teardown=feeder.stop,
            )
            result = fit(cfg, microbatch, accumulation, world, datamodule, encoder, feeder.close, platform_fraction,
                         end_input=feeder.finish, early_end=lambda: feeder.early_end)
        result["input"] = feeder.close()
        log.info(summary_line(feeder.stats))
        raise_if_ended_early(feeder, result)
    return result


def raise_if_ended_early(feeder: UpdateFeeder, result: dict) -> None:
    """A run cut short by a signal or by its input fails, after the model trained so far was exported."""
    if feeder.early_end is None:
        return
    where = (f"stopped after optimizer step {result['steps']}; the model trained so far is in {result['model_dir']} "
             f"(run_record.json status: partial)" if result["steps"] else "stopped before the first optimizer step; "
             "nothing was trained, so no model was exported")
    if feeder.input_error is not None:
        raise launcher.InputFailed(f"the input failed: {type(feeder.input_error).__name__}: {feeder.input_error}; "
                                   + where) from feeder.input_error
    raise launcher.Interrupted(f"received {feeder.early_end}: {where}")


def fit(cfg: RunConfig, microbatch: int, accumulation: int, world: int, datamodule: StreamingDataModule,
        encoder: TextEncoder, input_summary=None, platform_fraction: float | None = None,
        end_input=lambda reason: None, early_end=lambda: None) -> dict:
    """Build module, callbacks and Trainer, and fit: the same in a single process and in each worker.

    Export and the run record happen in callbacks, on global rank 0. ``end_input(reason)`` ends the
    input at the next update boundary (a signal); ``early_end()`` says why it ended early, if it did,
    which the run record reports as ``partial``.
    """
    accelerator = resolve_accelerator(cfg)
    on_gpu = accelerator == "gpu"
    host_memory = hostmem.HostMemory()
    if on_gpu:
        limit_gpu_memory(cfg, local_device(), platform_fraction)
        host_memory.stage("CUDA initialized")
    model_dir = Path(cfg.output.root) / "model"
    compiled = cfg.trainer.compile if cfg.trainer.compile is not None else on_gpu
    tokenizer_path = bundle_path(cfg.data.tokenizer)
    static = {
        "seed": cfg.seed,
        "config": as_dict(cfg),
        "batch": {"effective": EFFECTIVE_BATCH_SIZE, "microbatch": microbatch, "accumulation": accumulation,
                  "world_size": world, "tokens_per_update": EFFECTIVE_BATCH_SIZE * cfg.model.max_seq_len},
        "tokenizer": {"path": cfg.data.tokenizer, "sha256": sha256_file(tokenizer_path),
                      "vocab_size": encoder.vocab_size, "eos_id": encoder.eos_id, "backend": encoder.backend},
    }
    run_dir = Path(cfg.output.root) / "run"
    validate = cfg.trainer.val_every_steps > 0 and cfg.data.val_fraction > 0
    metrics = RunFabMetrics(
        cfg.metrics.interval_seconds, stream=sys.stdout,
        flops=functools.partial(training_flops, cfg.model) if on_gpu else None, peak_flops=cfg.metrics.peak_flops,
        warmup_updates=cfg.observe.warmup_updates, observed_updates=cfg.observe.observed_updates(),
        log_path=run_dir / "metrics.jsonl", validate_every=cfg.trainer.val_every_steps if validate else 0,
    )
    callbacks: list[L.Callback] = [
        ObservationWindows(cfg.observe, run_dir),  # before the metrics: writing a trace counts as observed time
        metrics,
        ExportModel(model_dir, tokenizer_path),
        RunRecord(model_dir, BUNDLE_ROOT, static, input_summary, compiled, early_end),
        GracefulStop(end_input),
        host_memory,
    ]
    every = cfg.trainer.checkpoint_every_steps
    if every > 0:
        checkpoint_dir = Path(cfg.output.root) / "checkpoints"
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=every, save_top_k=1))
    progress = cfg.trainer.progress_bar if cfg.trainer.progress_bar is not None else sys.stderr.isatty()
    trainer = lightning_trainer(
        cfg, accelerator, world,
        max_steps=cfg.trainer.max_steps, max_time=training_time_limit(cfg),
        accumulate_grad_batches=accumulation,
        val_check_interval=cfg.trainer.val_every_steps * accumulation if validate else None,
        limit_val_batches=(cfg.trainer.val_batches or 1.0) if validate else 0,
        enable_checkpointing=every > 0,
        enable_progress_bar=progress,
        default_root_dir=cfg.output.root,
        callbacks=callbacks,
        logger=experiment_loggers(cfg, run_dir / "logs") or False,
    )
    module = build_module(cfg, torch.device("cuda", local_device()) if on_gpu else None)
    host_memory.stage("model built")
    if compiled:
        prepare_compile(Path(cfg.output.root) / "data" / "compile-cache", world)
        module.model.compile_trunk()
    log.info("model: %d parameters; %s on %s; microbatch %d x accumulation %d x %d device(s)",
             count_parameters(module.model), trainer.precision, accelerator,
             microbatch, accumulation, world)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # Lightning's bar and tables default to stdout
            trainer.fit(module, datamodule=datamodule)
    except SIGTERMException:  # Lightning's own handler: the signal came before training started
        raise launcher.Interrupted("received SIGTERM before training started; nothing was trained") from None
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(
            f"CUDA ran out of memory at optimizer step {trainer.global_step} with microbatch {microbatch} "
            f"(x accumulation {accumulation} x {world} device(s)), after the probe had passed. Rows with many short "
            "documents or a fragmented allocator can need more than the probe's worst case: rerun with a smaller "
            "microbatch, or set model.activation_checkpointing: true. Original error: " + str(error)
        ) from error
    log.info("finished: %d optimizer steps; model in %s", trainer.global_step, model_dir)
    return {"steps": trainer.global_step, "model_dir": str(model_dir), "metrics": metrics.last_record}


# ----------------------------------------------------------------------------- data parallel


def train_data_parallel(cfg: RunConfig, microbatch: int, accumulation: int, world: int, feeder: UpdateFeeder,
                        platform_fraction: float | None = None) -> dict:
    """This process feeds; ``world`` workers train. Waits for all, or fails with the first failure."""
    listener, authkey = launcher.new_listener()
    spec = {"config": as_dict(cfg), "microbatch": microbatch, "accumulation": accumulation,
            "address": list(listener.address), "authkey": authkey.hex(), "platform_memory_fraction": platform_fraction}
    restore_signals = launcher.raise_on_signals(first=feeder.finish)
    group = launcher.WorkerGroup(world, spec, BUNDLE_ROOT)
    try:
        launcher.serve_feeder(feeder, listener, world)
        group.wait(feeder_error=lambda: feeder.error, on_first_exit=feeder.stop)
    finally:
        feeder.stop()
        listener.close()
        group.stop()
        restore_signals()
    model_dir = Path(cfg.output.root) / "model"
    record_path = model_dir / "run_record.json"
    if not record_path.is_file():  # stopped before the first update: nothing was exported
        return {"steps": 0, "model_dir": str(model_dir), "metrics": {}}
    record = json.loads(record_path.read_text())
    record["input"] = feeder.close()  # the feeder, not the workers, saw the input
    record_path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return {"steps": record["optimizer_steps"], "model_dir": str(model_dir), "metrics": record["final_metrics"]}


def run_worker() -> int:
    """``python train.py worker``: one data-parallel rank, started by train_data_parallel or run_probe."""
    launcher.exit_with_parent()
    hostmem.record_stage("worker started, modules imported")
    spec = launcher.worker_spec()
    cfg = load_config_dict(spec["config"])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    setup_process(cfg)
    if resolve_accelerator(cfg) == "gpu":
        torch.set_num_threads(1)  # a GPU worker only launches kernels; RunFab's 2 cores serve feeder and workers
    platform_fraction = spec.get("platform_memory_fraction")
    if spec.get("probe"):
        run_probe_local(cfg, spec["microbatch"], world, platform_fraction)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # a probe keeps nothing: skip the interpreter's teardown of CUDA, NCCL and modules (seconds)
    encoder = load_encoder(cfg)
    settings = stream_settings(cfg, encoder, spec["microbatch"], spec["accumulation"], world)
    pool = ValidationPool(cfg.data.val_max_tokens)
    connection = launcher.FeederConnection(tuple(spec["address"]), bytes.fromhex(spec["authkey"]), rank, pool)
    datamodule = StreamingDataModule(
        connection.batches, pool, settings, rank=rank, pin_memory=resolve_accelerator(cfg) == "gpu",
        on_teardown=connection.close,
    )
    fit(cfg, spec["microbatch"], spec["accumulation"], world, datamodule, encoder, platform_fraction=platform_fraction,
        early_end=lambda: connection.early_end)
    return 0


# ----------------------------------------------------------------------------- probe


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


def run_probe(cfg: RunConfig, microbatch: int) -> dict:
    """Two real optimizer steps (the second with AdamW state allocated) on worst-case rows, on every device.

    With several devices the probe runs in one worker per device under the same data-parallel
    setup as training; a worker's CUDA out-of-memory error is raised here as one. Reads no stdin,
    writes no files, leaves no process.
    """
    if not 1 <= microbatch <= EFFECTIVE_BATCH_SIZE:
        raise ConfigError(f"microbatch must lie in 1..{EFFECTIVE_BATCH_SIZE}, not {microbatch}")
    world = world_size(cfg)
    check_host_memory(cfg, world, world > 1 or bool(cfg.trainer.worker_processes))
    setup_process(cfg)
    use_allocator_settings(cfg)
    platform_fraction = platform_memory_fraction()
    if world == 1 and not cfg.trainer.worker_processes:
        return run_probe_local(cfg, microbatch, 1, platform_fraction)
    restore_signals = launcher.raise_on_signals()
    spec = {"config": as_dict(cfg), "microbatch": microbatch, "probe": True, "platform_memory_fraction": platform_fraction}
    group = launcher.WorkerGroup(world, spec, BUNDLE_ROOT)
    try:
        group.wait()
    except launcher.WorkerFailed as failure:
        if "OutOfMemoryError" in str(failure):
            raise torch.OutOfMemoryError(str(failure)) from None
        raise
    finally:
        group.stop()
        restore_signals()
    return {"microbatch": microbatch, "world_size": world}


def run_probe_local(cfg: RunConfig, microbatch: int, world: int, platform_fraction: float | None = None,
                    compiled: bool = False) -> dict:
    """The probe in this process: one device, or one rank of ``world``. Accumulates over two
    microbatches when the effective batch allows, so gradients are held while the next forward
    runs, as in training. The GPU memory cap is training's (limit_gpu_memory).

    It runs eager, to stay far inside RunFab's 120 s, under a cap ``trainer.probe_margin_gib``
    tighter than training's: the compiled model training runs may need a little more (the
    benchmark's --memory-sweep measures how much; ``compiled`` exists for it)."""
    accelerator = resolve_accelerator(cfg)
    # Taken now: after fit, Lightning has moved the module back to the CPU.
    device = torch.device("cuda", local_device()) if accelerator == "gpu" else torch.device("cpu")
    if accelerator == "gpu":
        limit_gpu_memory(cfg, device.index, platform_fraction, 0.0 if compiled else cfg.trainer.probe_margin_gib)
    accumulation = 2 if EFFECTIVE_BATCH_SIZE // (microbatch * world) >= 2 else 1
    kinds = probe_batches(microbatch, cfg.model.max_seq_len, cfg.model.vocab_size, accumulation * world)
    batches = DataLoader(kinds * PROBE_PASSES, batch_size=None)
    trainer = lightning_trainer(
        cfg, accelerator, world, max_steps=len(kinds) * PROBE_PASSES // accumulation, accumulate_grad_batches=accumulation,
        limit_val_batches=0, enable_progress_bar=False, callbacks=[hostmem.HostMemory()],
    )
    module = build_module(cfg, device if accelerator == "gpu" else None)
    if compiled:
        module.model.compile_trunk()
    if accelerator == "gpu":
        torch.cuda.reset_peak_memory_stats()
    with contextlib.redirect_stdout(sys.stderr):
        trainer.fit(module, train_dataloaders=batches)
    result = {"microbatch": microbatch, "steps": trainer.global_step} | peak_memory(device)
    log.info("probe: %s", result)
    return result


# ----------------------------------------------------------------------------- command line


def parse_overrides(tokens: list[str]) -> list[str]:
    """``--model.n_layer 2`` or ``--model.n_layer=2`` -> ``model.n_layer=2`` (omegaconf dotlist)."""
    dotlist, i = [], 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) < 3:
            raise ConfigError(f"unexpected argument {token!r}; overrides look like --section.key VALUE")
        key = token[2:]
        if "=" in key:
            dotlist.append(key)
            i += 1
        elif i + 1 < len(tokens):
            dotlist.append(f"{key}={tokens[i + 1]}")
            i += 2
        else:
            raise ConfigError(f"override {token} has no value")
    return dotlist


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return run_worker()
    if argv[:1] in (["tokenizer"], ["package"], ["check"], ["emulate"], ["report"]):
        print(f"error: {argv[0]} is a tool, not part of training: run `python -m tools {argv[0]}`", file=sys.stderr)
        return 2
    command = argv.pop(0) if argv[:1] in (["fit"], ["probe"]) else "fit"
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Pretrain the GPT decoder on NDJSON records from stdin (or the bundled sample). "
        "Subcommands: fit (default), probe; the bundle tools run as `python -m tools`. Any --section.key VALUE overrides the config.",
    )
    parser.add_argument("--config", help="YAML config of the bundle (default: $RUNFAB_CONFIG or conf/config.yaml)")
    parser.add_argument("--microbatch", type=int, help="rows per microbatch (default: data.microbatch)")
    parser.add_argument("--accumulation", type=int, help="microbatches per update (default: what the batch implies)")
    known, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(known.config, parse_overrides(rest))
        world = world_size(cfg)
        microbatch = known.microbatch or (
            EFFECTIVE_BATCH_SIZE // (known.accumulation * world) if known.accumulation else cfg.data.microbatch
        )
        if command == "probe":
            run_probe(cfg, microbatch)
            return 0
        accumulation = known.accumulation or max(1, EFFECTIVE_BATCH_SIZE // (microbatch * world))
        run_training(cfg, microbatch, accumulation)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
