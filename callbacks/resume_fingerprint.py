"""What a resume must not change, stored in every checkpoint Lightning writes (periodic and on a stop).

runtime/checkpoints.py builds the values (the model's shape, the prepared rows, the seed, the batch, every
``optim.*`` key, the process count, the tokenizer) and, before Lightning loads a checkpoint, compares the
ones stored under ``FINGERPRINT_KEY`` with this run's.
"""

from __future__ import annotations

import lightning as L

FINGERPRINT_KEY = "runfab_resume"  # where a checkpoint keeps what a resume must not change


class ResumeFingerprint(L.Callback):
    """Stores ``values`` in every checkpoint under ``FINGERPRINT_KEY``."""

    def __init__(self, values: dict) -> None:
        self.values = values

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint[FINGERPRINT_KEY] = dict(self.values)
