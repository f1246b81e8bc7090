"""pipeline/stream.py: complete updates, rows dealt to ranks, and the stages composed from bytes to updates."""

from __future__ import annotations

import io
import os
import threading
import time

import numpy as np
import pytest

from model.loss import IGNORE_INDEX
from pipeline.packing import Row, attention_pairs, pack_rows
from pipeline.records import StreamStats, UnusableInputError
from pipeline.sources import DescriptorReader
from pipeline.stream import assemble_updates, balance_ranks, split_update, stream_updates, summary_line
from pipeline.validation_split import ValidationPool
from tests.pipeline_helpers import VOCAB, documents_of, fake_encode, ndjson, stream_settings


def test_updates_are_complete_and_the_tail_is_dropped_and_counted():
    stats = StreamStats()
    rows = [Row(np.full(8, i, np.int32), np.arange(8, dtype=np.int32)) for i in range(11)]
    updates = list(assemble_updates(rows, 4, stats))
    assert [len(u) for u in updates] == [4, 4]
    assert stats.updates == 2 and stats.tail_tokens_dropped == 3 * 8


def test_each_rank_gets_the_same_number_of_microbatches_carrying_the_update_token_count():
    rows = list(pack_rows(documents_of([7] * 40, seed=3), 16, StreamStats()))[:12]
    per_rank = split_update(rows, world_size=3, microbatch=2, stats=StreamStats())
    assert [len(mbs) for mbs in per_rank] == [2, 2, 2]
    microbatches = [mb for mbs in per_rank for mb in mbs]
    total = sum(mb["target_tokens"] for mb in microbatches)
    assert total == sum(int((r.targets() != IGNORE_INDEX).sum()) for r in rows)
    assert all(mb["update_target_tokens"] == total for mb in microbatches)
    dealt = sorted(tuple(row) for mb in microbatches for row in mb["input_ids"].tolist())
    assert dealt == sorted(tuple(r.tokens.tolist()) for r in rows)  # every row once, on some rank


def test_ranks_get_equal_attention_work_however_the_stream_orders_long_and_short_documents():
    def row(*lengths):
        positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
        return Row(np.arange(len(positions), dtype=np.int32), positions)

    long, short = row(64), row(*[8] * 8)  # 4,096 against 512 attention pairs
    update = [long, long, long, long, short, short, short, short]  # in stream order rank 0 would get every long row
    shares = balance_ranks(update, 2)
    assert [sum(attention_pairs(r) for r in share) for share in shares] == [2 * 4096 + 2 * 512] * 2
    per_rank = split_update(update, world_size=2, microbatch=2, stats=StreamStats())
    assert [sum(mb["attention_pairs"] for mb in mbs) for mbs in per_rank] == [2 * 4096 + 2 * 512] * 2
    one = split_update(update, world_size=1, microbatch=2, stats=StreamStats())[0]
    assert [mb["attention_pairs"] for mb in one] == [2 * 4096, 2 * 4096, 2 * 512, 2 * 512]  # one rank: stream order


def test_every_usable_token_is_trained_once_held_out_or_reported_as_tail():
    rng = np.random.default_rng(0)
    records = [{"text": "w" * int(n)} if i % 2 else {"input_ids": [int(x) for x in rng.integers(1, VOCAB, int(n))]}
               for i, n in enumerate(rng.integers(1, 90, 300))]
    data = ndjson(*records, b"garbage")
    stats = StreamStats()
    s = stream_settings()
    updates = list(stream_updates(io.BytesIO(data), s, fake_encode, stats, ValidationPool(s.data.val_max_tokens)))
    trained_rows = sum(len(mb["input_ids"]) for per_rank in updates for mb in per_rank[0])
    assert trained_rows == len(updates) * s.rows_per_update
    assert stats.document_tokens == stats.held_out_tokens + trained_rows * s.seq_len + stats.tail_tokens_dropped
    assert stats.documents == 300 and stats.rejected == {"invalid_json": 1}
    assert stats.update_target_tokens == sum(per_rank[0][0]["update_target_tokens"] for per_rank in updates)


def test_too_little_input_for_one_update_is_a_clear_error_that_shows_the_rejects():
    with pytest.raises(UnusableInputError, match="before one complete update.*rejected: 2 invalid_json"):
        list(stream_updates(io.BytesIO(ndjson({"text": "short"}, b"{bad", b"{bad")), stream_settings(), fake_encode,
                            StreamStats(), ValidationPool(0)))


def test_the_token_budget_stops_at_an_update_boundary():
    data = ndjson(*({"input_ids": [3] * 50} for _ in range(200)))
    stats = StreamStats()
    updates = list(stream_updates(io.BytesIO(data), stream_settings(max_train_tokens=300), fake_encode, stats, ValidationPool(0)))
    assert len(updates) == 3 and stats.update_target_tokens >= 300


def test_the_summary_tells_a_used_up_input_from_one_training_stopped_short_of():
    """Reading to the end of the stream is not training on all of it: the buffers behind the reader
    still hold documents when training stops first, and the summary must not say "end of input"."""
    data = ndjson(*({"input_ids": [3] * 50} for _ in range(40)))
    used_up, stopped = StreamStats(), StreamStats()
    s = stream_settings(val_fraction=0.0)
    all_updates = list(stream_updates(io.BytesIO(data), s, fake_encode, used_up, ValidationPool(0)))
    flow = stream_updates(io.BytesIO(data), s, fake_encode, stopped, ValidationPool(0))
    next(flow)  # training takes one update and stops; the tokenizer's first batch read all 40 records
    assert len(all_updates) > 1 and used_up.drained and used_up.end_of_input
    assert "end of input, tail dropped" in summary_line(used_up)
    assert stopped.end_of_input and not stopped.drained
    assert "training stopped before the input was used up" in summary_line(stopped)


def test_a_trickle_of_records_trains_before_the_input_ends_and_the_buffers_stay_bounded():
    """Records at about 20 a second into a shuffle buffer of 10,000 documents and tokenizer batches of
    256: the first update comes while the writer is still writing, not at the end of the input."""
    read_end, write_end = os.pipe()
    records = [ndjson({"text": "w" * 50 + str(i)}) for i in range(200)]
    written, close = [], threading.Event()

    def write():
        for record in records:
            os.write(write_end, record)
            written.append(record)
            time.sleep(0.05)
            if close.is_set():
                break
        close.wait(30)
        os.write(write_end, b"".join(records[len(written):]))
        os.close(write_end)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    s = stream_settings(val_fraction=0.0, shuffle_buffer_docs=10_000, tokenize_batch_docs=256, input_idle_seconds=0.2)
    stats = StreamStats()
    flow = stream_updates(DescriptorReader(read_end), s, fake_encode, stats, ValidationPool(0))
    first = next(flow)
    read, arrived = stats.records, len(written)
    close.set()
    rest = list(flow)
    writer.join(timeout=30)
    os.close(read_end)
    assert read <= arrived < len(records)  # an update while the input was still arriving
    assert first[0][0]["update_target_tokens"] > 0 and stats.documents == 200 and len(rest) + 1 == stats.updates
