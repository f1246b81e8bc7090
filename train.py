"""The RunFab contract: the effective batch size, the memory probe and the training hook.

RunFab imports this file, calls ``probe_batch(microbatch)`` in fresh processes, then
``train(microbatch, accumulation)`` with records on stdin. ``python train.py`` runs the very
same path locally. Importing it only defines things: no stdin, no CUDA, no files, no model, and no
heavy import (torch and Lightning load inside the hooks).

stdout carries RunFab's metric lines and nothing else; everything for people goes to stderr.
The batch split is in runtime/batch_split.py, the probe in runtime/probe.py, a training run in
runtime/training_run.py (data parallelism through runtime/launcher.py, one rank in runtime/worker.py).
"""

from __future__ import annotations

import sys

EFFECTIVE_BATCH_SIZE = 32


def probe_batch(microbatch: int) -> None:
    """Fit ``microbatch`` worst-case rows with the real model and optimizer; CUDA OOM propagates."""
    import_libraries()
    from config import load_config
    from runtime.probe import run_probe

    run_probe(load_config(), microbatch, EFFECTIVE_BATCH_SIZE)


def train(microbatch: int, accumulation: int) -> dict:
    """Train on stdin with RunFab's choice of batch split, then export."""
    import_libraries()
    from config import ConfigError, load_config
    from runtime import training_run
    from runtime.batch_split import BatchSplit
    from runtime.device_policy import world_size

    cfg = load_config()
    if cfg.data.source == "litdata" or cfg.trainer.global_batch_size is not None:  # for `python train.py` on a cluster
        raise ConfigError("RunFab's train() reads stdin with EFFECTIVE_BATCH_SIZE rows per update: set data.source "
                          "auto and trainer.global_batch_size null in the bundle's config (prepared shards train "
                          "with `python train.py --data.source litdata`)")
    return training_run.run_training(cfg, BatchSplit(microbatch, accumulation, world_size(cfg), EFFECTIVE_BATCH_SIZE))


def import_libraries() -> None:
    """Import Lightning so that nothing its import writes stays behind (runfab/library_import.py): a probe
    writes nothing and a run writes only under its output."""
    from runfab.library_import import import_lightning

    import_lightning()


def main(argv: list[str] | None = None) -> int:
    """``python train.py``: a data-parallel worker (``train.py worker``, started by the launcher), else
    the local command line, cli.py, whose jsonargparse RunFab's hooks and the workers never import."""
    argv = list(sys.argv[1:] if argv is None else argv)
    import_libraries()
    if argv[:1] == ["worker"]:
        from runtime import worker

        return worker.run_worker()
    import cli
    from runtime.launcher import raise_on_signals

    # Until a run's own handlers take over (and after they hand back), a stop signal unwinds: the output
    # folder's lock and the temporary folders are removed on the way out, and the error is one line.
    restore = raise_on_signals(stopping="stopped while the run was starting or finishing")
    try:
        return cli.main(argv, EFFECTIVE_BATCH_SIZE)
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
