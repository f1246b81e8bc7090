"""One training run, from the output folder to the exported model: in this process on one device,
or as the feeder of data-parallel workers (launcher.py starts them; worker.py is one of them).

A run reads as its steps: ``run_training`` claims and budgets the output folder, loads the encoder
and starts the input; ``fit`` builds each component with its own builder (metrics, callbacks,
loggers, Trainer, module) and trains. What a run computes on and how much memory it may take is
device_policy.py's, the Trainer's arguments trainer.py's, the output folder output_folder.py's,
the batch split batch_split.py's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from callbacks.memory_stages import MemoryStages
from runtime import checkpoints, launcher
from runtime.batch_split import BatchSplit
from callbacks import owned_folders
from callbacks.export import ExportModel
from callbacks.fixed_validation import FixedValidation, ValidationBeforeTraining
from callbacks.history import History
from callbacks.graceful_stop import GracefulStop
from callbacks.observe import ObservationWindows
from callbacks.resume_fingerprint import ResumeFingerprint
from callbacks.progress import UpdateProgressBar
from callbacks.run_record import RunRecord
from callbacks.stop_checkpoint import StopCheckpoint
from callbacks.runfab_metrics import RunFabMetrics, ensure_stdout
from config import BUNDLE_ROOT, ConfigError, RunConfig, as_dict, bundle_path
from datamodule import StreamingDataModule
from pipeline import feeder_wire
from pipeline.feeder import UpdateFeeder
from pipeline.fingerprints import sha256_file
from pipeline.sources import open_input
from pipeline.records import UnusableInputError
from pipeline.resume import TrainedUpdates
from pipeline.stream import StreamSettings, summary_line
from pipeline.validation_split import HELD_OUT, ValidationPool, load_validation_file
from runtime.device_policy import (
    build_module, check_host_memory, compiles, limit_gpu_memory, local_device, platform_memory_fraction,
    preload_worker_modules, prepare_compile, resolve_accelerator, setup_process, use_allocator_settings,
)
from runtime.output_folder import (CHECKPOINTS, check_output_budget, check_output_space, checkpoint_folder,
                                   claimed_output, compile_folder, model_folder, release_now, run_folder)
from runtime.trainer import build_trainer, shows_progress, training_arguments, validates
from model.flops import count_parameters, training_flops
from pipeline.tokenizer import TextEncoder

log = logging.getLogger("train")


# ----------------------------------------------------------------------------- the run's steps


def run_training(cfg: RunConfig, split: BatchSplit, stdin=None, ckpt_path: str | None = None) -> dict:
    """Validate, then train in this process (one device) or through data-parallel workers; ``ckpt_path``
    (a checkpoint file, or ``last``) resumes from a checkpoint, reading the same input again."""
    root = Path(cfg.output.root)
    check_output_budget(cfg)
    setup_process(cfg)  # first: the host-memory check logs its budget line
    check_host_memory(cfg, split.ranks, split.microbatch)
    ensure_stdout()
    resume, trained = resume_point(cfg, split, ckpt_path)  # before the output moves: a refusal is one line
    with claimed_output(root, keep=(CHECKPOINTS,) if ckpt_path else ()):
        check_output_space(cfg, root)
        use_allocator_settings(cfg)
        platform_fraction = platform_memory_fraction()
        encoder = load_encoder(cfg)
        feeder = build_feeder(cfg, encoder, split, stdin, trained)
        if split.ranks > 1 or cfg.trainer.worker_processes:
            result = train_data_parallel(cfg, split, feeder, platform_fraction, resume)
        else:
            source = TrainingInput(build_stream_datamodule(cfg, feeder), summary=feeder.close, end=feeder.finish,
                                   early_end=lambda: feeder.early_end)
            result = fit(cfg, split, source, encoder, platform_fraction, ckpt_path=resume,
                         **stream_checkpoints(cfg, split, source.early_end))
        result["input"] = feeder.close()
        log.info(summary_line(feeder.stats))
        raise_if_ended_early(feeder, result, checkpoint_folder(cfg.output.root))
        # the run completed: the stop checkpoint is not needed
        checkpoints.remove_written(checkpoint_folder(cfg.output.root), checkpoints.STOP_CHECKPOINT)
    return result


def resume_point(cfg: RunConfig, split: BatchSplit, ckpt_path: str | None) -> tuple[str | None, TrainedUpdates | None]:
    """The checkpoint a run on stdin resumes from, and the updates it trained (which the feeder reads
    again, checks and skips: pipeline/resume.py); (None, None) for a new run. A checkpoint of another
    model, batch, optimizer setting or stream setting is refused here, before anything moves."""
    if ckpt_path is None:
        return None, None
    found = checkpoints.resolve(ckpt_path, checkpoint_folder(cfg.output.root))
    if found is None:
        return None, None
    path, stored = found
    checkpoints.refuse_changes(path, stored, stream_fingerprint(cfg, split))
    trained = checkpoints.trained_updates(stored)
    del stored
    log.info("the input's first %d update(s), which the checkpoint trained, are read again, checked against its "
             "history and not trained again", trained.count)
    return path, trained


def stream_fingerprint(cfg: RunConfig, split: BatchSplit) -> dict:
    """What a resume on stdin must not change (runtime/checkpoints.py)."""
    return checkpoints.fingerprint(cfg, split, checkpoints.stream_identity(cfg),
                                   sha256_file(bundle_path(cfg.data.tokenizer)), split.ranks)


def stream_checkpoints(cfg: RunConfig, split: BatchSplit, stopped_early: Callable[[], str | None]) -> dict:
    """``fit``'s arguments for the checkpoints of a run on stdin, when it writes any
    (``trainer.checkpoint_every_steps``): the periodic ones, and one when it stops early (a signal, a
    failing input), each with what a resume must not change, written durably (runtime/checkpoints.py)."""
    if cfg.trainer.checkpoint_every_steps <= 0:
        return {}
    stop = StopCheckpoint(checkpoint_folder(cfg.output.root) / checkpoints.STOP_CHECKPOINT, stopped_early)
    return {"extra_callbacks": (stop, ResumeFingerprint(stream_fingerprint(cfg, split))),
            "trainer_overrides": {"plugins": [checkpoints.DurableCheckpointIO()]}}


@dataclass
class TrainingInput:
    """What a run trains from and how the input side takes part: ``summary()`` describes what was read
    (for the run record), ``end(reason)`` ends the input at the next update boundary (a signal),
    ``early_end()`` says why it ended early if it did (the record's ``partial``), ``report_due(update)``
    says when several ranks report together (None: on its own clock), and ``validation``, when given,
    is the run's validation set (else the stream datamodule's ``pool``)."""

    datamodule: L.LightningDataModule
    summary: Callable[[], dict | None] = lambda: None
    end: Callable[[str], None] = lambda reason: None
    early_end: Callable[[], str | None] = lambda: None
    report_due: Callable[[int], bool] | None = None
    validation: ValidationPool | None = None

    def record(self) -> dict | None:
        """The run record's ``input``: the summary and how long training waited for the input."""
        summary = self.summary()
        return summary and summary | {"training_wait_seconds": round(self.datamodule.input_wait_seconds, 3)}


def fit(cfg: RunConfig, split: BatchSplit, source: TrainingInput, encoder: TextEncoder,
        platform_fraction: float | None = None, ckpt_path: str | None = None, extra_callbacks: tuple = (),
        trainer_overrides: dict | None = None) -> dict:
    """Build module, callbacks and Trainer, and fit: the same in a single process and in each worker.

    Export and the run record happen in callbacks, on global rank 0. The run from prepared shards
    (shard_run.py) resumes from ``ckpt_path``, adds ``extra_callbacks`` and sets the Trainer's
    ``trainer_overrides`` (devices per node, nodes).
    """
    accelerator = resolve_accelerator(cfg)
    host_memory = MemoryStages()
    if accelerator == "gpu":
        limit_gpu_memory(cfg, local_device(), platform_fraction)
        host_memory.stage("CUDA initialized")
    description = run_description(cfg, split, encoder)
    metrics = build_metrics(cfg, accelerator, source)
    callbacks = build_callbacks(cfg, accelerator, split, description, source, metrics, host_memory)
    trainer = build_trainer(
        cfg, accelerator, split.ranks, callbacks=[*callbacks, *extra_callbacks],
        logger=experiment_loggers(cfg, run_folder(cfg.output.root) / "logs") or False,
        **training_arguments(cfg, split) | (trainer_overrides or {}),
    )
    if compiles(cfg, accelerator):
        prepare_compile(compile_folder(cfg.output.root), split.ranks)
    module = build_training_module(cfg, accelerator)
    host_memory.stage("model built")
    log.info("model: %s, %d parameters; %s on %s; microbatch %d x accumulation %d x %d device(s)",
             cfg.model.family, count_parameters(module.model), trainer.precision, accelerator,
             split.microbatch, split.accumulation, split.ranks)
    train(trainer, module, source.datamodule, description, split, ckpt_path)
    model_dir = model_folder(cfg.output.root)
    log.info("finished: %d optimizer steps; %s", trainer.global_step,
             f"model in {model_dir}" if trainer.global_step else "no model exported")
    return {"steps": trainer.global_step, "model_dir": str(model_dir), "metrics": metrics.last_record}


# ----------------------------------------------------------------------------- one builder per component


def load_encoder(cfg: RunConfig) -> TextEncoder:
    path = bundle_path(cfg.data.tokenizer)
    if not path.is_file():
        raise ConfigError(f"data.tokenizer {path} not found; train one with `python -m tools tokenizer`")
    encoder = TextEncoder(path, num_threads=cfg.data.tokenizer_threads)
    if encoder.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer {path.name} has {encoder.vocab_size} tokens but model.vocab_size is "
            f"{cfg.model.vocab_size}; the model's vocabulary must be at least the tokenizer's"
        )
    return encoder


def stream_settings(cfg: RunConfig, encoder: TextEncoder, split: BatchSplit) -> StreamSettings:
    return StreamSettings(
        data=cfg.data, seq_len=cfg.model.max_seq_len, vocab_size=cfg.model.vocab_size, eos_id=encoder.eos_id,
        seed=cfg.seed, microbatch=split.microbatch, accumulation=split.accumulation, world_size=split.ranks,
        max_updates=cfg.trainer.max_steps if cfg.trainer.max_steps > 0 else None,
    )


def build_feeder(cfg: RunConfig, encoder: TextEncoder, split: BatchSplit, stdin=None,
                 trained: TrainedUpdates | None = None) -> UpdateFeeder:
    """The stream of updates from the input (stdin, or ``data.sample_path``), read beside training, past
    the ``trained`` ones of a resumed run. With several ranks it marks the updates that end with a metric
    line, so the ranks report together."""
    return UpdateFeeder(
        lambda: open_input(bundle_path(cfg.data.sample_path), stdin, cfg.data.source),
        stream_settings(cfg, encoder, split), encoder.encode_batch_arrays, validation_pool(cfg, encoder),
        report_every=cfg.metrics.interval_seconds if split.ranks > 1 else None,
        time_limit_seconds=limit.total_seconds() if (limit := cfg.trainer.time_limit()) is not None else None,
        trained=trained,
    )


def validation_pool(cfg: RunConfig, encoder: TextEncoder) -> ValidationPool:
    """The run's validation set: the file ``data.val_path`` read whole, or an empty set that the feeder
    gathers from the start of the input (pipeline/validation_split.py)."""
    if cfg.data.val_path is None:
        return ValidationPool(cfg.data.val_max_tokens)
    path = bundle_path(cfg.data.val_path)
    if not path.is_file():
        raise FileNotFoundError(f"data.val_path {path} is not a file; give NDJSON records (as training reads them), "
                                "or leave data.val_path null to hold documents out of the input")
    return load_validation_file(path, encoder.encode_batch_arrays, encoder.eos_id, cfg.model.vocab_size,
                                cfg.data.max_record_bytes, cfg.data.val_max_tokens)


def build_stream_datamodule(cfg: RunConfig, feeder: UpdateFeeder) -> StreamingDataModule:
    """Training batches from the feeder's queue in this process, validation from its held-out pool."""
    return StreamingDataModule(
        functools.partial(feeder.iterate, mark_waits=True), feeder.pool, feeder.settings,
        pin_memory=resolve_accelerator(cfg) == "gpu", on_teardown=feeder.stop,
    )


def run_description(cfg: RunConfig, split: BatchSplit, encoder: TextEncoder) -> dict:
    """What the run is, known before it starts: for the run record and the loggers' hyperparameters."""
    return {
        "seed": cfg.seed,
        "config": as_dict(cfg),
        "batch": split.as_dict() | {"tokens_per_update": split.effective * cfg.model.max_seq_len},
        "tokenizer": {"path": cfg.data.tokenizer, "sha256": sha256_file(bundle_path(cfg.data.tokenizer)),
                      "vocab_size": encoder.vocab_size, "eos_id": encoder.eos_id, "backend": encoder.backend},
    }


def build_metrics(cfg: RunConfig, accelerator: str, source: TrainingInput) -> RunFabMetrics:
    """RunFab's metric lines on stdout (and in run/metrics.jsonl); MFU only on a GPU."""
    return RunFabMetrics(
        cfg.metrics.interval_seconds, stream=sys.stdout,
        flops=functools.partial(training_flops, cfg.model) if accelerator == "gpu" else None,
        peak_flops=cfg.metrics.peak_flops, warmup_updates=cfg.observe.warmup_updates,
        observed_updates=cfg.observe.observed_updates(), log_path=run_folder(cfg.output.root) / "metrics.jsonl",
        validate_every=cfg.trainer.val_every_steps if validates(cfg) else 0,
        report_due=source.report_due, input_wait=lambda: source.datamodule.input_wait_seconds,
    )


def build_callbacks(cfg: RunConfig, accelerator: str, split: BatchSplit, description: dict, source: TrainingInput,
                    metrics: RunFabMetrics, host_memory: MemoryStages) -> list[L.Callback]:
    """The run's callbacks, in the order their hooks must run."""
    run_dir, checkpoint_dir = run_folder(cfg.output.root), checkpoint_folder(cfg.output.root)
    every = cfg.trainer.checkpoint_every_steps
    observer = ObservationWindows(cfg.observe, run_dir)
    history = History()
    if cfg.observe.loggers:  # the loggers' per-update points, up to each metric line, ahead of it
        metrics.before_line = history.flush
    fixed_validation = build_fixed_validation(cfg, split, source, history, metrics)
    record = RunRecord(BUNDLE_ROOT, description, source.record, compiles(cfg, accelerator), source.early_end,
                       metrics, observer, sections=functools.partial(
                           comparability, cfg, description, source, metrics, history, fixed_validation))
    callbacks: list[L.Callback] = [
        ValidationBeforeTraining(fixed_validation),  # first: its time is outside every training measure
        owned_folders.MarkRunFolders([run_dir, *([checkpoint_dir] if every > 0 else [])]),
        observer,  # before the metrics: writing a trace counts as observed time
        metrics,  # before the export: the record carries the last line and the summary
        history,  # before the export: its last all-reduce must not wait behind rank 0's export
        fixed_validation,  # before the export: the record carries its result
        ExportModel(model_folder(cfg.output.root), bundle_path(cfg.data.tokenizer),
                    published_with=functools.partial(publish_with_model, record, history)),
        GracefulStop(source.end, before_exit=release_now),
        host_memory,
    ]
    if shows_progress(cfg):
        callbacks.append(UpdateProgressBar())
    if every > 0:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=every,
                                                             save_top_k=1))
    return callbacks


def build_fixed_validation(cfg: RunConfig, split: BatchSplit, source: TrainingInput, history: History,
                           metrics: RunFabMetrics) -> FixedValidation:
    """The validation loss at the start and the end, on the run's validation set; one held out from the
    input is saved in run/ for a later comparison (``python -m tools evaluate --data``)."""
    pool = source.validation or source.datamodule.pool
    return FixedValidation(
        pool, cfg.model.max_seq_len, split.microbatch, functools.partial(initial_model, cfg),
        lambda: history.initial_weights,
        save_to=run_folder(cfg.output.root) / "validation.jsonl" if pool.formed == HELD_OUT else None,
        validated_at=lambda: metrics.validated_at)


def comparability(cfg: RunConfig, description: dict, source: TrainingInput, metrics: RunFabMetrics,
                  history: History, fixed_validation: FixedValidation) -> dict:
    """The run record's section that says whether two runs can be compared: what they trained on and
    how, the fixed validation's result, and which updates the figures measure."""
    return {"comparability": history.summary() | {
        "validation": fixed_validation.result,
        "shards_fingerprint": (source.record() or {}).get("fingerprint"),
        "tokenizer_sha256": description["tokenizer"]["sha256"],
        "measurement_scope": {"warmup_updates": cfg.observe.warmup_updates,
                              "observed_updates": sorted(cfg.observe.observed_updates()),
                              "normal_region": metrics.normal_region()},
    }}


def publish_with_model(record: RunRecord, history: History, trainer: L.Trainer, pl_module: L.LightningModule,
                       staging: Path) -> None:
    """What belongs with the model, into its staging folder: published with it by one rename."""
    record.write(trainer, pl_module, staging)
    log.info("per-update history written with the model (%s)", history.write(staging).name)


def build_training_module(cfg: RunConfig, accelerator: str) -> L.LightningModule:
    """The LightningModule, its weights initialized on this process's GPU when it trains on one, its kernels
    chosen for training there (compiled where ``compiles``; its caches are placed first, ``prepare_compile``)."""
    device = torch.device("cuda", local_device()) if accelerator == "gpu" else None
    return build_module(cfg, device, compiled=compiles(cfg, accelerator))


def initial_model(cfg: RunConfig, device: torch.device):
    """The decoder as training built it before update 1: the same seed, the same construction (build_module)."""
    torch.manual_seed(cfg.seed)
    return build_module(cfg, device if device.type == "cuda" else None).model


def experiment_loggers(cfg: RunConfig, folder: Path) -> list:
    """Lightning loggers named in ``observe.loggers``; they receive the metric lines and the run's
    configuration (``fit``), never stdout."""
    loggers = []
    for name in cfg.observe.loggers:
        if name == "csv":
            loggers.append(L.pytorch.loggers.CSVLogger(folder, name="csv"))
        elif name == "tensorboard":
            if not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
                raise ConfigError("observe.loggers has tensorboard, which is not installed: pip install tensorboard")
            # No placeholder hp_metric of -1: the metric lines are the run's metrics.
            loggers.append(L.pytorch.loggers.TensorBoardLogger(folder, name="tensorboard", default_hp_metric=False))
        elif name == "wandb":
            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("observe.loggers has wandb, which is not installed: pip install wandb, then wandb login")
            os.environ.setdefault("WANDB_CONSOLE", "off")  # W&B must not wrap stdout, which carries RunFab's lines
            loggers.append(L.pytorch.loggers.WandbLogger(save_dir=folder, project=os.environ.get("WANDB_PROJECT", "runfab")))
    return loggers


def finish_experiment_loggers(failed: bool) -> None:
    """Finish W&B's run now, while stdout points at stderr: left to the interpreter's exit, it prints
    its closing lines on stdout, which carries the metric lines only."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=1 if failed else 0)

def train(trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule, description: dict,
          split: BatchSplit, ckpt_path: str | None = None) -> None:
    """Lightning's fit, with stdout kept for the metric lines, the loggers finished, and a signal before
    training or a CUDA out-of-memory error said in words a user can act on."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # Lightning's bar and tables, and the loggers, default to stdout
            for logger in trainer.loggers:  # Lightning sends them the module's hyperparameters, which it has none of
                logger.log_hyperparams(description)
            failed = True
            try:
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
                failed = False
            finally:
                finish_experiment_loggers(failed)
    except SIGTERMException:  # Lightning's own handler: the signal came before training started
        raise launcher.Interrupted("received SIGTERM before training started; nothing was trained") from None
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(
            f"CUDA ran out of memory at optimizer step {trainer.global_step} with microbatch {split.microbatch} "
            f"(x accumulation {split.accumulation} x {split.ranks} device(s)), after the probe had passed. Rows with "
            "many short documents or a fragmented allocator can need more than the probe's worst case: rerun with a "
            "smaller microbatch, or set compute.activation_checkpointing: true. Original error: " + str(error)
        ) from error


# ----------------------------------------------------------------------------- the end, and data parallelism


def raise_if_ended_early(feeder: UpdateFeeder, result: dict, checkpoint_dir: Path) -> None:
    """A run cut short by a signal or by its input fails, after the model trained so far was exported;
    so does one whose time limit passed before the input delivered a single update."""
    if feeder.time_limit_reached and not result["steps"]:
        stats, settings = feeder.stats, feeder.settings
        raise UnusableInputError(
            "trainer.max_time passed before the input delivered one complete update: nothing was trained or "
            f"exported. {stats.records} records ({stats.document_tokens} tokens) had arrived, and an update takes "
            f"{settings.rows_per_update * settings.seq_len} tokens. Send records sooner, close the input once it is "
            "complete, or give the run more time")
    if feeder.early_end is None:
        return
    where = (f"stopped after optimizer step {result['steps']}; the model trained so far is in {result['model_dir']} "
             f"(run_record.json status: partial)" if result["steps"] else "stopped before the first optimizer step; "
             "nothing was trained, so no model was exported")
    if result["steps"] and checkpoints.STOP_CHECKPOINT in checkpoints.written(checkpoint_dir):
        where += (f"; checkpoint {checkpoint_dir / checkpoints.STOP_CHECKPOINT}: resume with the same command, the "
                  "same input and --ckpt_path last")
    if feeder.input_error is not None:
        raise launcher.InputFailed(f"the input failed: {type(feeder.input_error).__name__}: {feeder.input_error}; "
                                   + where) from feeder.input_error
    raise launcher.Interrupted(f"received {feeder.early_end}: {where}")


def train_data_parallel(cfg: RunConfig, split: BatchSplit, feeder: UpdateFeeder,
                        platform_fraction: float | None = None, resume: str | None = None) -> dict:
    """This process feeds; one worker per rank trains (from the checkpoint ``resume``, if given). Waits
    for all, or fails with the first failure."""
    world = split.ranks
    listener, authkey = feeder_wire.new_listener()
    spec = {"config": as_dict(cfg), "microbatch": split.microbatch, "accumulation": split.accumulation,
            "effective": split.effective,
            "address": list(listener.address), "authkey": authkey.hex(), "platform_memory_fraction": platform_fraction,
            "ckpt_path": resume}
    if launcher.resolve_start(cfg.trainer.worker_start) == "fork":
        preload_worker_modules(cfg, compile_folder(cfg.output.root), world)
    stop_by: list[float] = []  # set by the first signal: when the graceful stop must be over

    def stop_gracefully(name: str) -> None:
        stop_by.append(time.monotonic() + cfg.trainer.stop_grace_seconds)
        feeder.finish(name)

    with launcher.worker_group(world, spec, BUNDLE_ROOT, cfg.trainer.worker_start,
                               on_first_signal=stop_gracefully) as group:
        try:
            feeder_wire.serve_feeder(feeder, listener, world)
            group.wait(feeder_error=lambda: feeder.error, on_first_exit=feeder.stop,
                       stop_deadline=lambda: stop_by[0] if stop_by else None)
        finally:
            feeder.stop()
            listener.close()
    model_dir = model_folder(cfg.output.root)
    record_path = model_dir / "run_record.json"
    if not record_path.is_file():  # stopped before the first update: nothing was exported
        return {"steps": 0, "model_dir": str(model_dir), "metrics": {}}
    record = json.loads(record_path.read_text())  # rank 0 wrote it, with the input summary the feeder sent
    return {"steps": record["optimizer_steps"], "model_dir": str(model_dir), "metrics": record["final_metrics"]}
