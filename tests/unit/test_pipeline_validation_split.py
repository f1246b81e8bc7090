"""pipeline/validation_split.py: which documents are held out, and the bounded pool they go to."""

from __future__ import annotations

import numpy as np

from pipeline.records import StreamStats
from pipeline.validation_split import ValidationPool, is_held_out, split_validation


def test_held_out_documents_are_chosen_by_content_not_by_order():
    docs = [(f"doc {i}".encode(), np.arange(i % 7 + 1, dtype=np.int32)) for i in range(4000)]
    chosen = {key for key, _ in docs if is_held_out(key, 0.05)}
    assert 100 < len(chosen) < 300
    stats = StreamStats()
    pool = ValidationPool(max_tokens=10**9)
    trained = list(split_validation(reversed(docs), pool, 0.05, stats))
    assert stats.held_out_documents == len(chosen) and len(trained) == 4000 - len(chosen)


def test_the_validation_pool_is_bounded_and_later_held_out_documents_are_trained():
    docs = [(f"doc {i}".encode(), np.arange(10, dtype=np.int32)) for i in range(2000)]
    stats = StreamStats()
    pool = ValidationPool(max_tokens=55)
    trained = list(split_validation(docs, pool, 0.5, stats))
    assert pool.tokens == 50 and stats.held_out_documents == 5
    assert len(trained) == 2000 - 5
