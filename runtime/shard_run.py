"""A run from prepared shards: ``python train.py --data.source litdata --data.path DIR``.

Lightning's own DDP strategy is the engine here, with files instead of stdin: one process, the GPUs
of one node, or several nodes, with no change of code. ``torchrun`` and SLURM start the processes
(Lightning recognises both and joins them); without either, Lightning starts one process per device
of this node itself, by running the same command again. RunFab's stdin path (training_run.run_training
and its launcher) is not involved: under RunFab stdin is the only input.

Every rank streams its own share of the prepared rows (pipeline/shards.py), and the ranks settle each update
in one all-reduce (update_agreement.py). The run's batch is
``trainer.global_batch_size`` rows per update, or train.EFFECTIVE_BATCH_SIZE, split as microbatch x
accumulation x ranks (batch_split.py).

What survives a preemption: Lightning's checkpoint in ``output/checkpoints/`` (weights, optimizer,
schedule, loop counters and every rank's position in the rows), written every
``trainer.checkpoint_every_steps`` updates and when SIGTERM or SIGINT reaches any rank: the ranks
agree on one update to finish, write the checkpoint and stop. ``--ckpt_path last`` resumes from the
newest one that loads and ends with the weights an uninterrupted run would have; a resume that
changed what must not change is refused first (runtime/checkpoints.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path

from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

from callbacks.agreed_stop import StopAtAgreedUpdate
from callbacks.resume_fingerprint import ResumeFingerprint
from config import ConfigError, RunConfig, bundle_path
from datamodule import ShardDataModule
from pipeline import shards
from pipeline.fingerprints import sha256_file
from pipeline.validation_split import PREPARED, ValidationPool
from runtime import checkpoints, launcher
from runtime.batch_split import BatchSplit
from runtime.device_policy import resolve_accelerator, setup_process, use_allocator_settings, world_size
from runtime.output_folder import CHECKPOINTS, checkpoint_folder, claimed_output, release_now
from runtime.training_run import TrainingInput, fit, load_encoder, validation_pool
from runtime.update_agreement import UpdateAgreement

log = logging.getLogger("train")


def topology(cfg: RunConfig) -> tuple[int, int]:
    """(processes per node, nodes): from torchrun or SLURM when they started this process, else the
    devices of this node (``trainer.devices``, or every visible GPU) on one node."""
    if TorchElasticEnvironment.detect():
        local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
        per_node, nodes = local, world // local
    elif SLURMEnvironment.detect():
        tasks, nodes = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_NNODES"])
        per_node = tasks // nodes
    else:
        return world_size(cfg), 1
    if cfg.trainer.devices is not None and cfg.trainer.devices != per_node:
        raise ConfigError(f"trainer.devices is {cfg.trainer.devices} but {per_node} processes run on each node; "
                          "leave trainer.devices unset (null) under torchrun or SLURM")
    return per_node, nodes


def environment_rank(per_node: int) -> int:
    """This process's global rank before any process group exists: torchrun's RANK, SLURM's
    SLURM_PROCID, or NODE_RANK and LOCAL_RANK from Lightning's own launcher (0 in the first process)."""
    for name in ("RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return int(os.environ.get("NODE_RANK", 0)) * per_node + int(os.environ.get("LOCAL_RANK", 0))


def prepared_validation(cfg: RunConfig, meta: dict, encoder) -> ValidationPool:
    """data.val_path, else the validation split beside the prepared rows, as the run's closed validation set."""
    if cfg.data.val_path is not None:
        return validation_pool(cfg, encoder)
    documents = shards.read_validation(cfg.data.path, meta, encoder.encode_batch_arrays, encoder.eos_id,
                                       cfg.model.vocab_size)
    pool = ValidationPool(sum(len(doc) for doc in documents), PREPARED, f"{cfg.data.path}/{shards.VALIDATION_FILE}")
    for doc in documents:
        pool.offer(doc)
    pool.close("prepared", 0, len(documents))
    return pool


def train_from_shards(cfg: RunConfig, effective: int, microbatch: int | None = None,
                      accumulation: int | None = None, ckpt_path: str | None = None) -> dict:
    """Train on the prepared rows at ``data.path``; ``effective`` is train.EFFECTIVE_BATCH_SIZE, used
    unless ``trainer.global_batch_size`` sets the batch."""
    per_node, nodes = topology(cfg)
    world = per_node * nodes
    split = BatchSplit.for_command_line(cfg.trainer.global_batch_size or effective, world, cfg.data.microbatch,
                                        microbatch, accumulation)
    cfg.data.val_fraction = 0.0  # no periodic validation: the split beside the rows is scored at the end
    setup_process(cfg)
    warnings.filterwarnings("ignore", ".*but have no `val_dataloader`.*")  # no validation here, on purpose
    encoder = load_encoder(cfg)
    tokenizer = bundle_path(cfg.data.tokenizer)
    shards.import_litdata()
    meta = shards.read_meta(cfg.data.path)
    tokenizer_sha256 = sha256_file(tokenizer)
    shards.check_meta(meta, cfg.data.path, cfg.model.max_seq_len, tokenizer_sha256, cfg.data.tokenizer,
                      cfg.model.vocab_size)
    shards.check_chunk_format(cfg.data.path)
    root = Path(cfg.output.root)
    first = environment_rank(per_node) == 0  # only rank 0 writes the output (export, record, checkpoints)
    claim = claimed_output(root, keep=(CHECKPOINTS,) if ckpt_path else ()) if first else contextlib.nullcontext()
    unchanged = checkpoints.fingerprint(cfg, split, checkpoints.shards_identity(cfg, shards.prepared_fingerprint(
        cfg.data.path)), tokenizer_sha256, world)
    resume = checkpoints.resolve(ckpt_path, checkpoint_folder(root))
    if resume is not None:  # before the output moves and Lightning loads it: a change is one line, no traceback
        resume, stored = resume
        checkpoints.refuse_changes(resume, stored, unchanged)
        del stored
    with claim:
        use_allocator_settings(cfg)
        agreement = UpdateAgreement(cfg.metrics.interval_seconds)
        datamodule = ShardDataModule(
            cfg.data.path, cfg.model.max_seq_len, split.microbatch, split.accumulation, cfg.seed,
            cfg.data.loader_workers, agreement.settle, pin_memory=resolve_accelerator(cfg) == "gpu")
        held_out = prepared_validation(cfg, meta, encoder)
        stop_at = checkpoint_folder(root) / checkpoints.STOP_CHECKPOINT
        stop = StopAtAgreedUpdate(agreement, stop_at, before_exit=release_now)
        overrides: dict = {"devices": per_node, "num_nodes": nodes, "plugins": [checkpoints.DurableCheckpointIO()]}
        if SLURMEnvironment.detect():  # its requeue handler checkpoints between microbatches: not exact
            overrides["plugins"].append(SLURMEnvironment(auto_requeue=False))
        log.info("training from %s: %d row(s) of %d tokens prepared; %d node(s) x %d process(es)", cfg.data.path,
                 meta["summary"]["rows"], meta["seq_len"], nodes, per_node)
        summary = {"source": "litdata", "path": cfg.data.path, "resumed_from": resume, **meta["summary"],
                   "fingerprint": meta.get("fingerprint")}
        source = TrainingInput(datamodule, summary=lambda: summary, end=agreement.request_stop,
                               early_end=lambda: agreement.stopped_by,
                               report_due=agreement.report_marks.due if world > 1 else None,
                               validation=held_out)
        result = fit(cfg, split, source, encoder, ckpt_path=resume,
                     extra_callbacks=(stop, ResumeFingerprint(unchanged)), trainer_overrides=overrides)
    if agreement.stopped_by is not None:
        where = f"checkpoint {stop.saved}" if stop.saved else "no checkpoint"
        raise launcher.Interrupted(f"stopped by {agreement.stopped_by} after optimizer step {result['steps']}; "
                                   f"{where}; resume with the same command and --ckpt_path last")
    if agreement.stop_signal is not None and not result["steps"]:  # before the first update: GracefulStop ended fit
        raise launcher.Interrupted(f"received {agreement.stop_signal} before the first update; nothing was trained")
    # A signal after the last update was settled came when training had nothing left to do: the run is complete.
    if first:  # the run is complete: a stop checkpoint of an earlier segment is no longer needed
        checkpoints.remove_written(checkpoint_folder(root), checkpoints.STOP_CHECKPOINT)
    return result
