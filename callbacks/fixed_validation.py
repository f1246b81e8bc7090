"""The validation cross-entropy of the initial and of the final weights on the run's one validation
set: the run's "before -> after", the same number for every run on the same set.

The set is fixed before training (pipeline/validation_split.py): held out from the start of the
input, read from ``data.val_path``, or the split that ``python -m tools prepare`` wrote beside the
shards; the periodic validation uses the same set. "Before" is computed as the first update starts,
on the initial weights (``ValidationBeforeTraining``, placed ahead of the metrics so its time is not
training time). Where the set was not complete by then (an input slower than training), or on a
resumed run, it is computed at the end on the initial weights built again from the seed, whose
digest must match the one taken before update 1 (history.py): a "before" that was not computed on
the very initial weights is not reported. Rank 0 computes both, on its device, with the Trainer's
precision; no other rank takes part. Both are also logged to the Trainer's loggers as ``val_loss``
at updates 0 and the last.

The cross-entropy is scoring.py's exact token-weighted mean over the set packed into rows, as
``python -m tools evaluate`` computes it; the set is saved in the format ``pipeline/validation_split.py`` writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import torch

from pipeline import fingerprints
from pipeline.validation_split import ValidationPool, write_documents
from scoring import cross_entropy

log = logging.getLogger(__name__)


class FixedValidation(L.Callback):
    """At the end of training (rank 0): how the validation set was formed, its digest and size, and the
    cross-entropy of the initial and final weights on it. Placed before the export, which reads the
    same weights."""

    def __init__(self, pool: ValidationPool, seq_len: int, microbatch: int,
                 initial_model: Callable[[torch.device], torch.nn.Module], initial_digest: Callable[[], str | None],
                 save_to: Path | None = None, validated_at: Callable[[], int | None] = lambda: None) -> None:
        """``validated_at()`` is the update of the last periodic validation: the final one is not logged
        again at that update."""
        self.pool, self.seq_len, self.microbatch = pool, seq_len, microbatch
        self.initial_model, self.initial_digest = initial_model, initial_digest
        self.save_to, self.validated_at = save_to, validated_at
        self.before: dict | None = None
        self.result: dict | None = None

    def measure_before(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The initial weights' cross-entropy: those being trained before update 1, else built again."""
        docs = self.pool.snapshot()
        if not docs:
            return
        device, context = pl_module.device, trainer.precision_plugin.forward_context
        if trainer.global_step == 0:
            self.before = {"ce_before": cross_entropy(pl_module.model, docs, self.seq_len, self.microbatch, device,
                                                      context)["cross_entropy"]}
        else:
            self.before = self._rebuilt_before(docs, device, context)
        if self.before.get("ce_before") is not None:
            log.info("validation cross-entropy of the initial weights: %.4f (%d documents)", self.before["ce_before"],
                     len(docs))
            log_points(trainer, 0, {"val_loss": self.before["ce_before"]})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.global_step == 0:
            return
        docs = self.pool.snapshot()
        result = {**self.pool.description(), **fingerprints.validation_digest(docs), "ce_before": None,
                  "ce_after": None}
        if not self.pool.closed and docs:
            log.warning("training ended while the validation set was still being gathered (the input was slower "
                        "than training): validation uses the %d documents gathered, a set that depends on how far "
                        "the run read", len(docs))
        if docs:
            device, context = pl_module.device, trainer.precision_plugin.forward_context
            result["ce_after"] = cross_entropy(pl_module.model, docs, self.seq_len, self.microbatch, device,
                                               context)["cross_entropy"]
            if self.before is None:
                self.measure_before(trainer, pl_module)
            result |= self.before or {}
            log.info("validation cross-entropy on the fixed set (%d documents, %d tokens): %s -> %.4f",
                     result["documents"], result["tokens"],
                     "?" if result["ce_before"] is None else f"{result['ce_before']:.4f}", result["ce_after"])
            if self.validated_at() != trainer.global_step:
                log_points(trainer, trainer.global_step, {"val_loss": result["ce_after"]})
            if self.save_to is not None:
                self.save_to.parent.mkdir(parents=True, exist_ok=True)
                write_documents(docs, self.save_to)
                result["file"] = str(self.save_to)
        self.result = result

    def _rebuilt_before(self, docs: list[np.ndarray], device: torch.device, context) -> dict:
        from callbacks.history import model_weights_digest

        expected = self.initial_digest()
        if expected is None:
            return {"ce_before_missing": "the initial weights' digest is unknown (resumed from a checkpoint "
                                         "without it)"}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model = self.initial_model(device)
        try:
            if model_weights_digest(model) != expected:
                return {"ce_before_missing": "the weights built again from the seed differ from the run's initial "
                                             "weights"}
            return {"ce_before": cross_entropy(model, docs, self.seq_len, self.microbatch, device,
                                               context)["cross_entropy"]}
        finally:
            del model


class ValidationBeforeTraining(L.Callback):
    """The "before" of a FixedValidation, as the first update of the fit starts (rank 0), when the set is
    complete by then; placed first among the callbacks, so its time is outside every training measure."""

    def __init__(self, fixed: FixedValidation) -> None:
        self.fixed = fixed
        self._first = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first, self._first = self._first, False
        if first and trainer.is_global_zero and self.fixed.pool.closed:
            self.fixed.measure_before(trainer, pl_module)


def log_points(trainer: L.Trainer, step: int, values: dict) -> None:
    """``values`` at optimizer update ``step`` to each of the Trainer's loggers."""
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)
