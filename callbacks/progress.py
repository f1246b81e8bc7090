"""The progress bar, on stderr (stdout carries the metric lines only): optimizer updates out of
``trainer.max_steps`` with the time left, where Lightning's own bar counts microbatches of a stream of
unknown length. Shown at a terminal, or where ``trainer.enable_progress_bar`` asks for it."""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm


class UpdateProgressBar(TQDMProgressBar):
    """``Training: 40%|####      | 120/300 [01:02<01:33, 1.93update/s]``; without a step limit the count
    and the rate alone. Validation's bar counts its batches, as Lightning's does."""

    def init_train_tqdm(self) -> Tqdm:
        return Tqdm(desc="Training", unit="update", leave=True, dynamic_ncols=True, file=sys.stderr, smoothing=0.1,
                    disable=self.is_disabled, bar_format=self.BAR_FORMAT)

    def init_validation_tqdm(self) -> Tqdm:
        return Tqdm(desc=self.validation_description, position=1, leave=False, dynamic_ncols=True, file=sys.stderr,
                    disable=self.is_disabled, bar_format=self.BAR_FORMAT)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.count_updates(trainer)  # a run resumed inside its epoch (--ckpt_path last) gets no epoch start

    def on_train_epoch_start(self, trainer: L.Trainer, *_) -> None:
        self.count_updates(trainer)

    def count_updates(self, trainer: L.Trainer) -> None:
        """The bar counts updates out of ``trainer.max_steps``, from the update a resumed run goes on from."""
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
        bar.initial = bar.n = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        if bar is not None and trainer.global_step != bar.n:  # an update completed
            bar.update(trainer.global_step - bar.n)
