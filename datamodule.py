"""The LightningDataModule: training batches from a stream of complete updates, validation from the held-out pool.

The stream is the feeder's queue (feeder.py) in a single process, or the feeder's socket
(launcher.py) in a data-parallel worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from pipeline.stages import StreamSettings, StreamStats, ValidationPool, collate_rows, pack_rows



class _BatchStream(IterableDataset):
    def __init__(self, batches: Callable[[], Iterator[dict]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[dict]:
        return self.batches()


class _ValidationDataset(IterableDataset):
    """Packs the pool's documents as they are at the start of each validation run; rows are split over ranks."""

    def __init__(self, pool: ValidationPool, seq_len: int, microbatch: int, rank: int, world_size: int) -> None:
        self.pool, self.seq_len, self.microbatch = pool, seq_len, microbatch
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[dict]:
        rows = list(pack_rows(self.pool.snapshot(), self.seq_len, StreamStats(), pad_last=True))[self.rank :: self.world_size]
        for i in range(0, len(rows), self.microbatch):
            yield collate_rows(rows[i : i + self.microbatch])


class StreamingDataModule(L.LightningDataModule):
    """Training batches from a stream of complete updates (this rank's share); validation from the held-out pool.

    The stream is the feeder's queue in a single process, or the feeder's socket in a data-parallel worker.
    """

    def __init__(
        self, batches: Callable[[], Iterator[dict]], pool: ValidationPool, settings: StreamSettings,
        rank: int = 0, pin_memory: bool = False, on_teardown: Callable[[], object] | None = None,
    ) -> None:
        super().__init__()
        self.batches, self.pool, self.settings = batches, pool, settings
        self.rank = rank
        self.pin_memory = pin_memory
        self.on_teardown = on_teardown

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_BatchStream(self.batches), batch_size=None, pin_memory=self.pin_memory)

    def val_dataloader(self) -> DataLoader:
        s = self.settings
        dataset = _ValidationDataset(self.pool, s.seq_len, s.microbatch, self.rank, s.world_size)
        return DataLoader(dataset, batch_size=None, pin_memory=self.pin_memory)

    def teardown(self, stage: str) -> None:
        if self.on_teardown is not None:
            self.on_teardown()
