"""The stream beside training: a daemon thread runs the stages and fills one bounded queue per rank.

stdin is read by the process that owns it, and the training loop (or, with several GPUs, each
rank's sender in feeder_wire.py) only ever takes complete updates, every rank the same number.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from pipeline.records import StreamStats
from pipeline.resume import TrainedUpdates, skip_trained
from pipeline.stream import StreamSettings, stream_updates
from pipeline.validation_split import ValidationPool

log = logging.getLogger(__name__)


_END = object()
POLL_SECONDS = 0.1  # how often a waiting consumer looks up from an empty queue (a stop request may have come)


class _InputPending:
    def __repr__(self) -> str:
        return "INPUT_PENDING"


INPUT_PENDING = _InputPending()
"""Given (by ``iterate(mark_waits=True)`` and feeder_wire.FeederConnection) at an update boundary when
the next update has not arrived: the consumer may then finish the update it holds before waiting
(datamodule.py hands Lightning a stand-in for the microbatch it fetches one ahead)."""


class UpdateFeeder:
    """Runs ``stream_updates`` on a daemon thread and fills one bounded queue per rank.

    The queues hold at most ``prefetch_updates`` updates, so the reader stays a bounded
    distance ahead of training. Every rank's stream ends at the same update boundary: at the end
    of input, on ``finish`` (a signal), or on an input error once training has started, which is
    then kept as ``input_error`` instead of ending the run without its model.
    """

    def __init__(self, open_stream: Callable[[], tuple[BinaryIO, str]], settings: StreamSettings,
                 encode_batch: Callable, pool: ValidationPool, report_every: float | None = None,
                 time_limit_seconds: float | None = None, trained: TrainedUpdates | None = None) -> None:
        """``report_every`` (seconds) marks updates with ``report=1`` so that data-parallel ranks
        agree on when to report metrics without a collective; held-out documents then also travel
        to every rank (as ValidationDocument items) so each worker holds the same pool.

        ``time_limit_seconds`` (``trainer.max_time`` less the export reserve, counted from the first
        request for data) ends every rank's stream at an update boundary once it has passed while
        training waits for input. Lightning checks its own ``max_time`` only between steps, and a
        loop blocked on a silent stdin never gets there: the model would never be exported.

        ``trained``: the updates a resumed run's checkpoint trained, read again, checked and not handed
        to training (pipeline/resume.py)."""
        self.trained = trained
        self.time_limit_seconds = time_limit_seconds
        self.time_limit_reached = False  # the streams ended because the time limit passed while waiting
        self._deadline: float | None = None
        self.settings = settings
        self.report_every = report_every
        self.error: BaseException | None = None  # set by a data-parallel sender that met a pipeline error
        self.input_error: BaseException | None = None  # the input failed after training started
        self.early_end: str | None = None  # why the streams ended before the input did, if they did
        self.stats = StreamStats()
        self.pool = pool
        self._open_stream = open_stream
        self._encode_batch = encode_batch
        capacity = settings.data.prefetch_updates * settings.accumulation
        self.queues = [queue.Queue(maxsize=capacity) for _ in range(settings.world_size)]
        self._stop = threading.Event()
        self._finishing = threading.Event()
        self._boundary = threading.Lock()  # guards the updates each rank started and the common last one
        self._started = [0] * settings.world_size
        self._last_update: int | None = None
        self._start_lock = threading.Lock()
        self._finished = [False] * settings.world_size
        self._thread = threading.Thread(target=self._run, name="update-feeder", daemon=True)

    def start(self) -> None:
        """Start reading; safe to call from every rank's sender thread at once."""
        with self._start_lock:
            if self._thread.ident is None and not self._stop.is_set():
                if self.time_limit_seconds is not None:
                    self._deadline = time.monotonic() + self.time_limit_seconds
                self._thread.start()

    def stop(self) -> None:
        """Stop at once (teardown): queued items are abandoned."""
        self._stop.set()

    def finish(self, reason: str) -> None:
        """End every rank's stream at the next update boundary they share; safe in a signal handler."""
        if self.early_end is None:
            self.early_end = reason
        self._finishing.set()

    def _end_at_time_limit(self) -> None:
        """The time limit passed while waiting for input: a normal end (not ``early_end``), as
        Lightning's own ``max_time`` stop is; every rank stops at the next common update boundary."""
        if not self._finishing.is_set():
            self.time_limit_reached = True
            log.warning("trainer.max_time (less the export reserve) has passed while training waited for input: "
                        "training ends at this update boundary and the model is exported")
            self._finishing.set()

    def close(self, timeout: float = 2.0) -> dict:
        """Stop reading and return the input summary.

        When training stops before the input ends, the counts cover what was read, which runs
        at most ``prefetch_updates`` updates ahead of training. A thread blocked on a silent
        stdin cannot be joined; it is a daemon, holds no Python lock, and ends with the process.
        """
        self.stop()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return self.stats.as_dict()

    def _put(self, rank: int, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self.queues[rank].put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        final: object = _END
        pool = self.pool if self.report_every is None else _ForwardingPool(self.pool, self)
        last_report = time.monotonic()
        try:
            stream, self.stats.source = self._open_stream()
            log.info("reading records from %s", self.stats.source)
            updates = stream_updates(stream, self.settings, self._encode_batch, self.stats, pool)
            for per_rank in skip_trained(updates, self.trained):
                if self.report_every is not None and time.monotonic() - last_report >= self.report_every:
                    last_report = time.monotonic()
                    for microbatches in per_rank:
                        microbatches[-1]["report"] = 1
                for rank, microbatches in enumerate(per_rank):  # a started update is always put whole
                    for mb in microbatches:
                        if not self._put(rank, mb):
                            return
                if self._finishing.is_set():
                    return
        except BaseException as error:  # handed to the training loop, which re-raises it
            final = error
        for rank in range(len(self.queues)):
            self._put(rank, final)

    def _past_last_update(self, rank: int, updates: int, starting: bool) -> bool:
        """At an update boundary: has this rank reached the last update every rank will train?

        Once a stop is asked for, the last update is the furthest any rank has started, so no rank
        is left waiting in a collective for an update another rank never gets. ``starting`` records
        that this rank holds the first microbatch of update ``updates + 1``.
        """
        with self._boundary:
            if self._finishing.is_set() and self._last_update is None:
                self._last_update = max(self._started)
            if self._last_update is not None and updates >= self._last_update:
                return True
            if starting:
                self._started[rank] = updates + 1
            return False

    def iterate(self, rank: int = 0, mark_waits: bool = False) -> Iterator[dict | ValidationDocument | ValidationClosed | _InputPending]:
        """The rank's items, complete updates only; the stream is consumed once, so a second pass yields nothing.

        With ``mark_waits``, INPUT_PENDING comes first whenever an update after the first is not
        there yet when asked for.
        """
        self.start()
        per_update = self.settings.accumulation
        remaining = self.settings.max_updates
        if remaining is not None and self.trained is not None:
            remaining -= self.trained.count
        taken = 0  # microbatches yielded
        marked = False
        while not self._finished[rank]:
            boundary = taken % per_update == 0
            if boundary and taken // per_update == remaining:
                break  # Lightning fetches one batch ahead: it must not wait on the input for one it never trains
            if boundary and self._past_last_update(rank, taken // per_update, starting=False):
                break
            if mark_waits and boundary and taken and not marked and self.queues[rank].empty():
                marked = True
                yield INPUT_PENDING
                continue
            try:
                item = self.queues[rank].get(timeout=POLL_SECONDS)
            except queue.Empty:  # training is ahead of the input (the GPU may starve meanwhile)
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._end_at_time_limit()
                continue
            marked = False
            if item is _END:
                break
            if isinstance(item, BaseException):
                if taken < per_update:
                    raise item  # nothing trained yet: the run fails with the input's own error
                log.error("the input failed after %d complete updates; training stops there and the model "
                          "trained so far is exported: %s: %s", taken // per_update, type(item).__name__, item)
                self.input_error = item
                self.finish(f"input error: {type(item).__name__}: {item}")
                break
            if isinstance(item, dict):
                if boundary and self._past_last_update(rank, taken // per_update, starting=True):
                    break
                taken += 1
            yield item
        self._finished[rank] = True


@dataclass
class ValidationDocument:
    """A held-out document on its way to a data-parallel worker's own pool."""

    tokens: np.ndarray


@dataclass
class ValidationClosed:
    """The held-out set is complete (ValidationPool.close's arguments), on its way to a worker's own pool."""

    closed_by: str
    after_updates: int
    documents_read: int | None


class _ForwardingPool:
    """The feeder's pool, which also sends every document it keeps, and its closing, to each rank in
    stream order: a worker's pool is complete before the first update assembled after the closing."""

    def __init__(self, pool: ValidationPool, feeder: UpdateFeeder) -> None:
        self.pool, self.feeder = pool, feeder
        self.max_tokens = pool.max_tokens

    @property
    def closed(self) -> bool:
        return self.pool.closed

    def offer(self, tokens: np.ndarray) -> bool:
        if not self.pool.offer(tokens):
            return False
        self._send(ValidationDocument(tokens))
        return True

    def close(self, closed_by: str, after_updates: int = 0, documents_read: int | None = None) -> None:
        self.pool.close(closed_by, after_updates, documents_read)
        self._send(ValidationClosed(closed_by, after_updates, documents_read))

    def _send(self, item: object) -> None:
        for rank in range(len(self.feeder.queues)):
            self.feeder._put(rank, item)
