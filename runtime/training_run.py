"""One training run, from the output folder to the exported model: in this process on one device,
or as the feeder of data-parallel workers (launcher.py), and the worker side of that.

The input, the Lightning Trainer and its callbacks are put together here; what a run computes on
and how much memory it may take is device_policy.py's, the batch split batch_split.py's.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import logging
import os
import pwd
import shutil
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from runfab import memory
from runfab import created_files
from callbacks.host_memory import HostMemory
from runtime import hostmem
from runtime import launcher
from runtime.batch_split import BatchSplit
from runfab.lifetime import exit_with_parent
from callbacks import owned_folders
from callbacks.export import ExportFailed, ExportModel, unfinished_exports
from callbacks.fixed_validation import FixedValidation
from callbacks.history import History
from callbacks.graceful_stop import GracefulStop
from callbacks.observe import ObservationWindows
from callbacks.run_record import RunRecord, sha256_file
from callbacks.runfab_metrics import RunFabMetrics, ensure_stdout
from config import BUNDLE_ROOT, ConfigError, RunConfig, as_dict, bundle_path, load_config_dict, training_time_limit
from datamodule import StreamingDataModule
from pipeline.feeder import UpdateFeeder
from pipeline.sources import open_input
from pipeline.records import UnusableInputError
from pipeline.stream import StreamSettings, summary_line
from pipeline.validation_split import ValidationPool
from runtime.device_policy import (
    build_module, check_host_memory, compiles, limit_gpu_memory, lightning_trainer, local_device,
    platform_memory_fraction, preload_worker_modules, prepare_compile, resolve_accelerator, setup_process,
    use_allocator_settings,
)
from model.flops import count_parameters, training_flops
from runtime.probe import run_probe_local
from pipeline.tokenizer import TextEncoder

log = logging.getLogger("train")


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


LOCK_NAME = ".run.lock"


RUN_FOLDERS = ("model", "run", "checkpoints")  # what one run writes; an earlier run's are set aside, never mixed in
# Never an output root: a run writes model/, run/, checkpoints/ and data/ into it and sets earlier ones aside there.
SYSTEM_FOLDERS = tuple(Path(p) for p in ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64",
                                         "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/usr", "/usr/local",
                                         "/var"))


@contextlib.contextmanager
def claimed_output(root: Path, keep: tuple[str, ...] = ()):
    """Hold the output folder for one run: a second run on it is refused (its model and metrics
    would mix with this one's), and what an earlier run left in ``model/``, ``run/`` and
    ``checkpoints/`` is moved to ``previous-model/``, ``previous-run/`` and ``previous-checkpoints/``,
    so that those folders only ever hold this run's results, or nothing if this run fails early.

    Only folders a run wrote (owned_folders) are moved: anything else under those names, a link or a
    file, is refused before anything moves, as are the bundle and system folders as a root. The
    staging folders of an export that was killed while writing are removed, at the start and at the end.
    The folders named in ``keep`` stay where they are (a resumed run reads ``checkpoints/``).
    """
    refuse_unsafe_root(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = created_files.open_created(root / LOCK_NAME, "a+")
    except created_files.NotCreatedHere as error:  # a planted link: neither written through nor removed
        raise ConfigError(f"the output root's lock file {error}") from None
    except (FileExistsError, NotADirectoryError):
        file = next(p for p in (root, *root.parents) if p.exists() and not p.is_dir())
        where = "is a file" if file == root else f"lies under {file}, which is a file"
        raise ConfigError(f"the output root {root} {where}, not a folder; set RUNFABRIC_OUTPUT (or output.root) "
                          "to a folder") from None
    except OSError as error:
        raise ConfigError(f"cannot write to the output root {root} ({error.strerror}); set RUNFABRIC_OUTPUT "
                          "(or output.root) to a writable folder") from None
    lock_file = os.fstat(lock.fileno())
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
        try:
            moves = [move for name in RUN_FOLDERS if name not in keep for move in _set_aside_plan(root, name)]
            remove_unfinished_exports(root)
            for source, target in moves:
                _move_aside(source, target)
            if moves:
                log.warning("an earlier run's results were moved aside, never deleted: %s",
                            ", ".join(f"{source} -> {target}" for source, target in moves))
            yield
        finally:
            remove_unfinished_exports(root)
            if created_files.is_same_file(root / LOCK_NAME, lock_file):  # never what replaced it meanwhile
                (root / LOCK_NAME).unlink()


def unsafe_folder(folder: Path) -> str | None:
    """What ``folder`` is when no tool may write its own files into it: the bundle itself, a system
    folder or the home folder (``python -m tools prepare`` asks too); None for any other."""
    where = folder.resolve()
    try:
        home = Path(pwd.getpwuid(os.getuid()).pw_dir).resolve()  # the account's, not whatever $HOME says
    except KeyError:
        home = None
    return ("the bundle itself (the folder of train.py)" if where == BUNDLE_ROOT else
            "a system folder" if where in SYSTEM_FOLDERS else "the home folder itself" if where == home else None)


def refuse_unsafe_root(root: Path) -> None:
    """Refuse the bundle itself and system folders as the output root: a run writes its folders there."""
    if (what := unsafe_folder(root)) is not None:
        raise ConfigError(f"the output root {root} is {what}; a run writes model/, run/, checkpoints/ and data/ into "
                          "it: set RUNFABRIC_OUTPUT (or output.root) to a folder of its own")


def remove_unfinished_exports(root: Path) -> None:
    """Remove the half-written staging folders that a run's export left when it was killed."""
    for staging in unfinished_exports(root / "model"):
        if owned_folders.is_marked(staging):
            shutil.rmtree(staging, ignore_errors=True)


def _set_aside_plan(root: Path, name: str) -> list[tuple[Path, Path]]:
    """The moves that set an earlier run's ``name`` aside as ``previous-name``, and a ``previous-name``
    already there as ``previous-name.N``: it may hold the only copy of a model. Refuses (ConfigError)
    when either is not a folder a run wrote."""
    earlier, previous = root / name, root / f"previous-{name}"
    if not os.path.lexists(earlier):
        return []
    _refuse_unless_owned(earlier)
    moves = []
    if os.path.lexists(previous):
        _refuse_unless_owned(previous)
        suffixes = (p.name.removeprefix(f"{previous.name}.") for p in root.glob(f"{previous.name}.*"))
        older = root / f"{previous.name}.{max((int(s) for s in suffixes if s.isdigit()), default=0) + 1}"
        moves.append((previous, older))
    return [*moves, (earlier, previous)]


def _refuse_unless_owned(path: Path) -> None:
    if owned_folders.is_marked(path):
        return
    what = (f"a symbolic link (to {os.readlink(path)})" if path.is_symlink() else "a file" if not path.is_dir()
            else f"a folder that no run of train.py wrote (it has no {owned_folders.MARK})")
    raise ConfigError(f"{path} is {what}, and a run neither writes into nor moves what a run did not write: move it "
                      "elsewhere, or set RUNFABRIC_OUTPUT (or output.root) to another folder")


def _move_aside(source: Path, target: Path) -> None:
    try:
        source.rename(target)
    except OSError as error:
        raise ConfigError(f"cannot move the earlier run's {source} aside to {target} ({error.strerror}); move or "
                          "remove it yourself, or set RUNFABRIC_OUTPUT (or output.root) to another folder") from None


def stream_settings(cfg: RunConfig, encoder: TextEncoder, split: BatchSplit) -> StreamSettings:
    return StreamSettings(
        data=cfg.data, seq_len=cfg.model.max_seq_len, vocab_size=cfg.model.vocab_size, eos_id=encoder.eos_id,
        seed=cfg.seed, microbatch=split.microbatch, accumulation=split.accumulation, world_size=split.ranks,
        max_updates=cfg.trainer.max_steps if cfg.trainer.max_steps > 0 else None,
    )


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


def compile_folder(cfg: RunConfig) -> Path:
    """The compile caches (inductor, Triton, FA4): in the output's disposable data/ folder, never /tmp."""
    return Path(cfg.output.root) / "data" / "compile-cache"


SMALL_FILES_BYTES = 16 << 20  # beside the weights: configs, the run record, metric lines, the lock


def check_output_space(cfg: RunConfig, root: Path) -> None:
    """Refuse, before any training, a run whose output the filesystem under ``root`` has no room for,
    rather than fail at the export after all the training."""
    need, observed = hostmem.output_bytes(cfg), hostmem.observation_bytes(cfg)
    tokenizer = bundle_path(cfg.data.tokenizer)
    need += observed + SMALL_FILES_BYTES + (tokenizer.stat().st_size if tokenizer.is_file() else 0)
    free = shutil.disk_usage(root).free
    if free < need:
        raise ConfigError(
            f"the output root {root} has {free / 2**30:.2f} GiB free but this run writes about {need / 2**30:.2f} GiB "
            f"there (the model export{', two checkpoints' if cfg.trainer.checkpoint_every_steps > 0 else ''}"
            f"{', observation files' if observed else ''}); free some space, or set RUNFABRIC_OUTPUT (or "
            "output.root) to a folder with room")


def check_output_budget(cfg: RunConfig) -> None:
    """Refuse, before any training, a run whose deliverables cannot fit RunFab's output space (output_bytes)."""
    need, observed = hostmem.output_bytes(cfg), hostmem.observation_bytes(cfg)
    if need + observed > cfg.output.budget_bytes:
        raise ConfigError(
            f"the output would need about {(need + observed) / 2**30:.2f} GiB (model export"
            f"{', two checkpoints' if cfg.trainer.checkpoint_every_steps > 0 else ''}"
            f"{', observation files' if observed else ''}) but output.budget_bytes allows "
            f"{cfg.output.budget_bytes / 2**30:.2f} GiB; disable trainer.checkpoint_every_steps, profile fewer "
            "updates (observe.profile_updates) or shrink the model"
        )


def run_training(cfg: RunConfig, split: BatchSplit, stdin=None) -> dict:
    """Validate, then train in this process (one device) or through data-parallel workers."""
    world = split.ranks
    check_output_budget(cfg)
    in_workers = world > 1 or bool(cfg.trainer.worker_processes)
    setup_process(cfg)  # first: the host-memory check logs its budget line
    check_host_memory(cfg, world, split.microbatch)
    ensure_stdout()
    with claimed_output(Path(cfg.output.root)):
        check_output_space(cfg, Path(cfg.output.root))
        use_allocator_settings(cfg)
        platform_fraction = platform_memory_fraction()
        encoder = load_encoder(cfg)
        settings = stream_settings(cfg, encoder, split)
        feeder = UpdateFeeder(
            lambda: open_input(bundle_path(cfg.data.sample_path), stdin, cfg.data.source), settings,
            encoder.encode_batch_arrays, ValidationPool(cfg.data.val_max_tokens),
            report_every=cfg.metrics.interval_seconds if world > 1 else None,
            time_limit_seconds=limit.total_seconds() if (limit := training_time_limit(cfg)) is not None else None,
        )
        if in_workers:
            result = train_data_parallel(cfg, split, feeder, platform_fraction)
        else:
            datamodule = StreamingDataModule(
                functools.partial(feeder.iterate, mark_waits=True), feeder.pool, settings,
                pin_memory=resolve_accelerator(cfg) == "gpu", on_teardown=feeder.stop,
            )
            result = fit(cfg, split, datamodule, encoder, feeder.close, platform_fraction,
                         end_input=feeder.finish, early_end=lambda: feeder.early_end)
        result["input"] = feeder.close()
        log.info(summary_line(feeder.stats))
        raise_if_ended_early(feeder, result)
    return result


def raise_if_ended_early(feeder: UpdateFeeder, result: dict) -> None:
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
    if feeder.input_error is not None:
        raise launcher.InputFailed(f"the input failed: {type(feeder.input_error).__name__}: {feeder.input_error}; "
                                   + where) from feeder.input_error
    raise launcher.Interrupted(f"received {feeder.early_end}: {where}")


def fit(cfg: RunConfig, split: BatchSplit, datamodule: StreamingDataModule,
        encoder: TextEncoder, input_summary=None, platform_fraction: float | None = None,
        end_input=lambda reason: None, early_end=lambda: None, report_due=None,
        ckpt_path: str | None = None, extra_callbacks: tuple = (), trainer_overrides: dict | None = None,
        validation: tuple | None = None) -> dict:
    """Build module, callbacks and Trainer, and fit: the same in a single process and in each worker.

    Export and the run record happen in callbacks, on global rank 0. ``end_input(reason)`` ends the
    input at the next update boundary (a signal); ``early_end()`` says why it ended early, if it did,
    which the run record reports as ``partial``. The run from prepared shards (shard_run.py) resumes
    from ``ckpt_path``, adds ``extra_callbacks`` and sets the Trainer's ``trainer_overrides``
    (devices per node, nodes), and gives its fixed ``validation`` set as (documents(), where they are from).
    """
    microbatch, accumulation, world = split.microbatch, split.accumulation, split.ranks
    accelerator = resolve_accelerator(cfg)
    on_gpu = accelerator == "gpu"
    host_memory = HostMemory()
    if on_gpu:
        limit_gpu_memory(cfg, local_device(), platform_fraction)
        host_memory.stage("CUDA initialized")
    model_dir = Path(cfg.output.root) / "model"
    compiled = compiles(cfg, accelerator)
    tokenizer_path = bundle_path(cfg.data.tokenizer)
    static = {
        "seed": cfg.seed,
        "config": as_dict(cfg),
        "batch": split.as_dict() | {"tokens_per_update": split.effective * cfg.model.max_seq_len},
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
        report_due=report_due, input_wait=lambda: datamodule.input_wait_seconds,
    )

    def input_record() -> dict | None:
        summary = input_summary() if input_summary else None
        return summary and summary | {"training_wait_seconds": round(datamodule.input_wait_seconds, 3)}

    observer = ObservationWindows(cfg.observe, run_dir)
    history = History(token_digests=cfg.data.token_digests)
    documents, source = validation or (datamodule.pool.snapshot, "held out from the input (data.val_fraction)")
    fixed_validation = FixedValidation(
        documents, cfg.model.max_seq_len, microbatch, functools.partial(initial_model, cfg),
        lambda: history.initial_weights, source, save_to=None if validation else run_dir / "validation.jsonl")

    def comparability() -> dict:
        return {"comparability": history.summary() | {
            "validation": fixed_validation.result,
            "shards_fingerprint": (input_record() or {}).get("fingerprint"),
            "tokenizer_sha256": static["tokenizer"]["sha256"],
            "measurement_scope": {"warmup_updates": cfg.observe.warmup_updates,
                                  "observed_updates": sorted(cfg.observe.observed_updates()),
                                  "normal_region": metrics.normal_region()},
        }}

    every = cfg.trainer.checkpoint_every_steps
    checkpoint_dir = Path(cfg.output.root) / "checkpoints"
    record = RunRecord(BUNDLE_ROOT, static, input_record, compiled, early_end, metrics, observer,
                       sections=comparability)

    def publish(trainer: L.Trainer, pl_module: L.LightningModule, staging: Path) -> None:
        """What belongs with the model, into its staging folder: published with it by one rename."""
        record.write(trainer, pl_module, staging)
        log.info("per-update history written with the model (%s)", history.write(staging).name)

    callbacks: list[L.Callback] = [
        owned_folders.MarkRunFolders([run_dir, *([checkpoint_dir] if every > 0 else [])]),
        observer,  # before the metrics: writing a trace counts as observed time
        metrics,  # before the export: the record carries the last line and the summary
        history,  # before the export: its last all-reduce must not wait behind rank 0's export
        fixed_validation,  # before the export: the record carries its result
        ExportModel(model_dir, tokenizer_path, published_with=publish),
        GracefulStop(end_input, before_exit=functools.partial(remove_unfinished_exports, Path(cfg.output.root))),
        host_memory,
    ]
    if every > 0:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=every, save_top_k=1))
    callbacks.extend(extra_callbacks)
    progress = cfg.trainer.enable_progress_bar if cfg.trainer.enable_progress_bar is not None else sys.stderr.isatty()
    trainer = lightning_trainer(
        cfg, accelerator, world,
        max_steps=cfg.trainer.max_steps, max_time=training_time_limit(cfg),
        accumulate_grad_batches=accumulation,
        val_check_interval=cfg.trainer.val_every_steps * accumulation if validate else None,
        limit_val_batches=(cfg.trainer.limit_val_batches or 1.0) if validate else 0,
        enable_checkpointing=every > 0,
        enable_progress_bar=progress,
        default_root_dir=cfg.output.root,
        callbacks=callbacks,
        logger=experiment_loggers(cfg, run_dir / "logs") or False,
        **(trainer_overrides or {}),
    )
    module = build_module(cfg, torch.device("cuda", local_device()) if on_gpu else None)
    host_memory.stage("model built")
    if compiled:
        prepare_compile(compile_folder(cfg), world)
        module.model.compile_trunk()
    log.info("model: %d parameters; %s on %s; microbatch %d x accumulation %d x %d device(s)",
             count_parameters(module.model), trainer.precision, accelerator,
             microbatch, accumulation, world)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # Lightning's bar and tables, and the loggers, default to stdout
            for logger in trainer.loggers:  # Lightning sends them the module's hyperparameters, which it has none of
                logger.log_hyperparams(static)
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
            f"CUDA ran out of memory at optimizer step {trainer.global_step} with microbatch {microbatch} "
            f"(x accumulation {accumulation} x {world} device(s)), after the probe had passed. Rows with many short "
            "documents or a fragmented allocator can need more than the probe's worst case: rerun with a smaller "
            "microbatch, or set compute.activation_checkpointing: true. Original error: " + str(error)
        ) from error
    log.info("finished: %d optimizer steps; %s", trainer.global_step,
             f"model in {model_dir}" if trainer.global_step else "no model exported")
    return {"steps": trainer.global_step, "model_dir": str(model_dir), "metrics": metrics.last_record}


def initial_model(cfg: RunConfig, device: torch.device):
    """The GPT as training built it before update 1: the same seed, the same construction (build_module)."""
    torch.manual_seed(cfg.seed)
    return build_module(cfg, device if device.type == "cuda" else None).model


def train_data_parallel(cfg: RunConfig, split: BatchSplit, feeder: UpdateFeeder,
                        platform_fraction: float | None = None) -> dict:
    """This process feeds; one worker per rank trains. Waits for all, or fails with the first failure."""
    world = split.ranks
    listener, authkey = launcher.new_listener()
    spec = {"config": as_dict(cfg), "microbatch": split.microbatch, "accumulation": split.accumulation,
            "effective": split.effective,
            "address": list(listener.address), "authkey": authkey.hex(), "platform_memory_fraction": platform_fraction}
    if launcher.resolve_start(cfg.trainer.worker_start) == "fork":
        preload_worker_modules(cfg, compile_folder(cfg), world)
    stop_by: list[float] = []  # set by the first signal: when the graceful stop must be over

    def stop_gracefully(name: str) -> None:
        stop_by.append(time.monotonic() + cfg.trainer.stop_grace_seconds)
        feeder.finish(name)

    with launcher.worker_group(world, spec, BUNDLE_ROOT, cfg.trainer.worker_start,
                               on_first_signal=stop_gracefully) as group:
        try:
            launcher.serve_feeder(feeder, listener, world)
            group.wait(feeder_error=lambda: feeder.error, on_first_exit=feeder.stop,
                       stop_deadline=lambda: stop_by[0] if stop_by else None)
        finally:
            feeder.stop()
            listener.close()
    model_dir = Path(cfg.output.root) / "model"
    record_path = model_dir / "run_record.json"
    if not record_path.is_file():  # stopped before the first update: nothing was exported
        return {"steps": 0, "model_dir": str(model_dir), "metrics": {}}
    record = json.loads(record_path.read_text())  # rank 0 wrote it, with the input summary the feeder sent
    return {"steps": record["optimizer_steps"], "model_dir": str(model_dir), "metrics": record["final_metrics"]}


def run_worker() -> int:
    """``python train.py worker``: one data-parallel rank, started by train_data_parallel or run_probe."""
    if launcher.WORKER_SPEC_ENV not in os.environ:  # typed by a person
        print("error: `train.py worker` is a data-parallel rank that train.py starts itself; run `python train.py` "
              "(--trainer.devices N for N ranks)", file=sys.stderr)
        return 2
    exit_with_parent()  # a worker whose feeder vanished (even by SIGKILL) must not wait in a collective
    memory.record_stage("worker started, modules imported")
    spec = launcher.worker_spec()
    cfg = load_config_dict(spec["config"])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    rank_zero_only.rank = rank  # read from the environment when Lightning was imported: a forked worker imported it as rank 0
    setup_process(cfg)
    launcher.quiet_peer_rank(rank)
    if resolve_accelerator(cfg) == "gpu":
        torch.set_num_threads(1)  # a GPU worker only launches kernels; RunFab's 2 cores serve feeder and workers
    platform_fraction = spec.get("platform_memory_fraction")
    try:
        return _run_worker(cfg, spec, world, rank, platform_fraction)
    except launcher.Interrupted as stopped:  # its own line and status: the launcher names this rank before its peers
        print(f"error: rank {rank}: {stopped}", file=sys.stderr)
        return launcher.STOPPED_EXIT


def _run_worker(cfg: RunConfig, spec: dict, world: int, rank: int, platform_fraction: float | None) -> int:
    """The rank's share of the probe or of training; its exit status."""
    if spec.get("probe"):
        run_probe_local(cfg, spec["microbatch"], world, spec["effective"], platform_fraction)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # a probe keeps nothing: skip the interpreter's teardown of CUDA, NCCL and modules (seconds)
    encoder = load_encoder(cfg)
    split = BatchSplit(spec["microbatch"], spec["accumulation"], world, spec["effective"])
    settings = stream_settings(cfg, encoder, split)
    pool = ValidationPool(cfg.data.val_max_tokens)
    connection = launcher.FeederConnection(tuple(spec["address"]), bytes.fromhex(spec["authkey"]), rank, pool,
                                           split.accumulation)
    datamodule = StreamingDataModule(
        connection.batches, pool, settings, rank=rank, pin_memory=resolve_accelerator(cfg) == "gpu",
        on_teardown=connection.close,
    )
    try:
        fit(cfg, split, datamodule, encoder, lambda: connection.input_summary, platform_fraction=platform_fraction,
            early_end=lambda: connection.early_end, report_due=connection.report_due if world > 1 else None)
    except ExportFailed as error:  # one line in the feeder's report of this rank, as in a single process
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0

