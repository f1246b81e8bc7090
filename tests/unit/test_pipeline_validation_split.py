"""pipeline/validation_split.py: which documents are held out, and the one validation set they form."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest

from pipeline import fingerprints
from pipeline.records import StreamStats, UnusableInputError
from pipeline.stream import stream_updates
from pipeline.validation_split import (ValidationPool, is_held_out, load_validation_file, split_validation,
                                       write_documents)

from tests.pipeline_helpers import VOCAB, fake_encode, ndjson, stream_settings

EVERYTHING = dict(read_ahead_docs=10**9, read_ahead_tokens=10**9)  # the whole input is read ahead


def test_held_out_documents_are_chosen_by_content_not_by_order():
    docs = [(f"doc {i}".encode(), np.arange(i % 7 + 1, dtype=np.int32)) for i in range(4000)]
    chosen = {key for key, _ in docs if is_held_out(key, 0.05)}
    assert 100 < len(chosen) < 300
    stats = StreamStats()
    pool = ValidationPool(max_tokens=10**9)
    trained = list(split_validation(reversed(docs), pool, 0.05, stats, **EVERYTHING))
    assert stats.held_out_documents == len(chosen) and len(trained) == 4000 - len(chosen)
    assert pool.closed_by == "end_of_input" and pool.documents_read == 4000


def test_the_set_is_closed_at_val_max_tokens_and_later_held_out_documents_are_trained():
    docs = [(f"doc {i}".encode(), np.arange(10, dtype=np.int32)) for i in range(2000)]
    stats = StreamStats()
    pool = ValidationPool(max_tokens=55)
    trained = list(split_validation(docs, pool, 0.5, stats, **EVERYTHING))
    assert pool.tokens == 50 and stats.held_out_documents == 5 and pool.closed_by == "val_max_tokens"
    assert len(trained) == 2000 - 5
    assert not pool.offer(np.arange(1, dtype=np.int32))  # closed: not even a document that would fit


def test_the_set_comes_from_the_read_ahead_only_and_does_not_depend_on_how_far_the_input_is_read():
    """Held-out documents are searched only among those read before the shuffle buffer would release its
    first one: the set is the same whether the run reads 300 documents or 3000."""
    docs = [(f"doc {i}".encode(), np.full(i % 5 + 1, i, dtype=np.int32)) for i in range(3000)]
    sets = []
    for read in (300, 3000):
        pool = ValidationPool(max_tokens=10**9)
        trained = list(split_validation(docs[:read], pool, 0.1, StreamStats(), read_ahead_docs=100,
                                        read_ahead_tokens=10**9))
        sets.append(fingerprints.validation_digest(pool.snapshot()))
        assert pool.closed_by == "read_ahead" and len(trained) == read - sets[-1]["documents"]
        searched = pool.documents_read
        assert searched - sets[-1]["documents"] == 101  # the training document that passes the bound closes it
    assert sets[0] == sets[1] and sets[0]["documents"] > 0
    held = [key for key, _ in docs[:searched] if is_held_out(key, 0.1)]
    assert len(held) == sets[0]["documents"]


def test_an_input_that_ends_before_the_set_is_full_gives_what_was_gathered_and_says_so(caplog):
    docs = [(f"doc {i}".encode(), np.arange(4, dtype=np.int32)) for i in range(100)]
    pool = ValidationPool(max_tokens=10**6)
    with caplog.at_level(logging.WARNING, logger="pipeline.validation_split"):
        list(split_validation(docs, pool, 0.2, StreamStats(), **EVERYTHING))
    assert pool.closed_by == "end_of_input" and len(pool.snapshot()) > 0
    assert "the input ended before the set reached data.val_max_tokens" in caplog.text
    assert pool.description()["closed_after_updates"] == 0


def test_the_validation_set_does_not_depend_on_the_batch_split_or_the_run_length():
    rng = np.random.default_rng(1)
    data = ndjson(*({"input_ids": [int(x) for x in rng.integers(1, VOCAB, int(n))]} for n in rng.integers(5, 80, 600)))
    digests = []
    for microbatch, accumulation, budget in ((2, 2, None), (4, 1, 300), (1, 8, 2000)):
        s = stream_settings(val_fraction=0.1, val_max_tokens=10**6, shuffle_buffer_docs=64)
        s.microbatch, s.accumulation, s.data.max_train_tokens = microbatch, accumulation, budget
        pool = ValidationPool(s.data.val_max_tokens)
        first = next(stream_updates(io.BytesIO(data), s, fake_encode, StreamStats(), pool))
        assert first and pool.closed_by == "read_ahead" and pool.closed_after_updates == 0  # before update 1
        digests.append(fingerprints.validation_digest(pool.snapshot()))
    assert digests[0] == digests[1] == digests[2] and digests[0]["documents"] > 0


def test_a_validation_file_is_read_whole_and_one_above_the_bound_is_refused(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ({"text": "abc"}, {"input_ids": [5, 6]}, {"text": ""})))
    pool = load_validation_file(path, fake_encode, 0, VOCAB, 1 << 20, max_tokens=100)
    assert [d.tolist() for d in pool.snapshot()] == [[98, 99, 100, 0], [5, 6, 0]]
    assert pool.closed and pool.ready_after(1) and pool.description()["formed"] == "file"
    with pytest.raises(UnusableInputError, match="more than data.val_max_tokens"):
        load_validation_file(path, fake_encode, 0, VOCAB, 1 << 20, max_tokens=5)
    # The stream then holds nothing out: every document trains.
    stats = StreamStats()
    list(stream_updates(io.BytesIO(ndjson(*({"input_ids": [7] * 20} for _ in range(40)))), stream_settings(),
                        fake_encode, stats, pool))
    assert stats.held_out_documents == 0 and len(pool.snapshot()) == 2


def test_a_written_validation_set_reads_back_as_the_same_documents(tmp_path):
    """What ``python -m tools prepare`` writes beside the shards, read as ``data.val_path`` reads a file: the
    same documents, each ending in its EOS, in the same order."""
    eos = VOCAB - 1
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, eos, n), eos).astype(np.int32) for n in (3, 40, 5, 17, 2, 9, 30, 4, 11)]
    path = tmp_path / "validation.jsonl"
    write_documents(docs, path)

    def no_text(texts):
        raise AssertionError(f"a written validation set holds token ids, not text: {texts[:1]}")

    pool = load_validation_file(path, no_text, eos_id=eos, vocab_size=VOCAB, max_record_bytes=1 << 20,
                                max_tokens=10**6)
    read = pool.snapshot()
    assert len(read) == len(docs)
    assert all(np.array_equal(a, b) for a, b in zip(read, docs))
