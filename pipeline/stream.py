"""The composed stream: from an NDJSON byte stream to complete optimizer updates, dealt to ranks.

    read_records -> encode_documents -> split_validation -> shuffle_documents -> pack_rows
    -> assemble_updates -> split_update

``stream_updates`` composes them; each stage takes and gives an iterator, so each can be tested alone
on a list of records. Every buffer has a bound from the config (pipeline/data_section.py); nothing holds
the whole stream. Where the bytes come from is sources.py's; running the flow beside training is
feeder.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from pipeline.data_section import DataConfig
from pipeline.packing import Row, attention_pairs, collate_rows, pack_rows, shuffle_documents
from pipeline.records import StreamStats, UnusableInputError, encode_documents, read_records, rejected_counts
from pipeline.validation_split import ValidationPool, split_validation

log = logging.getLogger(__name__)


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


def split_update(update: list[Row], world_size: int, microbatch: int, stats: StreamStats) -> list[list[dict]]:
    """Per rank, its microbatches of one update; each carries the whole update's target-token count.

    Every rank receives the same number of microbatches; with several ranks, balance_ranks decides
    which rows each gets (one rank keeps the stream's order).
    """
    if world_size > 1:
        update = [row for share in balance_ranks(update, world_size) for row in share]
    batches = [collate_rows(update[i : i + microbatch]) for i in range(0, len(update), microbatch)]
    update_tokens = sum(b["target_tokens"] for b in batches)
    update_digest = sum(b["rows_digest"] for b in batches)  # the whole update's, whichever rank trains which row
    stats.update_target_tokens += update_tokens
    for b in batches:
        b["update_target_tokens"] = update_tokens
        b["update_digest"] = update_digest
    per_rank = len(batches) // world_size
    return [batches[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]


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
    train_docs = split_validation(tokens, pool, d.val_fraction, stats, d.shuffle_buffer_docs, d.shuffle_buffer_tokens)
    shuffled = shuffle_documents(train_docs, d.shuffle_buffer_docs, d.shuffle_buffer_tokens, s.seed,
                                 idle_release_tokens=s.rows_per_update * s.seq_len)
    rows = pack_rows(shuffled, s.seq_len, stats)
    for update in assemble_updates(rows, s.rows_per_update, stats, d.max_train_tokens):
        yield split_update(update, s.world_size, s.microbatch, stats)
    stats.drained = True
    if stats.updates == 0:
        rejected = rejected_counts(stats.rejected) or "none"
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
