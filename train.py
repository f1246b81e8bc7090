"""The RunFab contract: the effective batch size, the memory probe and the training hook.

RunFab imports this file, calls ``probe_batch(microbatch)`` in fresh processes, then
``train(microbatch, accumulation)`` with records on stdin. ``python train.py`` runs the very
same path locally. Importing it only defines things: no stdin, no CUDA, no files, no model.

stdout carries RunFab's metric lines and nothing else; everything for people goes to stderr.
Where each part lives: the batch split in batch_split.py, the probe in probe.py, a training run
in training_run.py (data parallelism through launcher.py), device and memory policy in
device_policy.py.
"""

from __future__ import annotations

import sys

from runtime import training_run
from runtime.batch_split import BatchSplit
from config import ConfigError, load_config
from runtime.device_policy import world_size
from runtime.probe import run_probe

EFFECTIVE_BATCH_SIZE = 32


def probe_batch(microbatch: int) -> None:
    """Fit ``microbatch`` worst-case rows with the real model and optimizer; CUDA OOM propagates."""
    run_probe(load_config(), microbatch, EFFECTIVE_BATCH_SIZE)


def train(microbatch: int, accumulation: int) -> dict:
    """Train on stdin with RunFab's choice of batch split, then export."""
    cfg = load_config()
    if cfg.data.source == "litdata" or cfg.trainer.global_batch_size is not None:  # for `python train.py` on a cluster
        raise ConfigError("RunFab's train() reads stdin with EFFECTIVE_BATCH_SIZE rows per update: set data.source "
                          "auto and trainer.global_batch_size null in the bundle's config (prepared shards train "
                          "with `python train.py --data.source litdata`)")
    return training_run.run_training(cfg, BatchSplit(microbatch, accumulation, world_size(cfg), EFFECTIVE_BATCH_SIZE))


def main(argv: list[str] | None = None) -> int:
    """``python train.py``: a data-parallel worker (``train.py worker``, started by launcher.py), else
    the local command line, cli.py, whose jsonargparse RunFab's hooks and the workers never import."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return training_run.run_worker()
    import cli

    return cli.main(argv, EFFECTIVE_BATCH_SIZE)


if __name__ == "__main__":
    sys.exit(main())
