"""Each stage of the data flow alone, then composed: validation, packing, complete updates, bounds."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import lightning as L

from datamodule import StreamingDataModule
from pipeline.feeder import INPUT_PENDING, UpdateFeeder

from pipeline.sources import PIPE_BYTES, DescriptorReader, open_input, widen_pipe

from pipeline.stages import (
    assemble_updates,
    attention_pairs,
    balance_ranks,
    collate_rows,
    DataConfig,
    encode_documents,
    INPUT_IDLE,
    is_held_out,
    pack_rows,
    parse_record,
    read_records,
    Row,
    shuffle_documents,
    split_update,
    split_validation,
    stream_updates,
    summary_line,
    StreamSettings,
    StreamStats,
    UnusableInputError,
    ValidationPool,
)

from model.attention import document_offsets
from model.loss import IGNORE_INDEX

from tests.helpers import BrokenAfter

VOCAB = 1000


def ndjson(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def reader(data: bytes, max_bytes: int = 1 << 20, give_up_after: int = DataConfig.give_up_after) -> tuple[list, StreamStats]:
    stats = StreamStats(source="test")
    docs = list(read_records(io.BytesIO(data), stats, VOCAB, max_bytes, give_up_after))
    return docs, stats


# ----------------------------------------------------------------------------- reading


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"{not json", "invalid_json"),
        (b"\xff\xfe{}", "invalid_utf8"),
        (b'{"text": "a\\ud800b"}', "invalid_utf8"),
        (b"[1, 2, 3]", "not_an_object"),
        (b'{"id": 7}', "no_text_or_input_ids"),
        (b'{"text": 5}', "text_not_a_string"),
        (b'{"text": "  \\n "}', "empty_text"),
        (b'{"input_ids": "1 2"}', "input_ids_not_int_list"),
        (b'{"input_ids": [1, 2.5]}', "input_ids_not_int_list"),
        (b'{"input_ids": [1, true]}', "input_ids_not_int_list"),
        (b'{"input_ids": []}', "empty_input_ids"),
        (b'{"input_ids": [1, 1000]}', "input_ids_out_of_range"),
        (b'{"input_ids": [-1]}', "input_ids_out_of_range"),
        (b'{"text": "ok", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested_too_deeply"),
    ],
)
def test_each_bad_record_is_rejected_with_its_reason(line, reason):
    assert parse_record(line, VOCAB) == reason


def test_good_records_keep_text_or_ids_and_ignore_other_fields():
    text = parse_record(b'{"text": "hello", "id": 3, "split": "train"}', VOCAB)
    ids = parse_record(b'{"input_ids": [0, 999], "text_len": 2}', VOCAB)
    assert text.text == "hello" and text.ids is None
    assert ids.ids.tolist() == [0, 999] and ids.text is None


def test_rejects_are_counted_by_reason_and_good_records_survive():
    big = json.dumps({"text": "x" * (2 << 20)}).encode()
    data = ndjson({"text": "one"}, b"{oops", {"image_b64": "AAAA"}, big, {"input_ids": [5, 6]}, b"", {"text": ""})
    docs, stats = reader(data + b'{"text": "trunc')
    assert [d.text or d.ids.tolist() for d in docs] == ["one", [5, 6]]
    assert stats.rejected == {"invalid_json": 2, "no_text_or_input_ids": 1, "record_too_large": 1, "empty_text": 1}
    assert stats.records == 7 and stats.accepted == 2 and stats.end_of_input


def test_a_record_just_at_the_size_limit_is_kept_and_one_byte_more_is_not():
    limit = 64
    exact = json.dumps({"text": "y" * (limit - 12)}).encode()
    assert len(exact) == limit
    over = json.dumps({"text": "y" * (limit - 11)}).encode()
    docs, stats = reader(ndjson(exact, over, {"text": "after"}), max_bytes=limit)
    assert [d.text for d in docs] == ["y" * (limit - 12), "after"]
    assert stats.rejected == {"record_too_large": 1}
    # The limit is the record's: the line ending does not count, CRLF or none at the very end.
    docs, stats = reader(exact + b"\r\n" + over + b"\r\n" + exact, max_bytes=limit)
    assert [d.text for d in docs] == ["y" * (limit - 12)] * 2 and stats.rejected == {"record_too_large": 1}


def test_a_byte_order_mark_opening_the_stream_does_not_cost_the_first_record():
    docs, stats = reader(b"\xef\xbb\xbf" + ndjson({"text": "first"}, {"text": "second"}))
    assert [d.text for d in docs] == ["first", "second"] and not stats.rejected
    assert stats.bytes_read == len(ndjson({"text": "first"}, {"text": "second"})) + 3  # the mark is still read and counted


def test_a_null_text_beside_input_ids_takes_the_ids():
    assert parse_record(b'{"text": null, "input_ids": [5, 6]}', VOCAB).ids.tolist() == [5, 6]
    assert parse_record(b'{"text": null}', VOCAB) == "text_not_a_string"
    assert parse_record(b'{"text": 3, "input_ids": [5, 6]}', VOCAB) == "text_not_a_string"


def test_an_image_stream_is_refused_quickly_naming_what_was_expected_and_found():
    record = {"image_b64": "A" * 200_000, "labels": [], "boxes": [], "class_ids": [], "id": "x", "split": "train"}
    line = json.dumps(record).encode() + b"\n"

    def endless():
        while True:
            yield line

    class Stream(io.RawIOBase):
        def __init__(self):
            self.lines = endless()

        def readline(self, size=-1):
            return next(self.lines)

    start = time.perf_counter()
    with pytest.raises(UnusableInputError) as error:  # under the default bound on rejected records
        list(read_records(Stream(), StreamStats(source="stdin"), VOCAB, 1 << 20, DataConfig().give_up_after))
    assert time.perf_counter() - start < 10
    message = str(error.value)
    assert '"text"' in message and '"input_ids"' in message and "image_b64" in message


def test_a_stream_without_any_usable_record_fails_at_its_end():
    with pytest.raises(UnusableInputError, match="no usable record"):
        reader(ndjson(b"{bad", {"foo": 1}))


def test_bad_records_before_the_first_good_one_are_read_past_and_reported_on_stderr(caplog):
    """100,000 empty texts, then good records: bad records never stop a run, however many lead."""
    good = [{"text": f"good record {i}"} for i in range(1500)]
    docs, stats = reader(ndjson({"text": ""}) * 100_000 + ndjson(*good))
    assert [d.text for d in docs] == [r["text"] for r in good]
    assert stats.rejected == {"empty_text": 100_000} and stats.accepted == 1500
    said = caplog.text
    assert "input: 1 skipped so far (1 empty_text), 0 accepted; reading on" in said  # as soon as a record is skipped
    assert "first usable record at line 100001, after 100000 skipped (100000 empty_text)" in said


def test_records_of_another_kind_are_refused_early_and_only_an_endless_run_of_bad_ones_later():
    image = {"image_b64": "AAAA", "labels": [], "boxes": [], "class_ids": [], "id": "x", "split": "train", "epoch": 0}
    after_blanks = ndjson({"text": " "}) * 5000 + ndjson(image) * 10_000 + ndjson({"text": "never reached"})
    with pytest.raises(UnusableInputError, match=r"first 5256 lines.*256 no_text_or_input_ids.*fields seen: .*image_b64"):
        reader(after_blanks)
    with pytest.raises(UnusableInputError, match="256 not_an_object"):  # valid JSON, but not records at all
        reader(ndjson([1, 2, 3]) * 1000)
    with pytest.raises(UnusableInputError, match="first 300 lines.*300 invalid_json"):  # the bound, set low
        reader(ndjson(b"{bad") * 1000 + ndjson({"text": "late"}), give_up_after=300)
    docs, stats = reader(ndjson(image) * 100 + ndjson({"text": "first"}, *([image] * 1000), {"text": "second"}))
    assert [d.text for d in docs] == ["first", "second"]  # once the stream has given text, any record is only skipped
    assert stats.rejected == {"no_text_or_input_ids": 1100}


def test_a_record_the_tokenizer_fails_on_is_rejected_alone_and_a_batch_that_encodes_costs_one_call(caplog):
    calls = []

    def encode(texts):
        calls.append(len(texts))
        if any("\x00" in t for t in texts):
            raise ValueError("Regex error while tokenizing")
        return fake_encode(texts)

    records = [{"text": f"doc {i}" + ("\x00" if i == 10 else "")} for i in range(20)] + [{"input_ids": [5, 6]}]
    docs, stats = reader(ndjson(*records))
    out = list(encode_documents(docs, encode, 0, stats, batch_docs=8, batch_bytes=1 << 20))
    assert calls == [8, 8, *[1] * 8, 4]  # only the batch that failed is encoded again, one document at a time
    assert [key for key, _ in out] == [f"doc {i}".encode() for i in range(20) if i != 10] + [out[-1][0]]
    assert out[-1][1].tolist() == [5, 6, 0]
    assert stats.rejected == {"untokenizable_text": 1} and stats.accepted == stats.documents == 20
    assert "the tokenizer failed on a record of 7 characters (ValueError: Regex error while tokenizing)" in caplog.text


# ----------------------------------------------------------------------------- packing


def docs_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).astype(np.int32) for n in lengths]


def test_rows_are_exactly_seq_len_and_keep_every_token_in_order():
    docs = docs_of([3, 17, 8, 1, 40, 5, 9])
    stats = StreamStats()
    rows = list(pack_rows(docs, 16, stats))
    assert all(len(r.tokens) == 16 for r in rows)
    flat = np.concatenate([r.tokens for r in rows])
    everything = np.concatenate(docs)
    assert np.array_equal(flat, everything[: len(flat)])
    assert stats.tail_tokens_dropped == len(everything) - len(flat) == 83 - 80


def test_positions_restart_at_each_document_and_its_continuation():
    rows = list(pack_rows(docs_of([5, 20, 7]), 16, StreamStats()))
    assert rows[0].positions.tolist() == [0, 1, 2, 3, 4] + list(range(11))
    assert rows[1].positions.tolist() == list(range(9)) + list(range(7))


def test_targets_predict_the_next_token_of_the_same_document_only():
    rows = list(pack_rows(docs_of([5, 11]), 16, StreamStats()))
    row = rows[0]
    targets = row.targets()
    assert targets[:4].tolist() == row.tokens[1:5].tolist()
    assert targets[4] == IGNORE_INDEX  # the last token of document 1 must not predict document 2
    assert targets[5:15].tolist() == row.tokens[6:16].tolist()
    assert targets[15] == IGNORE_INDEX
    assert (targets != IGNORE_INDEX).sum() == 16 - 2


def test_updates_are_complete_and_the_tail_is_dropped_and_counted():
    stats = StreamStats()
    rows = [Row(np.full(8, i, np.int32), np.arange(8, dtype=np.int32)) for i in range(11)]
    updates = list(assemble_updates(rows, 4, stats))
    assert [len(u) for u in updates] == [4, 4]
    assert stats.updates == 2 and stats.tail_tokens_dropped == 3 * 8


def test_each_rank_gets_the_same_number_of_microbatches_carrying_the_update_token_count():
    rows = list(pack_rows(docs_of([7] * 40, seed=3), 16, StreamStats()))[:12]
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


# ----------------------------------------------------------------------------- holding out and shuffling


def test_shuffle_is_a_seeded_permutation_that_never_holds_more_than_its_bound():
    docs = docs_of(range(1, 200))
    pulled = []

    def source():
        for d in docs:
            pulled.append(d)
            yield d

    out = []
    for d in shuffle_documents(source(), max_docs=10, max_tokens=10**9, seed=7):
        assert len(pulled) - len(out) <= 11  # held at most 10 documents plus the one just pulled
        out.append(d)
    assert sorted(map(len, out)) == sorted(map(len, docs))
    again = list(shuffle_documents(iter(docs), max_docs=10, max_tokens=10**9, seed=7))
    assert [len(d) for d in again] == [len(d) for d in out]
    assert [len(d) for d in out] != [len(d) for d in docs]


def test_shuffle_respects_its_token_bound():
    docs = docs_of([50] * 100)
    held = []
    it = shuffle_documents(iter(docs), max_docs=10**6, max_tokens=500, seed=0)
    first = next(it)
    held.append(first)
    assert len(first) == 50  # released as soon as the buffer passed 500 tokens


def test_an_idle_input_releases_an_updates_worth_of_the_shuffle_buffer_at_once():
    docs = docs_of([10] * 50)
    pulled = []

    def source():
        for i, d in enumerate(docs):
            if i == 30:
                pulled.append("idle")
                yield INPUT_IDLE
            pulled.append(i)
            yield d

    out, seen = [], []
    for d in shuffle_documents(source(), max_docs=100, max_tokens=10**9, seed=7, idle_release_tokens=45):
        out.append(d)
        seen.append(pulled[-1])
    assert seen[:5] == ["idle"] * 5 and seen[5:] == [49] * 45  # 5 of 10 tokens at the idle moment, the rest at the end
    assert sorted(id(d) for d in out) == sorted(id(d) for d in docs)
    fast = list(shuffle_documents(iter(docs), max_docs=100, max_tokens=10**9, seed=7, idle_release_tokens=45))
    assert [id(d) for d in fast] == [id(d) for d in shuffle_documents(iter(docs), 100, 10**9, 7)]  # no idle: as seeded


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


# ----------------------------------------------------------------------------- composed


def settings(world_size: int = 1, **data) -> StreamSettings:
    data = DataConfig(**{"val_fraction": 0.05, "val_max_tokens": 200, "shuffle_buffer_docs": 16, **data})
    return StreamSettings(data=data, seq_len=32, vocab_size=VOCAB, eos_id=0, seed=0, microbatch=2, accumulation=2,
                          world_size=world_size)


def fake_encode(texts):
    return [[1 + (ord(c) % (VOCAB - 1)) for c in t] for t in texts]


def test_every_usable_token_is_trained_once_held_out_or_reported_as_tail():
    rng = np.random.default_rng(0)
    records = [{"text": "w" * int(n)} if i % 2 else {"input_ids": [int(x) for x in rng.integers(1, VOCAB, int(n))]}
               for i, n in enumerate(rng.integers(1, 90, 300))]
    data = ndjson(*records, b"garbage")
    stats = StreamStats()
    s = settings()
    updates = list(stream_updates(io.BytesIO(data), s, fake_encode, stats, ValidationPool(s.data.val_max_tokens)))
    trained_rows = sum(len(mb["input_ids"]) for per_rank in updates for mb in per_rank[0])
    assert trained_rows == len(updates) * s.rows_per_update
    assert stats.document_tokens == stats.held_out_tokens + trained_rows * s.seq_len + stats.tail_tokens_dropped
    assert stats.documents == 300 and stats.rejected == {"invalid_json": 1}
    assert stats.update_target_tokens == sum(per_rank[0][0]["update_target_tokens"] for per_rank in updates)


def test_too_little_input_for_one_update_is_a_clear_error_that_shows_the_rejects():
    with pytest.raises(UnusableInputError, match="before one complete update.*rejected: 2 invalid_json"):
        list(stream_updates(io.BytesIO(ndjson({"text": "short"}, b"{bad", b"{bad")), settings(), fake_encode,
                            StreamStats(), ValidationPool(0)))


def test_the_token_budget_stops_at_an_update_boundary():
    data = ndjson(*({"input_ids": [3] * 50} for _ in range(200)))
    stats = StreamStats()
    updates = list(stream_updates(io.BytesIO(data), settings(max_train_tokens=300), fake_encode, stats, ValidationPool(0)))
    assert len(updates) == 3 and stats.update_target_tokens >= 300


def test_the_summary_tells_a_used_up_input_from_one_training_stopped_short_of():
    """Reading to the end of the stream is not training on all of it: the buffers behind the reader
    still hold documents when training stops first, and the summary must not say "end of input"."""
    data = ndjson(*({"input_ids": [3] * 50} for _ in range(40)))
    used_up, stopped = StreamStats(), StreamStats()
    s = settings(val_fraction=0.0)
    all_updates = list(stream_updates(io.BytesIO(data), s, fake_encode, used_up, ValidationPool(0)))
    flow = stream_updates(io.BytesIO(data), s, fake_encode, stopped, ValidationPool(0))
    next(flow)  # training takes one update and stops; the tokenizer's first batch read all 40 records
    assert len(all_updates) > 1 and used_up.drained and used_up.end_of_input
    assert "end of input, tail dropped" in summary_line(used_up)
    assert stopped.end_of_input and not stopped.drained
    assert "training stopped before the input was used up" in summary_line(stopped)


def test_the_feeder_delivers_complete_updates_then_ends_and_forwards_errors():
    data = ndjson(*({"input_ids": [3] * 50} for _ in range(100)))
    s = settings(val_fraction=0.0)
    feeder = UpdateFeeder(lambda: (io.BytesIO(data), "test"), s, fake_encode, ValidationPool(0))
    microbatches = list(feeder.iterate())
    assert len(microbatches) == feeder.stats.updates * s.accumulation > 0
    assert list(feeder.iterate()) == []  # one pass: a second iteration ends at once

    broken = UpdateFeeder(lambda: (io.BytesIO(ndjson({"image_b64": "x"})), "test"), s, fake_encode, ValidationPool(0))
    with pytest.raises(UnusableInputError):
        list(broken.iterate())


# ----------------------------------------------------------------------------- sources


class FakeStdin(io.BufferedReader):
    def __init__(self, raw, tty: bool = False) -> None:
        super().__init__(raw)
        self.tty = tty

    def isatty(self):
        return self.tty


def test_input_is_stdin_and_the_bundled_sample_only_when_a_person_means_it(tmp_path):
    sample = tmp_path / "sample.jsonl"
    sample.write_bytes(ndjson({"text": "bundled"}))
    stream, source = open_input(sample, FakeStdin(io.BytesIO(b'{"text": "piped"}\n')))
    assert source == "stdin" and stream.readline() == b'{"text": "piped"}\n'
    hook_user = r"train\(\), which takes no options: data.source: sample in the bundle's config"
    with pytest.raises(UnusableInputError, match=r"stdin is empty.*--data.source sample.*" + hook_user):
        open_input(sample, FakeStdin(io.BytesIO(b"")))  # under RunFab an empty stdin is an empty dataset
    stream, source = open_input(sample, FakeStdin(io.BytesIO(b""), tty=True))  # a person at a terminal
    assert source == str(sample) and stream.readline() == b'{"text": "bundled"}\n'
    stream, source = open_input(sample, FakeStdin(io.BytesIO(b'{"text": "piped"}\n')), "sample")  # asked for
    assert source == str(sample)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        open_input(tmp_path / "missing.jsonl", FakeStdin(io.BytesIO(b""), tty=True))


def test_the_descriptor_reader_reads_lines_as_a_buffered_reader_does():
    rng = np.random.default_rng(5)
    lines = [b"x" * int(n) + b"\n" for n in rng.integers(0, 3000, 400)] + [b"y" * 70_000 + b"\n", b"no newline"]
    data = b"".join(lines)
    read_end, write_end = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(write_end, data), os.close(write_end)))
    writer.start()
    ours, reference = DescriptorReader(read_end, chunk_bytes=1000), io.BufferedReader(io.BytesIO(data))
    assert ours.peek(1) == reference.peek(1)[:1]
    for limit in [-1, 7, 2048, 1 << 20] * 200:
        line = ours.readline(limit)
        assert line == reference.readline(limit)
        if not line:
            break
    writer.join()
    os.close(read_end)


def test_the_descriptor_reader_widens_a_pipe_and_takes_what_waits_there_in_one_read(monkeypatch, tmp_path):
    """While the reader thread waits for room in the feeder's queue, the writer runs ahead: the widened pipe holds
    a megabyte of records (the kernel's default, 64 KiB), and the reader takes them in one read, then the end of
    input in another, where 64 KiB reads would take seventeen. A file is no pipe and is left as it is."""
    read_end, write_end = os.pipe()
    ours = DescriptorReader(read_end)
    assert ours.pipe_bytes == fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ) == PIPE_BYTES
    record = b'{"input_ids": [' + b"1, " * 300 + b"2]}\n"
    data = record * (PIPE_BYTES // len(record))
    os.write(write_end, data)  # all of it at once: on a 64 KiB pipe this write would wait for a reader
    os.close(write_end)
    reads = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, size: reads.append(size) or real_read(fd, size))
    assert b"".join(iter(ours.readline, b"")) == data and len(reads) == 2
    os.close(read_end)
    file = tmp_path / "records.jsonl"
    file.write_bytes(record)
    with file.open("rb") as f:
        assert DescriptorReader(f.fileno()).pipe_bytes is None


def test_a_pipe_wider_than_the_system_allows_an_unprivileged_user_gets_the_systems_limit(monkeypatch):
    """Above /proc/sys/fs/pipe-max-size the kernel refuses an unprivileged process outright (EPERM); the
    reader then asks for the limit instead of keeping the 64 KiB default."""
    limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    real_fcntl = fcntl.fcntl

    def unprivileged(fd, cmd, arg=0):
        if cmd == fcntl.F_SETPIPE_SZ and arg > limit:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", unprivileged)
    read_end, write_end = os.pipe()
    try:
        assert widen_pipe(read_end, 4 * limit) == limit == real_fcntl(read_end, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_the_descriptor_reader_calls_a_silent_pipe_and_a_trickle_idle_and_a_full_one_never():
    read_end, write_end = os.pipe()
    ours = DescriptorReader(read_end)
    os.write(write_end, b'{"text": "par')
    start = time.monotonic()
    assert ours.readline_or_idle(-1, 0.3) is None and time.monotonic() - start >= 0.3
    os.write(write_end, b'tial"}\n')
    assert ours.readline_or_idle(-1, 0.3) == b'{"text": "partial"}\n'  # the part read before the idle is kept

    def trickle():
        for i in range(12):
            time.sleep(0.1)
            os.write(write_end, b"line %d\n" % i)
        os.close(write_end)

    writer = threading.Thread(target=trickle)
    writer.start()
    got = [ours.readline_or_idle(-1, 0.35) for _ in range(40)]
    writer.join()
    lines = [line for line in got if line]
    assert lines == [b"line %d\n" % i for i in range(12)]
    assert None in got[: got.index(b"line 11\n")]  # no gap of 0.35 s, but the waits add up to one
    os.close(read_end)

    read_end, write_end = os.pipe()
    os.write(write_end, b"x\n" * 1000)
    os.close(write_end)
    ours = DescriptorReader(read_end, chunk_bytes=64)
    assert [ours.readline_or_idle(-1, 0.01) for _ in range(1001)] == [b"x\n"] * 1000 + [b""]
    os.close(read_end)


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
    s = settings(val_fraction=0.0, shuffle_buffer_docs=10_000, tokenize_batch_docs=256, input_idle_seconds=0.2)
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


def test_feeder_start_is_safe_from_several_threads_at_once():
    s = settings(val_fraction=0.0, world_size=2)
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
    s = settings(val_fraction=0.0, world_size=world_size, tokenize_batch_docs=1)  # nothing waits for more input
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
    s = settings(val_fraction=0.0, tokenize_batch_docs=1)
    feeder = UpdateFeeder(lambda: (io.BufferedReader(BrokenAfter(good)), "test"), s, fake_encode, ValidationPool(0))
    microbatches = list(feeder.iterate())  # no exception: the updates before the failure are trained
    assert len(microbatches) == feeder.stats.updates * s.accumulation > 0
    assert isinstance(feeder.input_error, OSError) and "Input/output error" in feeder.early_end

    early = UpdateFeeder(lambda: (io.BufferedReader(BrokenAfter(ndjson({"text": "few"}))), "test"), s, fake_encode,
                         ValidationPool(0))
    with pytest.raises(OSError, match="Input/output error"):  # nothing trained yet: the run fails as it is
        list(early.iterate())


def test_each_update_is_trained_before_the_stream_is_asked_for_the_next_and_the_wait_is_measured():
    """Lightning fetches one microbatch ahead: without a stand-in for a microbatch that has not
    arrived, the last microbatch of every update would wait, untrained, for the next update."""
    from lit_module import GPTTrainingModule, OptimConfig
    from model.decoder import ModelConfig

    rng = np.random.default_rng(0)
    rows = [Row(rng.integers(0, 50, 16).astype(np.int32), np.arange(16, dtype=np.int32)) for _ in range(16)]
    updates = [split_update(rows[i : i + 4], 1, 2, StreamStats())[0] for i in range(0, 16, 4)]
    trainer = L.Trainer(accelerator="cpu", max_steps=10, max_epochs=1, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    steps_when_asked = []

    def stream():
        for k, update in enumerate(updates):
            if k:
                yield INPUT_PENDING  # the next update has not arrived
                steps_when_asked.append(trainer.global_step)
                time.sleep(0.2)  # and arrives after a while
            yield from update
        yield INPUT_PENDING  # then the input ends

    torch.manual_seed(0)
    module = GPTTrainingModule(ModelConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, max_seq_len=16), OptimConfig())
    datamodule = StreamingDataModule(stream, ValidationPool(0), settings())
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 4 and steps_when_asked == [1, 2, 3]
    assert 0.6 <= datamodule.input_wait_seconds < 5


def test_collate_finds_the_documents_and_targets_as_the_model_would():
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(3):
        lengths = rng.integers(1, 9, 12)
        positions = np.concatenate([np.arange(n) for n in lengths])[:16].astype(np.int32)
        rows.append(Row(rng.integers(0, 50, 16).astype(np.int32), positions))
    batch = collate_rows(rows)
    assert torch.equal(batch["cu_seqlens"], document_offsets(batch["positions"]))
    assert batch["cu_seqlens"].dtype == torch.int32
    lengths = batch["cu_seqlens"].diff().long()
    assert batch["attention_pairs"] == int((lengths * lengths).sum())
    assert batch["target_tokens"] == int((batch["targets"] != IGNORE_INDEX).sum()) > 0
