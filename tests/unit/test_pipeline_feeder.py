"""pipeline/feeder.py: the stream beside training, its per-rank queues, how it ends and what it forwards."""

from __future__ import annotations

import io
import threading
import time

import pytest

from pipeline.feeder import UpdateFeeder
from pipeline.records import UnusableInputError
from pipeline.validation_split import ValidationPool
from tests.helpers import BrokenAfter
from tests.pipeline_helpers import fake_encode, ndjson, stream_settings


def test_the_feeder_delivers_complete_updates_then_ends_and_forwards_errors():
    data = ndjson(*({"input_ids": [3] * 50} for _ in range(100)))
    s = stream_settings(val_fraction=0.0)
    feeder = UpdateFeeder(lambda: (io.BytesIO(data), "test"), s, fake_encode, ValidationPool(0))
    microbatches = list(feeder.iterate())
    assert len(microbatches) == feeder.stats.updates * s.accumulation > 0
    assert list(feeder.iterate()) == []  # one pass: a second iteration ends at once

    broken = UpdateFeeder(lambda: (io.BytesIO(ndjson({"image_b64": "x"})), "test"), s, fake_encode, ValidationPool(0))
    with pytest.raises(UnusableInputError):
        list(broken.iterate())


def test_feeder_start_is_safe_from_several_threads_at_once():
    s = stream_settings(val_fraction=0.0, world_size=2)
    errors = []
    previous_hook, threading.excepthook = threading.excepthook, lambda args: errors.append(args.exc_value)
    try:
        for _ in range(300):
            feeder = UpdateFeeder(lambda: (io.BytesIO(b""), "test"), s, fake_encode, ValidationPool(0))
            barrier = threading.Barrier(2)
            starters = [threading.Thread(target=lambda: (barrier.wait(), feeder.start())) for _ in range(2)]
            for t in starters:
                t.start()
            for t in starters:
                t.join()
            feeder.close()
    finally:
        threading.excepthook = previous_hook
    assert errors == []


class SilentAfter(io.RawIOBase):
    """Gives ``data``, then blocks like an open stdin whose producer went quiet."""

    def __init__(self, data: bytes) -> None:
        self.data, self.quiet = data, threading.Event()

    def readable(self):
        return True

    def readinto(self, buffer):
        if not self.data:
            self.quiet.wait()  # never set: the read waits as long as the process lives
            return 0
        n = min(len(buffer), len(self.data))
        buffer[:n], self.data = self.data[:n], self.data[n:]
        return n


@pytest.mark.parametrize("world_size", [1, 2])
def test_finish_ends_every_rank_at_the_same_update_while_the_input_is_silent(world_size):
    data = ndjson(*({"input_ids": [3] * 50} for _ in range(30)))
    s = stream_settings(val_fraction=0.0, world_size=world_size, tokenize_batch_docs=1)  # nothing waits for more input
    feeder = UpdateFeeder(lambda: (io.BufferedReader(SilentAfter(data)), "test"), s, fake_encode, ValidationPool(0))
    counts = [0] * world_size

    def consume(rank: int) -> None:
        for item in feeder.iterate(rank):
            counts[rank] += 1

    consumers = [threading.Thread(target=consume, args=(r,), daemon=True) for r in range(world_size)]
    for t in consumers:
        t.start()
    deadline = time.monotonic() + 10
    while feeder.stats.records < 30 and time.monotonic() < deadline:  # everything read: the input is silent now
        time.sleep(0.05)
    time.sleep(0.3)
    feeder.finish("SIGTERM")
    for t in consumers:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in consumers), "a consumer still waits on the silent input"
    assert feeder.early_end == "SIGTERM"
    assert counts[0] == counts[-1] == feeder.stats.updates * s.accumulation > 0  # the same whole updates everywhere
    feeder.close()


def test_an_input_error_after_training_started_ends_the_stream_and_is_kept():
    good = ndjson(*({"input_ids": [3] * 50} for _ in range(40)))
    s = stream_settings(val_fraction=0.0, tokenize_batch_docs=1)
    feeder = UpdateFeeder(lambda: (io.BufferedReader(BrokenAfter(good)), "test"), s, fake_encode, ValidationPool(0))
    microbatches = list(feeder.iterate())  # no exception: the updates before the failure are trained
    assert len(microbatches) == feeder.stats.updates * s.accumulation > 0
    assert isinstance(feeder.input_error, OSError) and "Input/output error" in feeder.early_end

    early = UpdateFeeder(lambda: (io.BufferedReader(BrokenAfter(ndjson({"text": "few"}))), "test"), s, fake_encode,
                         ValidationPool(0))
    with pytest.raises(OSError, match="Input/output error"):  # nothing trained yet: the run fails as it is
        list(early.iterate())
