"""From an NDJSON byte stream to tokenized documents: reading lines, validating records, counting
rejects by reason, and encoding text in bounded batches (EOS ending every document).

    read_records -> encode_documents

``file_documents`` runs both over a whole file (a validation set). ``StreamStats`` counts what every
stage of the stream did; ``INPUT_IDLE`` is the reader's word, passed down the stages, that the input
keeps it waiting.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from pipeline.data_section import DataConfig

log = logging.getLogger(__name__)


EXPECTED_RECORD = 'NDJSON records, one JSON object per line, with "text" (a non-empty string) or "input_ids" (a list of token ids)'


class UnusableInputError(RuntimeError):
    """The stream holds nothing this trainer can learn from (for example image records)."""


class InputIdle:
    """The type of INPUT_IDLE, the one value a stage passes on in place of a document."""

    def __repr__(self) -> str:
        return "INPUT_IDLE"


INPUT_IDLE = InputIdle()
"""Passed down the stages when the input keeps the reader waiting (DataConfig.input_idle_seconds):
the tokenizer's batch and the shuffle buffer then release what they hold back, so a slow stream
trains as it arrives. A stream read at full speed never sends it, so its order stays the seeded one."""

OTHER_KIND_RECORDS = 256
"""JSON records of another kind (no "text" or "input_ids" field, or not an object), with no usable
record before them, after which the stream is refused: image records, say, are not text to skip past."""

PROGRESS_SECONDS = 10.0  # at most one line on stderr this often about records skipped


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
    end_of_input: bool = False  # the reader reached the end of the stream
    drained: bool = False  # and the flow behind it used up everything it had read (or hit its token budget)
    skipped: int = 0  # rejected records, all reasons together
    fingerprint: str = ""
    _sha: object = field(default_factory=hashlib.sha256, repr=False)
    _progress_at: float | None = field(default=None, repr=False)

    def count_bytes(self, chunk: bytes) -> None:
        self.bytes_read += len(chunk)
        self._sha.update(chunk)

    def reject(self, reason: str) -> None:
        """Count a skipped record; say so on stderr, at most every PROGRESS_SECONDS (the first at once),
        so that a long run of bad records is visibly read past rather than silently waited on."""
        self.rejected[reason] += 1
        self.skipped += 1
        now = time.monotonic()
        if self._progress_at is None or now - self._progress_at >= PROGRESS_SECONDS:
            self._progress_at = now
            log.warning("input: %d skipped so far (%s), %d accepted; reading on", self.skipped,
                        rejected_counts(self.rejected), self.accepted)

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
            "drained": self.drained,
            "input_sha256": self.fingerprint,
        }


# ----------------------------------------------------------------------------- read


UTF8_BOM = b"\xef\xbb\xbf"


def _read_lines(stream: BinaryIO, max_bytes: int, stats: StreamStats,
                idle_seconds: float | None = None) -> Iterator[bytes | None | InputIdle]:
    """Yield each line's bytes, or None for a record longer than ``max_bytes`` (skipped in bounded chunks).

    The limit counts the record, not its line ending (``\n`` or ``\r\n``). A UTF-8 byte-order mark
    opening the stream is dropped. Every byte read, skipped ones included, goes into the byte count
    and the input fingerprint. A stream that can tell (sources.DescriptorReader: stdin) also gives
    INPUT_IDLE whenever it has kept the reader waiting ``idle_seconds``.
    """
    readline_or_idle = getattr(stream, "readline_or_idle", None) if idle_seconds is not None else None
    first = True
    while True:
        limit = max_bytes + 2 + (len(UTF8_BOM) if first else 0)  # the mark is no part of the first record
        line = readline_or_idle(limit, idle_seconds) if readline_or_idle else stream.readline(limit)
        if line is None:
            yield INPUT_IDLE
            continue
        stats.count_bytes(line)
        if not line:
            return
        cut = len(line) == limit and not line.endswith(b"\n")  # stopped by the limit, not a line end
        record = line.removeprefix(UTF8_BOM) if first else line
        first = False
        if not cut and len(record) - _line_ending_length(record) <= max_bytes:
            yield record
            continue
        while line and not line.endswith(b"\n"):
            line = stream.readline(1 << 20)
            stats.count_bytes(line)
        yield None


def _line_ending_length(line: bytes) -> int:
    return 2 if line.endswith(b"\r\n") else 1 if line.endswith(b"\n") else 0


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
    if "text" in record and not (record["text"] is None and "input_ids" in record):  # a null text beside ids: the ids
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
    stream: BinaryIO, stats: StreamStats, vocab_size: int, max_record_bytes: int, give_up_after: int,
    idle_seconds: float | None = None,
) -> Iterator[Document | InputIdle]:
    """Validate each line; count rejects by reason and read on past them.

    Before the first usable record, the stream is refused once ``give_up_after`` records were
    rejected, or OTHER_KIND_RECORDS records of another kind (image records, say) were seen; and at
    its end if it held no usable record at all.
    """
    for line in _read_lines(stream, max_record_bytes, stats, idle_seconds):
        if line is INPUT_IDLE:
            yield line
            continue
        stats.records += 1
        if line is None:
            outcome: Document | str = "record_too_large"
        else:
            if not line.strip():
                stats.records -= 1
                continue
            outcome = parse_record(line, vocab_size)
        if isinstance(outcome, Document):
            if stats.accepted == 0 and stats.skipped:
                log.warning("input: first usable record at line %d, after %d skipped (%s)", stats.records,
                            stats.skipped, rejected_counts(stats.rejected))
            stats.accepted += 1
            yield outcome
            continue
        stats.reject(outcome)
        if outcome == "no_text_or_input_ids" and stats.rejected[outcome] <= 8:
            stats.rejected_keys.update(list(json.loads(line))[:16])
        if stats.accepted == 0 and (stats.skipped >= give_up_after or stats.rejected["no_text_or_input_ids"]
                                    + stats.rejected["not_an_object"] >= OTHER_KIND_RECORDS):
            raise UnusableInputError(unusable_message(stats))
    stats.end_of_input = True
    if stats.accepted == 0:
        raise UnusableInputError(unusable_message(stats))


def rejected_counts(rejected: Counter) -> str:
    """The rejects by reason, most frequent first, for a message: ``3 invalid_json, 1 empty_text``."""
    return ", ".join(f"{n} {reason}" for reason, n in rejected.most_common())


def unusable_message(stats: StreamStats) -> str:
    found = rejected_counts(stats.rejected) or "no records"
    keys = ", ".join(k for k, _ in stats.rejected_keys.most_common(8))
    seen = f"; fields seen: {keys}" if keys else ""
    return (
        f"no usable record in the first {stats.records} lines of {stats.source}. Expected {EXPECTED_RECORD}. "
        f"Found: {found}{seen}. This trainer trains language models on text; point it at a text stream."
    )


# ----------------------------------------------------------------------------- tokenize


ENCODER_INTERRUPTS = (KeyboardInterrupt, SystemExit)  # what an encoder raises that is not about the text


def encode_documents(
    docs: Iterable[Document | InputIdle], encode_batch: Callable[[list[str]], list[np.ndarray]], eos_id: int,
    stats: StreamStats, batch_docs: int, batch_bytes: int,
) -> Iterator[tuple[bytes, np.ndarray] | InputIdle]:
    """Tokenize text in bounded batches (the encoder's threads pay off on batches); EOS ends every document.

    A batch is encoded early when the input is idle. A batch the encoder fails on is encoded again
    one document at a time, and a document it still fails on is rejected as ``untokenizable_text``:
    one record never ends the run, and a batch that encodes costs nothing more.
    """
    pending: list[Document] = []
    pending_bytes = 0
    told = False

    def encode_alone(text: str) -> np.ndarray | None:
        nonlocal told
        try:
            return encode_batch([text])[0]
        except ENCODER_INTERRUPTS:
            raise
        except BaseException as error:  # a PyO3 tokenizer's panic (PanicException) is a BaseException
            if not told:
                told = True
                log.warning("input: the tokenizer failed on a record of %d characters (%s: %s); such records are "
                            "skipped and counted as untokenizable_text", len(text), type(error).__name__,
                            str(error)[:200])
            stats.accepted -= 1
            stats.reject("untokenizable_text")
            return None

    def encode(texts: list[str]) -> list[np.ndarray | None]:
        try:
            return encode_batch(texts)
        except ENCODER_INTERRUPTS:
            raise
        except BaseException:
            return [encode_alone(text) for text in texts]

    def flush() -> Iterator[tuple[bytes, np.ndarray]]:
        texts = [d.text for d in pending if d.text is not None]
        encoded = iter(encode(texts)) if texts else iter(())
        for doc in pending:
            ids = doc.ids if doc.ids is not None else next(encoded)
            if ids is None:
                continue
            tokens = np.empty(len(ids) + 1, dtype=np.int32)  # one copy, EOS included
            tokens[:-1] = ids
            tokens[-1] = eos_id
            stats.documents += 1
            stats.document_tokens += len(tokens)
            yield doc.key, tokens
        pending.clear()

    for doc in docs:
        if doc is INPUT_IDLE:
            yield from flush()
            pending_bytes = 0
            yield doc
            continue
        pending.append(doc)
        pending_bytes += len(doc.key)
        if len(pending) >= batch_docs or pending_bytes >= batch_bytes:
            yield from flush()
            pending_bytes = 0
    yield from flush()


def file_documents(stream: BinaryIO, stats: StreamStats, encode_batch: Callable[[list[str]], list[np.ndarray]],
                   eos_id: int, vocab_size: int, max_record_bytes: int) -> Iterator[np.ndarray]:
    """The token ids of every usable record of a whole file (a validation set), by training's record rules
    and tokenizer, in the default tokenizer batches; rejects are counted in ``stats``, never a reason to stop."""
    records = read_records(stream, stats, vocab_size, max_record_bytes, give_up_after=1 << 62)
    for _, ids in encode_documents(records, encode_batch, eos_id, stats, DataConfig.tokenize_batch_docs,
                                   DataConfig.tokenize_batch_bytes):
        yield ids
