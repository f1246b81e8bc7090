"""A tiny real Lightning run for the callbacks' unit tests: a model whose updates take milliseconds and a
stream of microbatches of unknown length, as the pipeline's is."""

from __future__ import annotations

import lightning as L
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
