"""The stop of a run from prepared shards: SIGTERM or SIGINT on any rank, every rank finishes the same
update (runtime/update_agreement.py's UpdateAgreement), the checkpoint is written, and training ends."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import lightning as L

from runfab.lifetime import on_stop_signals, stop_handlers_now

log = logging.getLogger(__name__)


class AgreedStop(Protocol):
    """What this callback asks and reads of the ranks' per-update agreement (runtime/update_agreement.py)."""

    stop_signal: str | None  # the signal this rank received, if any
    stop_after: int | None  # the update after which every rank stops, once the ranks agreed on it

    def request_stop(self, reason: str) -> None: ...


class StopAtAgreedUpdate(L.Callback):
    """SIGTERM or SIGINT on any rank: every rank finishes the same update, the checkpoint is written,
    and training ends; a second signal ends the process at once, right after ``before_exit()``, which
    removes what must not outlive the process (a half-written export, the output folder's lock).

    Installed when training starts, over Lightning's handler (which would end fit between
    microbatches, without a checkpoint) and over GracefulStop's (which ends a single process's
    stream without one). After fit the handlers found at setup are back, those from before Lightning's."""

    def __init__(self, agreement: AgreedStop, checkpoint: Path,
                 before_exit: Callable[[], None] = lambda: None) -> None:
        self.agreement, self.checkpoint, self.before_exit = agreement, checkpoint, before_exit
        self.saved: str | None = None
        self._restore = lambda: None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore = stop_handlers_now()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        on_stop_signals(self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.agreement.stop_signal is not None:  # asked twice: stop now, as the signal's default does
            self.before_exit()
            on_stop_signals(signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        log.warning("%s received: every rank finishes the update in hand, then the checkpoint is written and "
                    "training stops (resume with --ckpt_path last); send it again to stop at once", name)
        self.agreement.request_stop(name)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        stop_after = self.agreement.stop_after
        if stop_after is None or trainer.global_step != stop_after or self.saved:
            return
        self.saved = str(self.checkpoint)
        trainer.save_checkpoint(self.checkpoint)  # every rank takes part; rank 0 writes
        trainer.should_stop = True

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()
        self._restore = lambda: None
