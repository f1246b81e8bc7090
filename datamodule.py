"""From an NDJSON byte stream to complete optimizer updates of packed rows.

The flow runs one way, as small stages that each take and give an iterator, so each can be
tested alone on a list of records:

    read_records -> encode_documents -> split_validation -> shuffle_documents -> pack_rows
    -> assemble_updates -> split_update

Every buffer has a bound from the config; nothing holds the whole stream. A background
thread (UpdateFeeder) runs the flow and fills one bounded queue per rank, so stdin is read by
the process that owns it and the training loop only ever sees complete updates.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from model import IGNORE_INDEX, document_offsets
from runfab_limits import RECORD_BYTES

log = logging.getLogger(__name__)

EXPECTED_RECORD = 'NDJSON records, one JSON object per line, with "text" (a non-empty string) or "input_ids" (a list of token ids)'


class UnusableInputError(RuntimeError):
    """The stream holds nothing this trainer can learn from (for example image records)."""


@dataclass
class Document:
    """One usable record: raw text still to tokenize, or token ids; ``key`` feeds the held-out hash."""

    key: bytes
    text: str | None = None
    ids: np.ndarray | None = None


@dataclass
class StreamStats:
    """What happened to the input; written to stderr and the run record at the end."""

    source: str = ""
    records: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    rejected_keys: Counter = field(default_factory=Counter)
    bytes_read: int = 0
    documents: int = 0
    document_tokens: int = 0
    held_out_documents: int = 0
    held_out_tokens: int = 0
    rows: int = 0
    updates: int = 0
    update_target_tokens: int = 0
    tail_tokens_dropped: int = 0
    end_of_input: bool = False
    training_wait_seconds: float = 0.0  # time training sat waiting for its next microbatch (after the first)
    fingerprint: str = ""
    _sha: object = field(default_factory=hashlib.sha256, repr=False)

    def count_bytes(self, chunk: bytes) -> None:
        self.bytes_read += len(chunk)
        self._sha.update(chunk)

    def as_dict(self) -> dict:
        self.fingerprint = self._sha.hexdigest()
        return {
            "source": self.source,
            "records": self.records,
            "accepted": self.accepted,
            "rejected": dict(self.rejected),
            "bytes_read": self.bytes_read,
            "documents": self.documents,
            "document_tokens": self.document_tokens,
            "held_out_documents": self.held_out_documents,
            "held_out_tokens": self.held_out_tokens,
            "rows": self.rows,
            "updates": self.updates,
            "update_target_tokens": self.update_target_tokens,
            "tail_tokens_dropped": self.tail_tokens_dropped,
            "end_of_input": self.end_of_input,
            "training_wait_seconds": round(self.training_wait_seconds, 3),
            "input_sha256": self.fingerprint,
        }


# ----------------------------------------------------------------------------- read


def _read_lines(stream: BinaryIO, max_bytes: int, stats: StreamStats) -> Iterator[bytes | None]:
    """Yield each line's bytes, or None for a line longer than ``max_bytes`` (skipped in bounded chunks).

    Every byte read, skipped ones included, goes into the byte count and the input fingerprint.
    """
    while True:
        line = stream.readline(max_bytes + 1)
        stats.count_bytes(line)
        if not line:
            return
        if len(line) <= max_bytes or line.endswith(b"\n") and len(line) == max_bytes + 1:
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = stream.readline(1 << 20)
            stats.count_bytes(line)
        yield None


def parse_record(line: bytes, vocab_size: int) -> Document | str:
    """A Document, or the reason the line is rejected (a short snake_case word)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    try:
        record = json.loads(text)
    except ValueError:
        return "invalid_json"
    except RecursionError:  # valid JSON nested deeper than the parser's stack (a 2 KB line can be)
        return "nested_too_deeply"
    if not isinstance(record, dict):
        return "not_an_object"
    if "text" in record:
        value = record["text"]
        if not isinstance(value, str):
            return "text_not_a_string"
        if not value.strip():
            return "empty_text"
        try:
            key = value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a \ud800-style escape is not text
            return "invalid_utf8"
        return Document(key=key, text=value)
    if "input_ids" in record:
        value = record["input_ids"]
        if not isinstance(value, list) or not all(type(i) is int for i in value):
            return "input_ids_not_int_list"
        if not value:
            return "empty_input_ids"
        if min(value) < 0 or max(value) >= vocab_size:
            return "input_ids_out_of_range"
        ids = np.asarray(value, dtype=np.int32)
        return Document(key=ids.tobytes(), ids=ids)
    return "no_text_or_input_ids"


def read_records(
    stream: BinaryIO, stats: StreamStats, vocab_size: int, max_record_bytes: int, give_up_after: int
) -> Iterator[Document]:
    """Validate each line; count rejects by reason; refuse a stream with nothing usable early."""
    for line in _read_lines(stream, max_record_bytes, stats):
        stats.records += 1
        if line is None:
            outcome: Document | str = "record_too_large"
        else:
            if not line.strip():
                stats.records -= 1
                continue
            outcome = parse_record(line, vocab_size)
        if isinstance(outcome, Document):
            stats.accepted += 1
            yield outcome
            continue
        stats.rejected[outcome] += 1
        if outcome == "no_text_or_input_ids" and stats.rejected[outcome] <= 8:
            stats.rejected_keys.update(list(json.loads(line))[:16])
        if stats.accepted == 0 and stats.records >= give_up_after:
            raise UnusableInputError(unusable_message(stats))
    stats.end_of_input = True
    if stats.accepted == 0:
        raise UnusableInputError(unusable_message(stats))


def unusable_message(stats: StreamStats) -> str:
    found = ", ".join(f"{n} {reason}" for reason, n in stats.rejected.most_common()) or "no records"
    keys = ", ".join(k for k, _ in stats.rejected_keys.most_common(8))
    seen = f"; fields seen: {keys}" if keys else ""
    return (
        f"no usable record in the first {stats.records} lines of {stats.source}. Expected {EXPECTED_RECORD}. "
        f"Found: {found}{seen}. This trainer trains language models on text; point it at a text stream."
    )


# ----------------------------------------------------------------------------- tokenize


def encode_documents(
    docs: Iterable[Document], encode_batch: Callable[[list[str]], list[np.ndarray]], eos_id: int, stats: StreamStats,
    batch_docs: int, batch_bytes: int,
) -> Iterator[tuple[bytes, np.ndarray]]:
    """Tokenize text in bounded batches (the encoder's threads pay off on batches); EOS ends every document."""
    pending: list[Document] = []
    pending_bytes = 0

    def flush() -> Iterator[tuple[bytes, np.ndarray]]:
        texts = [d.text for d in pending if d.text is not None]
        encoded = iter(encode_batch(texts)) if texts else iter(())
        for doc in pending:
            ids = doc.ids if doc.ids is not None else next(encoded)
            tokens = np.empty(len(ids) + 1, dtype=np.int32)  # one copy, EOS included
            tokens[:-1] = ids
            tokens[-1] = eos_id
            stats.documents += 1
            stats.document_tokens += len(tokens)
            yield doc.key, tokens
        pending.clear()

    for doc in docs:
        pending.append(doc)
        pending_bytes += len(doc.key)
        if len(pending) >= batch_docs or pending_bytes >= batch_bytes:
            yield from flush()
            pending_bytes = 0
    yield from flush()


# ----------------------------------------------------------------------------- hold out, shuffle


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
    docs: Iterable[tuple[bytes, np.ndarray]], pool: ValidationPool, fraction: float, stats: StreamStats
) -> Iterator[np.ndarray]:
    """Divert the held-out documents into the pool; once it is full they are trained on like the rest."""
    for key, tokens in docs:
        if fraction > 0 and is_held_out(key, fraction) and pool.offer(tokens):
            stats.held_out_documents += 1
            stats.held_out_tokens += len(tokens)
            continue
        yield tokens


def shuffle_documents(docs: Iterable[np.ndarray], max_docs: int, max_tokens: int, seed: int) -> Iterator[np.ndarray]:
    """Bounded, seeded shuffle: release a random held document whenever the buffer is over either bound."""
    rng = random.Random(seed)
    buffer: list[np.ndarray] = []
    held = 0
    for doc in docs:
        buffer.append(doc)
        held += len(doc)
        while len(buffer) > max_docs or (held > max_tokens and len(buffer) > 1):
            i = rng.randrange(len(buffer))
            buffer[i], buffer[-1] = buffer[-1], buffer[i]
            out = buffer.pop()
            held -= len(out)
            yield out
    rng.shuffle(buffer)
    yield from buffer


# ----------------------------------------------------------------------------- pack, assemble


@dataclass
class Row:
    """``seq_len`` tokens; ``positions`` restart at 0 wherever a document (or its continuation) starts."""

    tokens: np.ndarray
    positions: np.ndarray

    def targets(self) -> np.ndarray:
        """Next token within the same segment; the last token of each segment predicts nothing."""
        targets = np.full(len(self.tokens), IGNORE_INDEX, dtype=np.int64)
        same_segment = self.positions[1:] != 0
        targets[:-1] = np.where(same_segment, self.tokens[1:], IGNORE_INDEX)
        return targets


def pack_rows(docs: Iterable[np.ndarray], seq_len: int, stats: StreamStats, pad_last: bool = False) -> Iterator[Row]:
    """Fill rows of exactly ``seq_len`` tokens; a document that does not fit continues in the next row.

    The partial row left at end of input is dropped and counted (or, for validation, padded
    with a zero-target segment).
    """
    tokens = np.empty(seq_len, dtype=np.int32)
    positions = np.empty(seq_len, dtype=np.int32)
    counting = np.arange(seq_len, dtype=np.int32)  # a piece's positions are a prefix of this
    fill = 0
    for doc in docs:
        start = 0
        while start < len(doc):
            take = min(seq_len - fill, len(doc) - start)
            tokens[fill : fill + take] = doc[start : start + take]
            positions[fill : fill + take] = counting[:take]
            fill += take
            start += take
            if fill == seq_len:
                stats.rows += 1
                yield Row(tokens.copy(), positions.copy())
                fill = 0
    if fill and pad_last:
        tokens[fill:] = 0
        positions[fill:] = 0
        stats.rows += 1
        yield Row(tokens.copy(), positions.copy())
    else:
        stats.tail_tokens_dropped += fill


def assemble_updates(
    rows: Iterable[Row], rows_per_update: int, stats: StreamStats, max_target_tokens: int | None = None
) -> Iterator[list[Row]]:
    """Group rows into complete updates; the incomplete group at end of input is dropped and counted."""
    group: list[Row] = []
    for row in rows:
        group.append(row)
        if len(group) < rows_per_update:
            continue
        stats.updates += 1
        yield group
        group = []
        if max_target_tokens is not None and stats.update_target_tokens >= max_target_tokens:
            log.info("token budget of %d target tokens reached", max_target_tokens)
            return
    stats.tail_tokens_dropped += sum(len(r.tokens) for r in group)


def collate_rows(rows: list[Row]) -> dict[str, torch.Tensor | int]:
    """Tensors of a microbatch; document offsets are found here, on the host, not by a device sync."""
    positions = torch.from_numpy(np.stack([r.positions for r in rows]).astype(np.int64))
    targets = np.stack([r.targets() for r in rows])
    cu_seqlens = document_offsets(positions)
    lengths = cu_seqlens.diff().to(torch.int64)
    return {
        "input_ids": torch.from_numpy(np.stack([r.tokens for r in rows]).astype(np.int64)),
        "positions": positions,
        "targets": torch.from_numpy(targets),
        "cu_seqlens": cu_seqlens,
        "attention_pairs": int((lengths * lengths).sum()),  # sum of s^2 over documents, for MFU
        "target_tokens": int(np.count_nonzero(targets != IGNORE_INDEX)),
    }


def split_update(update: list[Row], world_size: int, microbatch: int, stats: StreamStats) -> list[list[dict]]:
    """Per rank, its microbatches of one update; each carries the whole update's target-token count.

    Rank r gets rows [r*A*M, (r+1)*A*M): every rank receives the same number of microbatches.
    """
    batches = [collate_rows(update[i : i + microbatch]) for i in range(0, len(update), microbatch)]
    update_tokens = sum(b["target_tokens"] for b in batches)
    stats.update_target_tokens += update_tokens
    for b in batches:
        b["update_target_tokens"] = update_tokens
    per_rank = len(batches) // world_size
    return [batches[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]


# ----------------------------------------------------------------------------- feeder


@dataclass
class DataConfig:
    """The ``data`` section of the config: where records come from and every buffer's bound."""

    tokenizer: str = "conf/gpt2/tokenizer.json"  # GPT-2's, as model.vocab_size 50257; smoke.yaml: the small one
    source: str = "auto"  # auto: stdin, or the sample when stdin is a terminal; stdin; sample
    sample_path: str = "data/sample.jsonl"  # the bundled sample (data.source sample, or a terminal)
    microbatch: int = 8  # for local runs only: RunFab chooses its own
    max_record_bytes: int = RECORD_BYTES  # RunFab's limit per record
    give_up_after: int = 256  # rejected records, with none usable, before the stream is refused
    tokenize_batch_docs: int = 256
    tokenize_batch_bytes: int = 8 << 20
    tokenizer_threads: int = 2
    val_fraction: float = 0.005
    val_max_tokens: int = 1 << 18
    shuffle_buffer_docs: int = 10_000
    shuffle_buffer_tokens: int = 1 << 23
    max_train_tokens: int | None = None  # token budget: stop after this many target tokens
    prefetch_updates: int = 2


@dataclass
class StreamSettings:
    """What the feeder needs: the data config plus the run's shape (row length, batch split, tokenizer)."""

    data: DataConfig
    seq_len: int
    vocab_size: int
    eos_id: int
    seed: int
    microbatch: int
    accumulation: int
    world_size: int = 1
    max_updates: int | None = None  # trainer.max_steps: no rank is handed an update it will not train

    @property
    def rows_per_update(self) -> int:
        return self.world_size * self.accumulation * self.microbatch


def stream_updates(
    stream: BinaryIO, settings: StreamSettings, encode_batch: Callable, stats: StreamStats, pool: ValidationPool
) -> Iterator[list[list[dict]]]:
    """The whole flow, composed: a byte stream in, per-rank microbatch lists of complete updates out."""
    s, d = settings, settings.data
    docs = read_records(stream, stats, s.vocab_size, d.max_record_bytes, d.give_up_after)
    tokens = encode_documents(docs, encode_batch, s.eos_id, stats, d.tokenize_batch_docs, d.tokenize_batch_bytes)
    train_docs = split_validation(tokens, pool, d.val_fraction, stats)
    shuffled = shuffle_documents(train_docs, d.shuffle_buffer_docs, d.shuffle_buffer_tokens, s.seed)
    rows = pack_rows(shuffled, s.seq_len, stats)
    for update in assemble_updates(rows, s.rows_per_update, stats, d.max_train_tokens):
        yield split_update(update, s.world_size, s.microbatch, stats)
    if stats.updates == 0:
        rejected = ", ".join(f"{n} {reason}" for reason, n in stats.rejected.most_common()) or "none"
        raise UnusableInputError(
            f"the input ended before one complete update: an update is {s.rows_per_update} rows of {s.seq_len} "
            f"tokens ({s.rows_per_update * s.seq_len} tokens), the input gave {stats.document_tokens} tokens "
            f"in {stats.documents} documents ({stats.held_out_tokens} of them held out for validation) from "
            f"{stats.records} records, of which rejected: {rejected}"
        )


_END = object()
POLL_SECONDS = 0.1  # how often a waiting consumer looks up from an empty queue (a stop request may have come)


class UpdateFeeder:
    """Runs ``stream_updates`` on a daemon thread and fills one bounded queue per rank.

    The queues hold at most ``prefetch_updates`` updates, so the reader stays a bounded
    distance ahead of training. Every rank's stream ends at the same update boundary: at the end
    of input, on ``finish`` (a signal), or on an input error once training has started, which is
    then kept as ``input_error`` instead of ending the run without its model.
    """

    def __init__(self, open_stream: Callable[[], tuple[BinaryIO, str]], settings: StreamSettings,
                 encode_batch: Callable, pool: ValidationPool, report_every: float | None = None) -> None:
        """``report_every`` (seconds) marks updates with ``report=1`` so that data-parallel ranks
        agree on when to report metrics without a collective; held-out documents then also travel
        to every rank (as ValidationDocument items) so each worker holds the same pool."""
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
                self._thread.start()

    def stop(self) -> None:
        """Stop at once (teardown): queued items are abandoned."""
        self._stop.set()

    def finish(self, reason: str) -> None:
        """End every rank's stream at the next update boundary they share; safe in a signal handler."""
        if self.early_end is None:
            self.early_end = reason
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
            for per_rank in stream_updates(stream, self.settings, self._encode_batch, self.stats, pool):
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

    def iterate(self, rank: int = 0) -> Iterator[dict | ValidationDocument]:
        """The rank's items, complete updates only; the stream is consumed once, so a second pass yields nothing."""
        self.start()
        per_update = self.settings.accumulation
        taken = 0  # microbatches yielded
        waiting_since: float | None = None
        while not self._finished[rank]:
            boundary = taken % per_update == 0
            if boundary and taken // per_update == self.settings.max_updates:
                break  # Lightning fetches one batch ahead: it must not wait on the input for one it never trains
            if boundary and self._past_last_update(rank, taken // per_update, starting=False):
                break
            try:
                item = self.queues[rank].get(timeout=POLL_SECONDS)
            except queue.Empty:  # training is ahead of the input (the GPU may starve meanwhile)
                if waiting_since is None:
                    waiting_since = time.perf_counter()
                continue
            if waiting_since is not None and taken and rank == 0:
                self.stats.training_wait_seconds += time.perf_counter() - waiting_since
            waiting_since = None
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


class _ForwardingPool(ValidationPool):
    """The feeder's pool, which also sends every document it keeps to each rank, in stream order."""

    def __init__(self, pool: ValidationPool, feeder: UpdateFeeder) -> None:
        self.pool, self.feeder = pool, feeder

    def offer(self, tokens: np.ndarray) -> bool:
        if not self.pool.offer(tokens):
            return False
        for rank in range(len(self.feeder.queues)):
            self.feeder._put(rank, ValidationDocument(tokens))
        return True


def summary_line(stats: StreamStats) -> str:
    rejected = ", ".join(f"{k}={v}" for k, v in sorted(stats.rejected.items())) or "none"
    return (
        f"input: {stats.records} records, {stats.accepted} accepted, rejected: {rejected}; "
        f"{stats.documents} documents, {stats.held_out_documents} held out for validation; "
        f"{stats.updates} complete updates; "
        + (f"end of input, tail dropped: {stats.tail_tokens_dropped} tokens" if stats.end_of_input
           else "training stopped before the end of input")
    )


# ----------------------------------------------------------------------------- sources

INPUT_SOURCES = ("auto", "stdin", "sample")


class DescriptorReader:
    """``readline`` straight from a file descriptor with ``os.read``.

    Python's buffered ``sys.stdin`` holds a lock while a read waits; if training ends while the
    reader thread still waits on an open, silent stdin, interpreter shutdown cannot take that
    lock and aborts the process (exit 134) after a successful run. ``os.read`` holds no lock.
    """

    def __init__(self, fd: int, chunk_bytes: int = 1 << 16) -> None:
        self.fd, self.chunk_bytes = fd, chunk_bytes
        self._buffer, self._start, self._eof = b"", 0, False

    def _fill(self) -> bool:
        """Read one more chunk; False at end of input."""
        if self._eof:
            return False
        chunk = os.read(self.fd, self.chunk_bytes)
        if not chunk:
            self._eof = True
            return False
        self._buffer = self._buffer[self._start :] + chunk
        self._start = 0
        return True

    def peek(self, size: int = 1) -> bytes:
        while len(self._buffer) - self._start < size and self._fill():
            pass
        return self._buffer[self._start : self._start + size]

    def readline(self, limit: int = -1) -> bytes:
        searched = self._start
        while True:
            newline = self._buffer.find(b"\n", searched)
            available = len(self._buffer) - self._start
            if newline >= 0 and (limit < 0 or newline - self._start < limit):
                end = newline + 1
            elif 0 <= limit <= available:
                end = self._start + limit
            elif not self._fill():
                end = len(self._buffer)
            else:
                searched = available  # the bytes already searched now start the rebased buffer
                continue
            line = self._buffer[self._start : end]
            self._start = end
            return line


def open_input(sample_path: Path | None, stdin: BinaryIO | None = None, source: str = "auto") -> tuple[BinaryIO, str]:
    """Where records come from: ``data.source``.

    ``auto`` reads stdin, except from an interactive terminal, where a person means the bundled
    sample. Under RunFab stdin is the dataset, so an empty or closed stdin is an error, never a
    silent run on the sample; ``sample`` asks for the sample explicitly.
    """
    if source == "sample":
        return _open_sample(sample_path, "data.source is sample")
    if stdin is None:
        if sys.stdin is None or _closed(0):
            raise UnusableInputError(
                "stdin is closed, so there is no input. Pipe NDJSON records into stdin, or pass "
                "--data.source sample to train on the bundled sample."
            )
        stdin = DescriptorReader(0)
        interactive = os.isatty(0)
    else:
        interactive = stdin.isatty()
    if interactive and source == "auto":
        return _open_sample(sample_path, "stdin is a terminal")
    if not stdin.peek(1)[:1]:
        raise UnusableInputError(
            "stdin is empty: the input ended before its first record. Under RunFab stdin is the dataset; "
            "check the dataset attached to the job. To train on the bundled sample, pass --data.source sample."
        )
    return stdin, "stdin"


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def _open_sample(sample_path: Path | None, why: str) -> tuple[BinaryIO, str]:
    if sample_path is None or not sample_path.is_file():
        raise FileNotFoundError(
            f"no input: {why}, and the bundled sample {sample_path} does not exist. "
            "Pipe NDJSON records into stdin or set data.sample_path to a file of the bundle."
        )
    log.info("training on the bundled sample %s (%s)", sample_path, why)
    return sample_path.open("rb"), str(sample_path)


# ----------------------------------------------------------------------------- Lightning


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
