"""From documents to packed rows: the bounded seeded shuffle, the packer, and a microbatch's tensors.

    shuffle_documents -> pack_rows -> (collate_rows, per microbatch)

A row holds whole documents and pieces of them; ``attention_pairs`` is what its attention costs.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from model.kernels.attention import document_offsets
from model.loss import IGNORE_INDEX
from pipeline.fingerprints import rows_digest
from pipeline.records import INPUT_IDLE, InputIdle, StreamStats


def shuffle_documents(docs: Iterable[np.ndarray | InputIdle], max_docs: int, max_tokens: int, seed: int,
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


def collate_rows(rows: list[Row]) -> dict[str, torch.Tensor | int]:
    """Tensors of a microbatch; document offsets are found here, on the host, not by a device sync."""
    tokens, positions = np.stack([r.tokens for r in rows]), np.stack([r.positions for r in rows])
    positions = torch.from_numpy(positions.astype(np.int64))
    targets = np.stack([r.targets() for r in rows])
    cu_seqlens = document_offsets(positions)
    return {
        "input_ids": torch.from_numpy(tokens.astype(np.int64)),
        "positions": positions,
        "targets": torch.from_numpy(targets),
        "cu_seqlens": cu_seqlens,
        "attention_pairs": sum(attention_pairs(row) for row in rows),  # for MFU (model/flops.py)
        "target_tokens": int(np.count_nonzero(targets != IGNORE_INDEX)),
        "rows_digest": rows_digest(tokens, positions),  # pipeline/fingerprints.py: what the run record's training-tokens digest is made of
    }


def attention_pairs(row: Row) -> int:
    """Sum of s^2 over the row's document segments: what its attention costs, up to a constant."""
    starts = np.flatnonzero(row.positions == 0)
    lengths = np.diff(np.append(starts, len(row.positions))).astype(np.int64)
    return int((lengths * lengths).sum())
