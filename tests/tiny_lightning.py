"""A tiny real Lightning run for the callbacks' unit tests: a model whose updates take milliseconds, a
stream of microbatches of unknown length, as the pipeline's is, ``fit`` over six updates of it, and a callback
that signals the process at a chosen microbatch."""

from __future__ import annotations

import signal

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
from torch.utils.data import DataLoader, IterableDataset


class TinyRegression(L.LightningModule):
    """One linear layer fitted to a fixed target: a few updates take milliseconds."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(batch), torch.ones(len(batch), 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Stream(IterableDataset):
    """``n`` microbatches of two rows, the same for every run, with no ``len``: it ends where it ends, as the
    pipeline's stream ends at an update boundary."""

    def __init__(self, n: int) -> None:
        self.batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(n)]

    def __iter__(self):
        return iter(self.batches)


def microbatches(n: int) -> DataLoader:
    """The loader Lightning reads ``Stream(n)`` through, one microbatch at a time."""
    return DataLoader(Stream(n), batch_size=None)


ACCUMULATE = 2  # microbatches per update


def fit(*callbacks: L.Callback, max_steps: int = 6, ckpt_path=None) -> L.Trainer:
    """A CPU run of up to ``max_steps`` updates of ACCUMULATE microbatches over a stream that holds six, with
    ``callbacks`` (Lightning's checkpointing on only where one of them is a ModelCheckpoint)."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=1,
                        accumulate_grad_batches=ACCUMULATE, logger=False,
                        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(TinyRegression(), microbatches(6 * ACCUMULATE), ckpt_path=ckpt_path)
    return trainer


class SignalAt(L.Callback):
    """Sends this process ``signum`` when microbatch ``batch_idx`` starts."""

    def __init__(self, signum: int, batch_idx: int) -> None:
        self.signum, self.batch_idx = signum, batch_idx

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx:
            signal.raise_signal(self.signum)
