"""A model's validation cross-entropy: the exact token-weighted mean (summed target-token loss over the target-token
count) over documents packed into rows as validation packs them. The run's "before -> after"
(callbacks/fixed_validation.py) and ``python -m tools evaluate`` compute it here, which imports no Lightning, so a
tool that scores an export starts without it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import numpy as np
import torch

from pipeline.packing import collate_rows, pack_rows
from pipeline.records import StreamStats


def cross_entropy(model, documents: Iterable[np.ndarray], seq_len: int, microbatch: int, device: torch.device,
                  context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> dict:
    """Token-weighted cross-entropy of ``model`` (a model.decoder.Decoder, either family) on ``documents``
    packed in rows of ``seq_len``."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    rows: list = []

    def score(chunk: list) -> None:
        nonlocal total, count
        batch = collate_rows(chunk)
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        with context():
            total += model.loss_sum(batch).double()
        count += batch["target_tokens"]

    try:
        with torch.no_grad():
            for row in pack_rows(documents, seq_len, StreamStats(), pad_last=True):  # rows one chunk at a time
                rows.append(row)
                if len(rows) == microbatch:
                    score(rows)
                    rows = []
            if rows:
                score(rows)
    finally:
        model.train(was_training)
    ce = float(total) / count if count else None
    return {"cross_entropy": ce, "perplexity": float(np.exp(ce)) if ce is not None else None, "target_tokens": count}
