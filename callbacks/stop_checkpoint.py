"""The checkpoint a run on stdin writes when a signal (or a failing input) ends it before its input did.

The stream ends at an update boundary that every rank shares (pipeline/feeder.py), and Lightning then
ends the epoch; a checkpoint taken at that point would say the epoch is over, and a resume from it would
train nothing more. So the loop counters are taken at each update boundary, and the checkpoint written
when training ends early carries the last of them: it is the checkpoint the periodic saves would have
written at that update, which ``--ckpt_path last`` resumes from.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path

import lightning as L

log = logging.getLogger(__name__)


class StopCheckpoint(L.Callback):
    """Writes ``path`` at the end of training when ``stopped_early()`` gives a reason (every rank calls
    it, rank 0 writes), with the loops as they stood after the last update."""

    def __init__(self, path: Path, stopped_early: Callable[[], str | None]) -> None:
        self.path, self.stopped_early = Path(path), stopped_early
        self._loops: dict | None = None
        self._step = -1
        self._saving = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._step:  # an update just ended: the loops are at its boundary
            self._step = trainer.global_step
            self._loops = copy.deepcopy(trainer.fit_loop.state_dict())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reason = self.stopped_early()
        if reason is None or self._loops is None or trainer.global_step != self._step:
            return
        self._saving = True
        try:
            trainer.save_checkpoint(self.path)
        finally:
            self._saving = False
        log.info("%s: checkpoint of update %d written to %s (resume with --ckpt_path last)", reason,
                 trainer.global_step, self.path)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self._saving:
            checkpoint["loops"]["fit_loop"] = self._loops
