"""One data-parallel rank: ``python train.py worker``, which launcher.py starts once per device.

The rank reads its job from the spec the feeder wrote (launcher.worker_spec), then either measures its
share of the probe (probe.py) or trains: its batches come over the feeder's wire (pipeline/feeder_wire.py)
and it fits with the same steps as a run in one process (training_run.fit).
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch.utilities import rank_zero_only

from callbacks.export import ExportFailed
from config import RunConfig, load_config_dict
from datamodule import StreamingDataModule
from pipeline import feeder_wire
from runfab import process_memory
from runfab.lifetime import exit_with_parent
from runtime import launcher
from runtime.batch_split import BatchSplit
from runtime.device_policy import resolve_accelerator, setup_process
from runtime.probe import run_probe_local
from runtime.training_run import TrainingInput, fit, load_encoder, stream_checkpoints, stream_settings, validation_pool


def run_worker() -> int:
    """``python train.py worker``: one data-parallel rank, started by training_run.train_data_parallel or probe.run_probe."""
    if launcher.WORKER_SPEC_ENV not in os.environ:  # typed by a person
        print("error: `train.py worker` is a data-parallel rank that train.py starts itself; run `python train.py` "
              "(--trainer.devices N for N ranks)", file=sys.stderr)
        return 2
    exit_with_parent()  # a worker whose feeder vanished (even by SIGKILL) must not wait in a collective
    process_memory.record_stage("worker started, modules imported")
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
    pool = validation_pool(cfg, encoder)
    connection = feeder_wire.FeederConnection(tuple(spec["address"]), bytes.fromhex(spec["authkey"]), rank, pool,
                                              split.accumulation)
    datamodule = StreamingDataModule(
        connection.batches, pool, settings, rank=rank, pin_memory=resolve_accelerator(cfg) == "gpu",
        on_teardown=connection.close,
    )
    source = TrainingInput(datamodule, summary=lambda: connection.input_summary, early_end=lambda: connection.early_end,
                           report_due=connection.report_marks.due if world > 1 else None)
    try:
        fit(cfg, split, source, encoder, platform_fraction, ckpt_path=spec.get("ckpt_path"),
            **stream_checkpoints(cfg, split, source.early_end))
    except ExportFailed as error:  # one line in the feeder's report of this rank, as in a single process
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0

