"""The validation set: documents held out from the start of the input by a hash of their content, or
the documents of a file (``data.val_path``); one set for the whole run, fixed once it is closed.

Held out from the input, the set is gathered from the documents read before training starts: those
the shuffle buffer holds before it first releases one (its bounds, ``data.shuffle_buffer_docs`` and
``data.shuffle_buffer_tokens``, bound this read-ahead, so it takes no memory beyond the existing
bounds). Among them, the held-out documents (``data.val_fraction``) join the set in input order until
the next would pass ``data.val_max_tokens``; that document, and every one after the set is closed,
is trained on. Which documents form the set depends on the input and those ``data.*`` settings only:
not on the run's length, batch split, accumulation or GPU count.

``write_documents`` saves a set as records of token ids (the run's ``run/validation.jsonl``, the split that
``python -m tools prepare`` writes), which a file set reads back as the same documents.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from pipeline.records import INPUT_IDLE, InputIdle, StreamStats, UnusableInputError, file_documents
from runfab import created_files

log = logging.getLogger(__name__)

HELD_OUT = "held out from the input"
FILE = "file"
PREPARED = "the validation split written by tools prepare"

CLOSED_BY = {
    "val_max_tokens": "the next held-out document would pass data.val_max_tokens",
    "read_ahead": "the documents read before the first update (data.shuffle_buffer_docs, shuffle_buffer_tokens) "
                  "were searched",
    "end_of_input": "the input ended while the set was gathered",
    "file": "the file was read whole",
    "prepared": "the split beside the prepared rows was read whole",
}
"""Why a validation set was closed (the run record's ``closed_by``); None: training ended first."""


def is_held_out(key: bytes, fraction: float) -> bool:
    """Stable across runs, machines and record order: a hash of the document's content."""
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


class ValidationPool:
    """The validation set, up to a token bound; filled and then closed by the feeder (or read whole from a
    file), read by validation. Thread-safe: the feeder's thread fills it while training reads it."""

    def __init__(self, max_tokens: int, formed: str = HELD_OUT, source: str | None = None) -> None:
        self.max_tokens = max_tokens
        self.formed, self.source = formed, source
        self.tokens = 0
        self.closed_by: str | None = None
        self.closed_after_updates: int | None = None  # updates assembled before the set was closed
        self.documents_read: int | None = None  # input documents searched for it
        self._docs: list[np.ndarray] = []
        self._lock = threading.Lock()

    def offer(self, tokens: np.ndarray) -> bool:
        """Take a document if the set is open and it fits."""
        with self._lock:
            if self.closed_by is not None or self.tokens + len(tokens) > self.max_tokens:
                return False
            self._docs.append(tokens)
            self.tokens += len(tokens)
            return True

    def close(self, closed_by: str, after_updates: int = 0, documents_read: int | None = None) -> None:
        with self._lock:
            if self.closed_by is None:
                self.closed_by, self.closed_after_updates, self.documents_read = closed_by, after_updates, documents_read

    @property
    def closed(self) -> bool:
        return self.closed_by is not None

    def ready_after(self, update: int) -> bool:
        """Whether validation after optimizer update ``update`` has the whole set. It has when the set was
        closed before that update was assembled: then every rank received it before that update's rows, so
        all ranks agree (a set still being gathered happens only when the input was slower than training)."""
        return self.closed_after_updates is not None and self.closed_after_updates < update

    def snapshot(self) -> list[np.ndarray]:
        with self._lock:
            return list(self._docs)

    def description(self) -> dict:
        """How the set was formed, for the run record (its digest and size are the fixed validation's)."""
        return {"formed": self.formed, "source": self.source, "closed_by": self.closed_by,
                "closed_after_updates": self.closed_after_updates, "documents_read": self.documents_read}


def split_validation(
    docs: Iterable[tuple[bytes, np.ndarray] | InputIdle], pool: ValidationPool, fraction: float, stats: StreamStats,
    read_ahead_docs: int | None = None, read_ahead_tokens: int | None = None,
) -> Iterator[np.ndarray | InputIdle]:
    """Divert held-out documents into the pool until it is closed (see the module); pass the rest on.

    ``read_ahead_docs`` and ``read_ahead_tokens`` are the shuffle buffer's bounds: the set is closed,
    and says so on stderr, when the documents passed on would make the buffer release its first one.
    Without them (``python -m tools prepare``, which holds out throughout each byte range) only
    ``data.val_max_tokens`` and the end of the documents close it, silently.
    """
    announce = read_ahead_docs is not None
    if fraction <= 0 or pool.closed:
        yield from (item if item is INPUT_IDLE else item[1] for item in docs)
        return
    read = passed_docs = passed_tokens = 0
    for item in docs:
        if item is INPUT_IDLE:
            yield item
            continue
        key, tokens = item
        if not pool.closed:
            read += 1
            if is_held_out(key, fraction):
                if pool.offer(tokens):
                    stats.held_out_documents += 1
                    stats.held_out_tokens += len(tokens)
                    continue
                _close(pool, "val_max_tokens", stats, read, announce)
            elif announce:
                passed_docs += 1
                passed_tokens += len(tokens)
                if passed_docs > read_ahead_docs or (passed_tokens > read_ahead_tokens and passed_docs > 1):
                    _close(pool, "read_ahead", stats, read, announce)
        yield tokens
    if not pool.closed:
        _close(pool, "end_of_input", stats, read, announce)


def _close(pool: ValidationPool, closed_by: str, stats: StreamStats, read: int, announce: bool) -> None:
    pool.close(closed_by, stats.updates, read)
    if not announce:
        return
    where = (f"{stats.held_out_documents} documents ({stats.held_out_tokens} tokens) held out of the first {read} "
             f"documents of the input")
    if closed_by == "end_of_input":
        log.warning("validation set: the input ended before the set reached data.val_max_tokens (%d); validation "
                    "uses what was gathered: %s", pool.max_tokens, where)
    else:
        log.info("validation set: %s; closed because %s", where, CLOSED_BY[closed_by])


def load_validation_file(path: Path, encode_batch: Callable[[list[str]], list[np.ndarray]], eos_id: int,
                         vocab_size: int, max_record_bytes: int, max_tokens: int) -> ValidationPool:
    """``data.val_path``: every usable record of the file (NDJSON, as training reads them), as a closed set.

    A file whose documents pass ``max_tokens`` (data.val_max_tokens, the set's memory bound) is
    refused rather than cut, so that ``python -m tools evaluate --data`` on the same file scores the
    same set.
    """
    pool = ValidationPool(max_tokens, FILE, str(path))
    stats = StreamStats(source=str(path))
    with path.open("rb") as stream:
        for doc in file_documents(stream, stats, encode_batch, eos_id, vocab_size, max_record_bytes):
            if not pool.offer(doc):
                raise UnusableInputError(
                    f"data.val_path {path} holds more than data.val_max_tokens ({max_tokens}) tokens: its first "
                    f"{len(pool.snapshot())} documents hold {pool.tokens}. Raise data.val_max_tokens (the validation "
                    "set is held in memory) or give a smaller file")
    if stats.rejected:
        log.warning("data.val_path %s: %d records skipped (%s)", path, stats.skipped,
                    ", ".join(f"{n} {reason}" for reason, n in stats.rejected.most_common()))
    pool.close("file", 0, stats.documents)
    log.info("validation set: %d documents (%d tokens) from %s", stats.documents, pool.tokens, path)
    return pool


def write_documents(documents: Iterable[np.ndarray], path: Path) -> None:
    """A validation set as NDJSON records of token ids, which read back as the same documents (the
    reader appends the EOS that ends each, so it is left out)."""
    with created_files.open_created(path, "w") as file:
        for doc in documents:
            file.write(json.dumps({"input_ids": np.asarray(doc[:-1]).tolist()}, separators=(",", ":")) + "\n")
