"""The Lightning Trainer, built in one place for training and the probe, so both run the same settings.

What it computes on (accelerator, devices, precision, strategy) is device_policy.py's decision; what
a training run adds (its steps, time limit, accumulation, validation and checkpoint cadence) is
``training_arguments``; the config's other Trainer arguments (``trainer.lightning``) come last but
for the caller's.
"""

from __future__ import annotations

import sys

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException

from config import ConfigError, RunConfig
from runtime.batch_split import BatchSplit
from runtime.device_policy import resolve_precision, resolve_strategy


def build_trainer(cfg: RunConfig, accelerator: str, world: int, **overrides) -> L.Trainer:
    """A Trainer on ``world`` ranks of ``accelerator``, with ``trainer.lightning`` and then ``overrides``
    applied; a Trainer argument of the config that Lightning refuses is a ConfigError naming it."""
    arguments = dict(
        accelerator=accelerator,
        devices=world,
        strategy=resolve_strategy(cfg, accelerator, world),
        precision=resolve_precision(cfg, accelerator),
        max_epochs=1,  # the stream is one pass
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        gradient_clip_val=cfg.trainer.gradient_clip_val,  # lit_module's configure_gradient_clipping clips with it
    )
    arguments.update(cfg.trainer.lightning)  # config.py refuses those that must stay as set here or by the caller
    arguments.update(overrides)
    try:
        return L.Trainer(**arguments)
    except (TypeError, ValueError, MisconfigurationException) as error:
        if not cfg.trainer.lightning:
            raise
        given = ", ".join(f"trainer.{name}={value!r}" for name, value in cfg.trainer.lightning.items())
        reason = " ".join(str(error).split())
        raise ConfigError(f"Lightning's Trainer refused its arguments ({given}): {reason}") from None


def validates(cfg: RunConfig) -> bool:
    """Whether training validates periodically: an interval, and a validation file or a held-out share of
    the input."""
    return cfg.trainer.val_every_steps > 0 and (cfg.data.val_path is not None or cfg.data.val_fraction > 0)


def shows_progress(cfg: RunConfig) -> bool:
    """Whether training draws its progress bar (callbacks/progress.py): asked for, or stderr is a terminal."""
    return cfg.trainer.enable_progress_bar if cfg.trainer.enable_progress_bar is not None else sys.stderr.isatty()


def training_arguments(cfg: RunConfig, split: BatchSplit) -> dict:
    """The Trainer arguments of a training run: how long it trains, how many microbatches make an
    update, when it validates and checkpoints, and whether it draws a progress bar."""
    validate = validates(cfg)
    every = cfg.trainer.checkpoint_every_steps
    return dict(
        max_steps=cfg.trainer.max_steps, max_time=cfg.trainer.time_limit(),
        accumulate_grad_batches=split.accumulation,
        val_check_interval=cfg.trainer.val_every_steps * split.accumulation if validate else None,
        limit_val_batches=(cfg.trainer.limit_val_batches or 1.0) if validate else 0,
        enable_checkpointing=every > 0,
        enable_progress_bar=shows_progress(cfg),
        default_root_dir=cfg.output.root,
    )
