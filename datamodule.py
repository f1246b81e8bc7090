"""The LightningDataModules: ``StreamingDataModule`` gives training batches from a stream of complete
updates and validation from the validation set (the stream is the feeder's queue, pipeline/feeder.py,
in a single process, or the feeder's socket, pipeline/feeder_wire.py, in a data-parallel worker);
``ShardDataModule`` gives training batches from prepared rows (pipeline/shards.py).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from pipeline.feeder import INPUT_PENDING
from pipeline.shards import GroupCollate, ShardsError, ShardUpdates, open_rows
from pipeline.packing import collate_rows, pack_rows
from pipeline.records import StreamStats
from pipeline.stream import StreamSettings
from pipeline.validation_split import ValidationPool

log = logging.getLogger(__name__)


class PendingMicrobatch:
    """Stands in for the first microbatch of an update that had not arrived when Lightning fetched it.

    Lightning fetches one microbatch ahead of the one it trains, so without a stand-in the last
    microbatch of an update would wait, untrained, until the next update arrived: on a slow input
    every optimizer step would lag one update behind the data. ``batch`` is filled in (or stays
    None at the end of the stream) before Lightning uses the stand-in: it fetches the next item first.
    """

    batch: dict | None = None


class _BatchStream(IterableDataset):
    """The stream's microbatches, a PendingMicrobatch where one has not arrived, and how long
    training waited for input (``wait_seconds``: while resolving stand-ins)."""

    def __init__(self, batches: Callable[[], Iterator[dict]]) -> None:
        self.batches = batches
        self.wait_seconds = 0.0

    def __iter__(self) -> Iterator[dict | PendingMicrobatch]:
        pending: PendingMicrobatch | None = None
        waiting_since = 0.0
        for item in self.batches():
            if item is INPUT_PENDING:
                if pending is None:
                    pending = PendingMicrobatch()
                    yield pending
                    waiting_since = time.perf_counter()  # Lightning asks for the next item: training waits now
                continue
            if pending is not None:
                pending.batch = item
                self.wait_seconds += time.perf_counter() - waiting_since
                pending = None
                continue
            yield item
        if pending is not None:
            self.wait_seconds += time.perf_counter() - waiting_since


class _ValidationDataset(IterableDataset):
    """Packs the validation set's documents into rows split over ranks; nothing while the set is still
    being gathered after ``update()`` (an input slower than training), the same on every rank."""

    def __init__(self, pool: ValidationPool, seq_len: int, microbatch: int, rank: int, world_size: int,
                 update: Callable[[], int]) -> None:
        self.pool, self.seq_len, self.microbatch = pool, seq_len, microbatch
        self.rank, self.world_size, self.update = rank, world_size, update

    def __iter__(self) -> Iterator[dict]:
        if not self.pool.ready_after(self.update()):
            if self.rank == 0:
                log.warning("validation after update %d skipped: the validation set is still being gathered (the "
                            "input has been slower than training since the start)", self.update())
            return
        rows = list(pack_rows(self.pool.snapshot(), self.seq_len, StreamStats(), pad_last=True))[self.rank :: self.world_size]
        for i in range(0, len(rows), self.microbatch):
            yield collate_rows(rows[i : i + self.microbatch])


class StreamingDataModule(L.LightningDataModule):
    """Training batches from a stream of complete updates (this rank's share); validation from the validation set.

    The stream is the feeder's queue in a single process, or the feeder's socket in a data-parallel
    worker; either may give INPUT_PENDING where the input keeps training waiting.
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
        self._stream = _BatchStream(batches)

    @property
    def input_wait_seconds(self) -> float:
        """Seconds training has waited for input since its first update (the wait for the first is startup)."""
        return self._stream.wait_seconds

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._stream, batch_size=None, pin_memory=self.pin_memory)

    def val_dataloader(self) -> DataLoader:
        s = self.settings
        dataset = _ValidationDataset(self.pool, s.seq_len, s.microbatch, self.rank, s.world_size,
                                     lambda: self.trainer.global_step)
        return DataLoader(dataset, batch_size=None, pin_memory=self.pin_memory)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """A stand-in becomes its microbatch here (it left the loader unpinned: it waited on the
        input, so the copy's speed does not matter); one the stream ended behind ends the epoch,
        which is the stream's one pass, before Lightning counts it as a batch."""
        if not isinstance(batch, PendingMicrobatch):
            return batch
        if batch.batch is None:
            raise StopIteration
        return batch.batch

    def teardown(self, stage: str) -> None:
        if self.on_teardown is not None:
            self.on_teardown()


class ShardDataModule(L.LightningDataModule):
    """Training batches from prepared rows; no periodic validation (the run scores the validation split
    beside the rows at its end: fixed_validation.py). ``settle(trainer, rank_tokens, rank_digest)`` is the ranks'
    per-update agreement (runtime/update_agreement.py): the update's target tokens and rows digest over all ranks."""

    input_wait_seconds = 0.0  # the loader reads prepared chunks ahead of training; no wait is measured here

    def __init__(self, path: str, seq_len: int, microbatch: int, accumulation: int, seed: int, workers: int,
                 settle: Callable[[L.Trainer, int, int], tuple[int, int]], pin_memory: bool = False) -> None:
        super().__init__()
        self.path, self.seq_len, self.seed, self.workers = path, seq_len, seed, workers
        self.microbatch, self.accumulation = microbatch, accumulation
        self.settle, self.pin_memory = settle, pin_memory

    def train_dataloader(self) -> ShardUpdates:
        # Called after the process group exists, so LitData sees this rank's place in it.
        rows = self.microbatch * self.accumulation
        collate = GroupCollate(self.seq_len, self.microbatch)
        loader = open_rows(self.path, self.seed, rows, self.workers, collate, self.pin_memory)
        if len(loader) == 0:
            raise ShardsError(
                f"{self.path} gives this rank no complete update: an update takes {rows} rows on each of "
                f"{self.trainer.world_size} rank(s); prepare more text, or lower the batch (trainer.global_batch_size)"
            )
        return ShardUpdates(loader, self.accumulation, functools.partial(self.settle, self.trainer))

