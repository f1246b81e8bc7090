"""What the ranks of a run from prepared shards settle once per update, in one all-reduce of four integers.

The exact loss normalisation needs the update's target-token count over all ranks; the same all-reduce carries
a stop request (a signal on any rank), rank 0's "a metric line is due" and the digest of the update's rows
(pipeline/fingerprints.py), so every rank stops, checkpoints and reports after the same update with no other
collective. pipeline/shards.py's ``ShardUpdates`` asks for it when Lightning fetches an update's first microbatch
(``settle``, bound to the Trainer by datamodule.py's ``ShardDataModule``); callbacks/agreed_stop.py requests the
stop; shard_run.py reads why training stopped.
"""

from __future__ import annotations

import time

import lightning as L
import torch

from pipeline.report_marks import ReportMarks


class UpdateAgreement:
    """The per-update agreement of the ranks: each update's target tokens and rows digest over all ranks, whether
    any rank was asked to stop, and whether rank 0's metric interval has passed."""

    def __init__(self, report_every_seconds: float) -> None:
        self.report_every = report_every_seconds
        self.stop_signal: str | None = None  # the signal this rank received, if any
        self.stop_after: int | None = None  # the update after which every rank stops
        self.report_marks = ReportMarks()  # the updates rank 0 asked a metric line after, agreed by every rank
        self._last_report = time.monotonic()

    def request_stop(self, reason: str) -> None:
        """A signal on this rank: every rank stops after the next update the ranks settle."""
        if self.stop_signal is None:
            self.stop_signal = reason

    @property
    def stopped_by(self) -> str | None:
        """Why training stopped early, for the run record; None if it did not."""
        if self.stop_after is None:
            return None
        return self.stop_signal or "a stop signal on another rank"

    def settle(self, trainer: L.Trainer, rank_tokens: int, rank_digest: int) -> tuple[int, int]:
        """The update's target-token count and rows digest over all ranks, from this rank's shares; the stop and
        the metric line it carries are kept (``stop_after``, ``report_marks``)."""
        update = trainer.global_step + 1  # Lightning fetches an update's first microbatch after the previous step
        due = trainer.global_rank == 0 and time.monotonic() - self._last_report >= self.report_every
        if due:
            self._last_report = time.monotonic()
        tokens, stop, report, digest = rank_tokens, int(self.stop_signal is not None), int(due), rank_digest
        if trainer.world_size > 1:  # alone, a rank needs no collective (and no device round trip)
            values = torch.tensor([tokens, stop, report, digest], dtype=torch.int64,
                                  device=trainer.strategy.root_device)
            torch.distributed.all_reduce(values)
            tokens, stop, report, digest = values.tolist()
        if report:
            self.report_marks.mark(update)
        if stop and self.stop_after is None:
            self.stop_after = update
        return tokens, digest
