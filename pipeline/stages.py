"""From an NDJSON byte stream to complete optimizer updates of packed rows, as small stages.

The flow runs one way; each stage takes and gives an iterator, so each can be tested alone on a
list of records:

    read_records -> encode_documents -> split_validation -> shuffle_documents -> pack_rows
    -> assemble_updates -> split_update

``stream_updates`` composes them. Every buffer has a bound from the config (DataConfig); nothing
holds the whole stream. Where the bytes come from is sources.py's; running the flow beside
training is feeder.py's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Literal, get_args

import numpy as np
import torch

from pipeline.fingerprints import rows_digest
from model.attention import document_offsets
from model.loss import IGNORE_INDEX
from runfab.limits import RECORD_BYTES

log = logging.getLogger(__name__)


EXPECTED_RECORD = 'NDJSON records, one JSON object per line, with "text" (a non-empty string) or "input_ids" (a list of token ids)'


class UnusableInputError(RuntimeError):
    """The stream holds nothing this trainer can learn from (for example image records)."""


class _InputIdle:
    def __repr__(self) -> str:
        return "INPUT_IDLE"


INPUT_IDLE = _InputIdle()
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
                        _counts(self.rejected), self.accepted)

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
                idle_seconds: float | None = None) -> Iterator[bytes | None | _InputIdle]:
    """Yield each line's bytes, or None for a record longer than ``max_bytes`` (skipped in bounded chunks).

    The limit counts the record, not its line ending (``\n`` or ``\r\n``). A UTF-8 byte-order mark
    opening the stream is dropped. Every byte read, skipped ones included, goes into the byte count
    and the input fingerprint. A stream that can tell (sources.DescriptorReader: stdin) also gives
    INPUT_IDLE whenever it has kept the reader waiting ``idle_seconds``.
    """
    readline_or_idle = getattr(stream, "readline_or_idle", None) if idle_seconds is not None else None
    first = True
    while True:
        line = readline_or_idle(max_bytes + 2, idle_seconds) if readline_or_idle else stream.readline(max_bytes + 2)
        if line is None:
            yield INPUT_IDLE
            continue
        stats.count_bytes(line)
        if not line:
            return
        cut = len(line) == max_bytes + 2 and not line.endswith(b"\n")  # stopped by the limit, not a line end
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
) -> Iterator[Document | _InputIdle]:
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
                            stats.skipped, _counts(stats.rejected))
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


def _counts(rejected: Counter) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in rejected.most_common())


def unusable_message(stats: StreamStats) -> str:
    found = _counts(stats.rejected) or "no records"
    keys = ", ".join(k for k, _ in stats.rejected_keys.most_common(8))
    seen = f"; fields seen: {keys}" if keys else ""
    return (
        f"no usable record in the first {stats.records} lines of {stats.source}. Expected {EXPECTED_RECORD}. "
        f"Found: {found}{seen}. This trainer trains language models on text; point it at a text stream."
    )


# ----------------------------------------------------------------------------- tokenize


ENCODER_INTERRUPTS = (KeyboardInterrupt, SystemExit)  # what an encoder raises that is not about the text


def encode_documents(
    docs: Iterable[Document | _InputIdle], encode_batch: Callable[[list[str]], list[np.ndarray]], eos_id: int,
    stats: StreamStats, batch_docs: int, batch_bytes: int,
) -> Iterator[tuple[bytes, np.ndarray] | _InputIdle]:
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


# ----------------------------------------------------------------------------- hold out, shuffle


def file_documents(stream: BinaryIO, stats: StreamStats, encode_batch: Callable[[list[str]], list[np.ndarray]],
                   eos_id: int, vocab_size: int, max_record_bytes: int) -> Iterator[np.ndarray]:
    """The token ids of every usable record of a whole file (a validation set), by training's record rules
    and tokenizer, in the default tokenizer batches; rejects are counted in ``stats``, never a reason to stop."""
    records = read_records(stream, stats, vocab_size, max_record_bytes, give_up_after=1 << 62)
    for _, ids in encode_documents(records, encode_batch, eos_id, stats, DataConfig.tokenize_batch_docs,
                                   DataConfig.tokenize_batch_bytes):
        yield ids


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
    docs: Iterable[tuple[bytes, np.ndarray] | _InputIdle], pool: ValidationPool, fraction: float, stats: StreamStats
) -> Iterator[np.ndarray | _InputIdle]:
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


def shuffle_documents(docs: Iterable[np.ndarray | _InputIdle], max_docs: int, max_tokens: int, seed: int,
                      idle_release_tokens: int = 0) -> Iterator[np.ndarray]:
    """Bounded, seeded shuffle: release a random held document whenever the buffer is over either bound.

    When the input is idle, random held documents of ``idle_release_tokens`` tokens in all (one
    update's worth) are released as well: training goes on while the buffer keeps filling.
    """
    rng = random.Random(seed)
    buffer: list[np.ndarray] = []
    held = 0

    def take() -> np.ndarray:
        nonlocal held
        i = rng.randrange(len(buffer))
        buffer[i], buffer[-1] = buffer[-1], buffer[i]
        out = buffer.pop()
        held -= len(out)
        return out

    for doc in docs:
        if doc is INPUT_IDLE:
            released = 0
            while buffer and released < idle_release_tokens:
                out = take()
                released += len(out)
                yield out
            continue
        buffer.append(doc)
        held += len(doc)
        while len(buffer) > max_docs or (held > max_tokens and len(buffer) > 1):
            yield take()
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


def collate_rows(rows: list[Row], digest: bool = True) -> dict[str, torch.Tensor | int]:
    """Tensors of a microbatch; document offsets are found here, on the host, not by a device sync.
    ``digest`` false leaves the rows' digest 0 (data.token_digests)."""
    tokens, positions = np.stack([r.tokens for r in rows]), np.stack([r.positions for r in rows])
    digest = rows_digest(tokens, positions) if digest else 0
    positions = torch.from_numpy(positions.astype(np.int64))
    targets = np.stack([r.targets() for r in rows])
    cu_seqlens = document_offsets(positions)
    lengths = cu_seqlens.diff().to(torch.int64)
    return {
        "input_ids": torch.from_numpy(tokens.astype(np.int64)),
        "positions": positions,
        "targets": torch.from_numpy(targets),
        "cu_seqlens": cu_seqlens,
        "attention_pairs": int((lengths * lengths).sum()),  # sum of s^2 over documents, for MFU
        "target_tokens": int(np.count_nonzero(targets != IGNORE_INDEX)),
        "rows_digest": digest,  # pipeline/fingerprints.py: what the run record's training-tokens digest is made of
    }


def attention_pairs(row: Row) -> int:
    """Sum of s^2 over the row's document segments: what its attention costs, up to a constant."""
    starts = np.flatnonzero(row.positions == 0)
    lengths = np.diff(np.append(starts, len(row.positions))).astype(np.int64)
    return int((lengths * lengths).sum())


def balance_ranks(update: list[Row], world_size: int) -> list[list[Row]]:
    """The update's rows dealt to ranks so each gets as many rows and about the same attention work.

    Every rank waits for the slowest at each update's gradient all-reduce, and the rows of a packed
    stream differ: one 4,096-token document costs 16x the attention of sixteen 256-token ones. Split
    in stream order, the busier of 2 ranks had 10 % more attention work than the average (realistic
    documents, microbatch 16; docs/PERFORMANCE.md). The heaviest row goes first to the least loaded
    rank with room. The update's gradient does not depend on which rank computes which row.
    """
    per_rank = len(update) // world_size
    costs = [attention_pairs(row) for row in update]
    load = [0] * world_size
    members: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(update)), key=lambda i: (-costs[i], i)):
        rank = min((r for r in range(world_size) if len(members[r]) < per_rank), key=lambda r: (load[r], r))
        members[rank].append(index)
        load[rank] += costs[index]
    return [[update[i] for i in sorted(indices)] for indices in members]


def split_update(update: list[Row], world_size: int, microbatch: int, stats: StreamStats,
                 digest: bool = True) -> list[list[dict]]:
    """Per rank, its microbatches of one update; each carries the whole update's target-token count.

    Every rank receives the same number of microbatches; with several ranks, balance_ranks decides
    which rows each gets (one rank keeps the stream's order).
    """
    if world_size > 1:
        update = [row for share in balance_ranks(update, world_size) for row in share]
    batches = [collate_rows(update[i : i + microbatch], digest) for i in range(0, len(update), microbatch)]
    update_tokens = sum(b["target_tokens"] for b in batches)
    update_digest = sum(b["rows_digest"] for b in batches)  # the whole update's, whichever rank trains which row
    stats.update_target_tokens += update_tokens
    for b in batches:
        b["update_target_tokens"] = update_tokens
        b["update_digest"] = update_digest
    per_rank = len(batches) // world_size
    return [batches[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]


# ----------------------------------------------------------------------------- settings, composition


InputSource = Literal["auto", "stdin", "sample", "litdata"]  # data.source: see sources.open_input; litdata: pipeline/shards.py
INPUT_SOURCES = get_args(InputSource)


@dataclass
class DataConfig:
    """The ``data`` section of the config: where records come from and every buffer's bound."""

    tokenizer: str = "conf/gpt2/tokenizer.json"
    """Tokenizer file, relative to the bundle; model.vocab_size must hold its vocabulary"""
    source: InputSource = "auto"
    """Where records come from: stdin, or sample (data.sample_path); auto: stdin, or the sample when stdin is a
    terminal"""
    path: str | None = None
    """data.source litdata: the folder or object-store URL (s3://, gs://) that `python -m tools prepare` wrote"""
    loader_workers: int = 1
    """data.source litdata: data loader processes per rank; 0: read in the training process"""
    sample_path: str = "data/sample.jsonl"
    """The bundled sample of records, read when data.source is sample, or auto at a terminal"""
    microbatch: int = 8
    """Rows per microbatch of a local run; RunFab chooses its own"""
    max_record_bytes: int = RECORD_BYTES
    """Longest record accepted, in bytes (RunFab's limit); a longer one is rejected"""
    give_up_after: int = 1_000_000
    """Rejected records, with none usable yet, after which the input is refused (a stream of records of another
    kind, without text or input_ids, is refused after 256)"""
    tokenize_batch_docs: int = 256
    """Documents per tokenizer call (its threads pay off on batches)"""
    tokenize_batch_bytes: int = 8 << 20
    """Bytes of text per tokenizer call at most; whichever bound is reached first ends the call's batch"""
    tokenizer_threads: int = 2
    """tiktoken's encoding threads (RunFab gives the job 2 cores)"""
    input_idle_seconds: float = 1.0
    """Seconds stdin may keep the reader waiting before what the tokenizer and the shuffle hold back goes on to
    training, so a slow stream trains as it arrives"""
    val_fraction: float = 0.005
    """Share of documents held out for validation, chosen by a hash of their content"""
    val_max_tokens: int = 1 << 18
    """Tokens the held-out pool holds at most; held-out documents past it are trained on"""
    shuffle_buffer_docs: int = 10_000
    """Documents the seeded shuffle buffer holds at most"""
    shuffle_buffer_tokens: int = 1 << 23
    """Tokens the seeded shuffle buffer holds at most"""
    max_train_tokens: int | None = None
    """Token budget: training stops after this many target tokens; null: no budget"""
    prefetch_updates: int = 2
    """Complete updates read ahead of training, per rank"""
    token_digests: bool = True
    """Digest every training row for the run record's training-tokens fingerprint; false only to measure its cost"""

    def problems(self) -> list[str]:
        found = []
        if self.source not in INPUT_SOURCES:
            found.append(f"data.source must be one of {', '.join(INPUT_SOURCES)}, not {self.source!r}")
        if self.source == "litdata" and not self.path:
            found.append("data.source litdata reads rows prepared by `python -m tools prepare`: set data.path to its --output")
        if self.loader_workers < 0:
            found.append(f"data.loader_workers must be >= 0 (0: read in the training process), not {self.loader_workers}")
        if not 0 <= self.val_fraction < 1:
            found.append("data.val_fraction must lie in [0, 1)")
        found += [f"data.{name} must be at least 1, not {getattr(self, name)}" for name in (
            "microbatch", "max_record_bytes", "give_up_after", "tokenize_batch_docs", "tokenize_batch_bytes",
            "tokenizer_threads", "shuffle_buffer_docs", "shuffle_buffer_tokens", "prefetch_updates",
        ) if getattr(self, name) < 1]
        if not self.input_idle_seconds > 0:
            found.append(f"data.input_idle_seconds must be above 0, not {self.input_idle_seconds}")
        if self.val_max_tokens < 0 or self.max_train_tokens is not None and self.max_train_tokens < 1:
            found.append("data.val_max_tokens must be >= 0 and data.max_train_tokens at least 1 (or null: no budget)")
        return found


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
    docs = read_records(stream, stats, s.vocab_size, d.max_record_bytes, d.give_up_after, d.input_idle_seconds)
    tokens = encode_documents(docs, encode_batch, s.eos_id, stats, d.tokenize_batch_docs, d.tokenize_batch_bytes)
    train_docs = split_validation(tokens, pool, d.val_fraction, stats)
    shuffled = shuffle_documents(train_docs, d.shuffle_buffer_docs, d.shuffle_buffer_tokens, s.seed,
                                 idle_release_tokens=s.rows_per_update * s.seq_len)
    rows = pack_rows(shuffled, s.seq_len, stats)
    for update in assemble_updates(rows, s.rows_per_update, stats, d.max_train_tokens):
        yield split_update(update, s.world_size, s.microbatch, stats, d.token_digests)
    stats.drained = True
    if stats.updates == 0:
        rejected = _counts(stats.rejected) or "none"
        raise UnusableInputError(
            f"the input ended before one complete update: an update is {s.rows_per_update} rows of {s.seq_len} "
            f"tokens ({s.rows_per_update * s.seq_len} tokens), the input gave {stats.document_tokens} tokens "
            f"in {stats.documents} documents ({stats.held_out_tokens} of them held out for validation) from "
            f"{stats.records} records, of which rejected: {rejected}"
        )


def summary_line(stats: StreamStats) -> str:
    rejected = ", ".join(f"{k}={v}" for k, v in sorted(stats.rejected.items())) or "none"
    return (
        f"input: {stats.records} records, {stats.accepted} accepted, rejected: {rejected}; "
        f"{stats.documents} documents, {stats.held_out_documents} held out for validation; "
        f"{stats.updates} complete updates assembled; " + _how_the_input_ended(stats)
    )


def _how_the_input_ended(stats: StreamStats) -> str:
    if stats.drained:
        return (f"end of input, tail dropped: {stats.tail_tokens_dropped} tokens" if stats.end_of_input
                else "the token budget (data.max_train_tokens) ended the stream")
    if stats.end_of_input:
        return ("training stopped before the input was used up: all of it was read, but what the shuffle and "
                "packing buffers still held was not trained")
    return "training stopped before the end of input"


