"""SIGTERM or SIGINT during training: stop after the microbatch in hand, keep the updates trained, then fail the run.

An update the signal interrupts is not applied (Lightning ends the epoch inside it and its gradients are
dropped); a resume on the same input reads its microbatches again.

A cancelled RunFab job has no checkpoint recovery, so the model trained so far is exported
(the run record says ``partial``) before the process exits non-zero. Both signals take the
same path, and it does not depend on the input: a stop asked for while the input is silent ends
the stream at the update boundary instead of waiting for a record that may never come.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import lightning as L

from runfab.lifetime import on_stop_signals

log = logging.getLogger(__name__)


class GracefulStop(L.Callback):
    """Single process only: data-parallel ranks must stop at the same update, so there the feeder
    ends every rank's stream instead (launcher.raise_on_signals).

    ``end_input(name)`` ends the input at the next update boundary (for a signal while the input is silent) and
    ``trainer.should_stop`` ends training after the microbatch in hand; the run then exports and writes the
    record as at any end of input. A second signal stops at once,
    right after ``before_exit()``, which removes what must not outlive the process (a half-written export,
    the output folder's lock).
    """

    def __init__(self, end_input: Callable[[str], None], before_exit: Callable[[], None] = lambda: None) -> None:
        self.end_input = end_input
        self.before_exit = before_exit
        self.signal_name: str | None = None
        self._trainer: L.Trainer | None = None
        self._restore: Callable[[], None] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Installed now, not only at the start of training: Lightning fetches the first batch before
        ``on_train_start``, and a signal while that fetch waits on a slow or silent input must end it."""
        if trainer.world_size == 1:
            self._trainer = trainer
            self._restore = on_stop_signals(self._handle)  # keeps the handlers from before Lightning adds its own

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Installed again after Lightning's SIGTERM handler, which wraps ours and would end fit by an
        exception and skip the export. (A SIGTERM before this point reaches both: nothing was trained
        yet, and Lightning's exception says so.)"""
        if self._restore is not None:
            on_stop_signals(self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:  # asked twice: stop now, as the signal's default does
            self.before_exit()
            on_stop_signals(signal.SIG_DFL)  # not the handler from before, which may raise and be caught
            signal.raise_signal(signum)
            return
        self.signal_name = name
        log.warning("%s received: stopping after the microbatch in hand and exporting the model trained so far; "
                    "send it again to stop at once", name)
        self._trainer.should_stop = True
        self.end_input(name)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None
