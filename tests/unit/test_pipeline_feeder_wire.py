"""The feeder's socket: what the wire carries, and a worker's connection served by the feeder's side."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.feeder import INPUT_PENDING, ValidationDocument
from pipeline.feeder_wire import End, FeederConnection, new_listener, receive_items, send_item, serve_feeder


def test_the_wire_carries_microbatches_documents_end_and_errors_without_pickle():
    from multiprocessing import Pipe

    a, b = Pipe()
    batch = {"input_ids": torch.arange(12).view(3, 4), "cu_seqlens": torch.tensor([0, 5, 12], dtype=torch.int32),
             "update_target_tokens": 99, "report": 1}
    send_item(a, batch)
    send_item(a, ValidationDocument(np.array([7, 8, 9], dtype=np.int32)))
    send_item(a, None)
    ends = []
    items = list(receive_items(b, on_end=ends.append))
    assert ends == [End(None, None)]
    send_item(a, End("SIGTERM", {"records": 3}))  # an early end carries its reason and the input summary
    assert list(receive_items(b, on_end=ends.append)) == [] and ends[-1] == End("SIGTERM", {"records": 3})
    assert torch.equal(items[0]["input_ids"], batch["input_ids"]) and items[0]["input_ids"].dtype == torch.int64
    assert torch.equal(items[0]["cu_seqlens"], batch["cu_seqlens"]) and items[0]["update_target_tokens"] == 99
    assert items[1].tolist() == [7, 8, 9]
    send_item(a, ValueError("no usable record"))
    with pytest.raises(RuntimeError, match="ValueError: no usable record"):
        list(receive_items(b))



class OneRankFeeder:
    """The feeder as serve_feeder uses it: two updates of two microbatches for rank 0, the second marked
    for a metric line, and a held-out document between them."""

    def __init__(self) -> None:
        self.settings = SimpleNamespace(data=SimpleNamespace(prefetch_updates=1), accumulation=2)
        self.early_end, self.error = None, None
        self.stats = SimpleNamespace(as_dict=lambda: {"records": 5})
        self.stopped = threading.Event()

    def iterate(self, rank: int):
        assert rank == 0
        yield {"input_ids": torch.tensor([[1, 2]]), "update": 1}
        yield {"input_ids": torch.tensor([[3, 4]]), "update": 1}
        yield ValidationDocument(np.array([9, 9], dtype=np.int32))
        yield {"input_ids": torch.tensor([[5, 6]]), "update": 2}
        yield {"input_ids": torch.tensor([[7, 8]]), "update": 2, "report": 1}

    def stop(self) -> None:
        self.stopped.set()


def test_a_worker_gets_its_updates_documents_marks_and_the_input_summary_over_the_socket():
    feeder, kept = OneRankFeeder(), []
    listener, authkey = new_listener()
    try:
        server = serve_feeder(feeder, listener, world_size=1)
        connection = FeederConnection(listener.address, authkey, 0, SimpleNamespace(offer=kept.append), 2)
        items = list(connection.batches())
        connection.close()
        server.join(timeout=10)
    finally:
        listener.close()
    batches = [item for item in items if item is not INPUT_PENDING]
    assert [b["update"] for b in batches] == [1, 1, 2, 2]
    assert [b["input_ids"].tolist() for b in batches] == [[[1, 2]], [[3, 4]], [[5, 6]], [[7, 8]]]
    assert all("report" not in b for b in batches)  # the mark travels on the wire, not into training_step
    assert [doc.tolist() for doc in kept] == [[9, 9]]
    assert items[-1] is INPUT_PENDING  # the stream ends after a stand-in at its last update boundary
    assert not connection.report_marks.due(1) and connection.report_marks.due(2)
    assert not connection.report_marks.due(2)  # a mark answers once
    assert connection.input_summary == {"records": 5} and connection.early_end is None
    assert not server.is_alive() and not feeder.stopped.is_set() and feeder.error is None
