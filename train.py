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

import launcher
import training_run
from batch_split import BatchSplit, command_line_microbatch
from callbacks.runfab_metrics import NonFiniteLossError
from config import ConfigError, load_config
from stages import UnusableInputError
from device_policy import world_size
from probe import run_probe

EFFECTIVE_BATCH_SIZE = 32

USER_ERRORS = (
    ConfigError, UnusableInputError, NonFiniteLossError, FileNotFoundError, launcher.WorkerFailed, launcher.Interrupted,
    launcher.InputFailed,
)


def probe_batch(microbatch: int) -> None:
    """Fit ``microbatch`` worst-case rows with the real model and optimizer; CUDA OOM propagates."""
    run_probe(load_config(), microbatch, EFFECTIVE_BATCH_SIZE)


def train(microbatch: int, accumulation: int) -> dict:
    """Train on stdin with RunFab's choice of batch split, then export."""
    cfg = load_config()
    return training_run.run_training(cfg, BatchSplit(microbatch, accumulation, world_size(cfg), EFFECTIVE_BATCH_SIZE))


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python train.py``: the local command line (cli.py); ``train.py worker`` is launcher.py's worker."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return training_run.run_worker()
    import cli  # jsonargparse is a local-development package: RunFab's hooks never import it

    try:
        command = cli.parse(argv)
        cfg = load_config(command.config_path, command.overrides)
        if command.print_config:
            print(cli.config_yaml(cfg), end="")
            return 0
        world = world_size(cfg)
        if command.name == "probe":  # any microbatch the probe accepts, not only those that divide the batch
            microbatch = command_line_microbatch(EFFECTIVE_BATCH_SIZE, world, cfg.data.microbatch, command.microbatch,
                                                 command.accumulation)
            run_probe(cfg, microbatch, EFFECTIVE_BATCH_SIZE)
            return 0
        split = BatchSplit.for_command_line(EFFECTIVE_BATCH_SIZE, world, cfg.data.microbatch, command.microbatch,
                                           command.accumulation)
        training_run.run_training(cfg, split)
    except (cli.CommandLineError, *USER_ERRORS) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
