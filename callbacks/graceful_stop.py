"""SIGTERM or SIGINT during training: finish the update in hand, keep what was trained, then fail the run.

A cancelled RunFab job has no checkpoint recovery, so the model trained so far is exported
(the run record says ``partial``) before the process exits non-zero. Both signals take the
same path, and it does not depend on the input: a stop asked for while the input is silent ends
the stream at the update boundary instead of waiting for a record that may never come.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import lightning as L

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop(L.Callback):
    """Single process only: data-parallel ranks must stop at the same update, so there the feeder
    ends every rank's stream instead (launcher.raise_on_signals).

    ``end_input(name)`` ends the input at the next update boundary; Lightning then finishes the
    update, exports and writes the record as at any end of input. A second signal stops at once,
    right after ``before_exit()``, which removes what must not outlive the process (a half-written export).
    """

    def __init__(self, end_input: Callable[[str], None], before_exit: Callable[[], None] = lambda: None) -> None:
        self.end_input = end_input
        self.before_exit = before_exit
        self.signal_name: str | None = None
        self._trainer: L.Trainer | None = None
        self._original: dict = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Installed now, not only at the start of training: Lightning fetches the first batch before
        ``on_train_start``, and a signal while that fetch waits on a slow or silent input must end it."""
        if trainer.world_size == 1 and threading.current_thread() is threading.main_thread():
            self._original = {sig: signal.getsignal(sig) for sig in SIGNALS}  # before Lightning adds its own
            self._install(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Installed again after Lightning's SIGTERM handler, which wraps ours and would end fit by an
        exception and skip the export. (A SIGTERM before this point reaches both: nothing was trained
        yet, and Lightning's exception says so.)"""
        if self._original:
            self._install(trainer)

    def _install(self, trainer: L.Trainer) -> None:
        self._trainer = trainer
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:  # asked twice: stop now, as without this callback
            self.before_exit()
            self._restore()
            signal.raise_signal(signum)
            return
        self.signal_name = name
        log.warning("%s received: stopping after the update in hand and exporting the model trained so far; "
                    "send it again to stop at once", name)
        self._trainer.should_stop = True
        self.end_input(name)

    def _restore(self) -> None:
        for sig, handler in self._original.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()
        self._original = {}
