"""pipeline/packing.py: the bounded seeded shuffle, rows packed from documents, a microbatch's tensors."""

from __future__ import annotations

import numpy as np
import torch

from model.kernels.attention import document_offsets
from model.loss import IGNORE_INDEX
from pipeline.packing import Row, collate_rows, pack_rows, shuffle_documents
from pipeline.records import INPUT_IDLE, StreamStats
from tests.pipeline_helpers import documents_of


def test_rows_are_exactly_seq_len_and_keep_every_token_in_order():
    docs = documents_of([3, 17, 8, 1, 40, 5, 9])
    stats = StreamStats()
    rows = list(pack_rows(docs, 16, stats))
    assert all(len(r.tokens) == 16 for r in rows)
    flat = np.concatenate([r.tokens for r in rows])
    everything = np.concatenate(docs)
    assert np.array_equal(flat, everything[: len(flat)])
    assert stats.tail_tokens_dropped == len(everything) - len(flat) == 83 - 80


def test_positions_restart_at_each_document_and_its_continuation():
    rows = list(pack_rows(documents_of([5, 20, 7]), 16, StreamStats()))
    assert rows[0].positions.tolist() == [0, 1, 2, 3, 4] + list(range(11))
    assert rows[1].positions.tolist() == list(range(9)) + list(range(7))


def test_targets_predict_the_next_token_of_the_same_document_only():
    rows = list(pack_rows(documents_of([5, 11]), 16, StreamStats()))
    row = rows[0]
    targets = row.targets()
    assert targets[:4].tolist() == row.tokens[1:5].tolist()
    assert targets[4] == IGNORE_INDEX  # the last token of document 1 must not predict document 2
    assert targets[5:15].tolist() == row.tokens[6:16].tolist()
    assert targets[15] == IGNORE_INDEX
    assert (targets != IGNORE_INDEX).sum() == 16 - 2


def test_shuffle_is_a_seeded_permutation_that_never_holds_more_than_its_bound():
    docs = documents_of(range(1, 200))
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
    docs = documents_of([50] * 100)
    held = []
    it = shuffle_documents(iter(docs), max_docs=10**6, max_tokens=500, seed=0)
    first = next(it)
    held.append(first)
    assert len(first) == 50  # released as soon as the buffer passed 500 tokens


def test_an_idle_input_releases_an_updates_worth_of_the_shuffle_buffer_at_once():
    docs = documents_of([10] * 50)
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
