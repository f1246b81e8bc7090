"""The validation split: documents held out by a hash of their content, into a bounded pool."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Iterator

import numpy as np

from pipeline.records import INPUT_IDLE, InputIdle, StreamStats


def is_held_out(key: bytes, fraction: float) -> bool:
    """Stable across runs, machines and record order: a hash of the document's content."""
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


class ValidationPool:
    """Held-out documents, up to a token bound; filled by the feeder, read by validation."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._docs: list[np.ndarray] = []
        self._lock = threading.Lock()

    def offer(self, tokens: np.ndarray) -> bool:
        with self._lock:
            if self.tokens + len(tokens) > self.max_tokens:
                return False
            self._docs.append(tokens)
            self.tokens += len(tokens)
            return True

    def snapshot(self) -> list[np.ndarray]:
        with self._lock:
            return list(self._docs)


def split_validation(
    docs: Iterable[tuple[bytes, np.ndarray] | InputIdle], pool: ValidationPool, fraction: float, stats: StreamStats
) -> Iterator[np.ndarray | InputIdle]:
    """Divert the held-out documents into the pool; once it is full they are trained on like the rest."""
    for item in docs:
        if item is INPUT_IDLE:
            yield item
            continue
        key, tokens = item
        if fraction > 0 and is_held_out(key, fraction) and pool.offer(tokens):
            stats.held_out_documents += 1
            stats.held_out_tokens += len(tokens)
            continue
        yield tokens
