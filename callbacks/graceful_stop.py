"""SIGTERM or SIGINT during training: finish the step, keep what was trained, then fail the run.

A cancelled RunFab job has no checkpoint recovery, so the model trained so far is exported
(the run record says ``partial``) before the process exits non-zero.
"""

from __future__ import annotations

import logging
import signal
import threading

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from callbacks.export import ExportModel
from callbacks.run_record import RunRecord

log = logging.getLogger(__name__)


class GracefulStop(L.Callback):
    """Single process only: data-parallel ranks must stop at the same step, so there the feeder
    stops every worker instead (launcher.raise_on_signals)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._trainer: L.Trainer | None = None
        self._previous: dict = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size == 1 and threading.current_thread() is threading.main_thread():
            self._trainer = trainer
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: stopping after this step and exporting the model trained so far", self.signal_name)
        self._trainer.should_stop = True
        self._mark_partial(self._trainer)

    def _mark_partial(self, trainer: L.Trainer) -> None:
        for callback in trainer.callbacks:
            if isinstance(callback, RunRecord):
                callback.status = f"partial: {self.signal_name}"

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """Lightning's own SIGTERM handling ends fit by exception, so on_train_end never runs: export here."""
        if not isinstance(exception, SIGTERMException):
            return
        self.signal_name = self.signal_name or "SIGTERM"
        self._mark_partial(trainer)
        for callback in trainer.callbacks:  # the export first: the record describes it
            if isinstance(callback, ExportModel):
                callback.export_now(trainer, pl_module)
        for callback in trainer.callbacks:
            if isinstance(callback, RunRecord):
                callback.write(trainer, pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
