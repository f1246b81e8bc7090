"""Records, documents and stream settings for the pipeline's tests."""

from __future__ import annotations

import json

import numpy as np

from pipeline.data_section import DataConfig
from pipeline.stream import StreamSettings


VOCAB = 1000


def ndjson(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def documents_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).astype(np.int32) for n in lengths]


def stream_settings(world_size: int = 1, **data) -> StreamSettings:
    data = DataConfig(**{"val_fraction": 0.05, "val_max_tokens": 200, "shuffle_buffer_docs": 16, **data})
    return StreamSettings(data=data, seq_len=32, vocab_size=VOCAB, eos_id=0, seed=0, microbatch=2, accumulation=2,
                          world_size=world_size)


def fake_encode(texts):
    return [[1 + (ord(c) % (VOCAB - 1)) for c in t] for t in texts]
