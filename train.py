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

import argparse
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
        return training_run.run_worker()
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
        if command == "probe":  # any microbatch the probe accepts, not only those that divide the batch
            microbatch = command_line_microbatch(EFFECTIVE_BATCH_SIZE, world, cfg.data.microbatch, known.microbatch,
                                                 known.accumulation)
            run_probe(cfg, microbatch, EFFECTIVE_BATCH_SIZE)
            return 0
        split = BatchSplit.for_command_line(EFFECTIVE_BATCH_SIZE, world, cfg.data.microbatch, known.microbatch,
                                           known.accumulation)
        training_run.run_training(cfg, split)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
