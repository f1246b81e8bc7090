"""The validation cross-entropy of the initial and of the final weights on one fixed validation set:
the run's "before -> after", the same number for every run on the same set.

The set is the run's whole held-out set as it stands when training ends (the stdin path's pool of
held-out documents, or the validation split that ``python -m tools prepare`` wrote beside the
shards). The initial weights are built again from the seed, as training built them, and their
digest is checked against the one taken before update 1 (history.py): a "before" that was not
computed on the very initial weights is not reported. Rank 0 computes both, on its device, with
the Trainer's precision; no other rank takes part.

``cross_entropy`` is the exact token-weighted mean (summed target-token loss over the target-token
count) over the set packed into rows as validation packs them; ``python -m tools evaluate``
computes the same.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import lightning as L
import numpy as np
import torch

from pipeline import fingerprints
from pipeline.packing import collate_rows, pack_rows
from pipeline.records import StreamStats
from runfab import created_files

log = logging.getLogger(__name__)


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


def write_documents(documents: Iterable[np.ndarray], path: Path) -> None:
    """A validation set as NDJSON records of token ids, which read back as the same documents (the
    reader appends the EOS that ends each, so it is left out)."""
    with created_files.open_created(path, "w") as file:
        for doc in documents:
            file.write(json.dumps({"input_ids": np.asarray(doc[:-1]).tolist()}, separators=(",", ":")) + "\n")


class FixedValidation(L.Callback):
    """At the end of training (rank 0): the validation set's digest and size, and the cross-entropy
    of the initial and final weights on it. Placed before the export, which reads the same weights."""

    def __init__(self, documents: Callable[[], list[np.ndarray]], seq_len: int, microbatch: int,
                 initial_model: Callable[[torch.device], torch.nn.Module], initial_digest: Callable[[], str | None],
                 source: str, save_to: Path | None = None) -> None:
        self.documents, self.seq_len, self.microbatch = documents, seq_len, microbatch
        self.initial_model, self.initial_digest = initial_model, initial_digest
        self.source, self.save_to = source, save_to
        self.result: dict | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.global_step == 0:
            return
        docs = self.documents()
        result = {"source": self.source, **fingerprints.validation_digest(docs), "ce_before": None, "ce_after": None}
        if docs:
            device, context = pl_module.device, trainer.precision_plugin.forward_context
            result["ce_after"] = cross_entropy(pl_module.model, docs, self.seq_len, self.microbatch, device,
                                               context)["cross_entropy"]
            result |= self._before(docs, device, context)
            log.info("validation cross-entropy on the fixed set (%d documents, %d tokens): %s -> %.4f",
                     result["documents"], result["tokens"],
                     "?" if result["ce_before"] is None else f"{result['ce_before']:.4f}", result["ce_after"])
            if self.save_to is not None:
                self.save_to.parent.mkdir(parents=True, exist_ok=True)
                write_documents(docs, self.save_to)
                result["file"] = str(self.save_to)
        self.result = result

    def _before(self, docs: list[np.ndarray], device: torch.device, context) -> dict:
        from callbacks.history import model_weights_digest

        expected = self.initial_digest()
        if expected is None:
            return {"ce_before_missing": "the initial weights' digest is unknown (resumed from a checkpoint "
                                         "without it)"}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model = self.initial_model(device)
        try:
            if model_weights_digest(model) != expected:
                return {"ce_before_missing": "the weights built again from the seed differ from the run's initial "
                                             "weights"}
            return {"ce_before": cross_entropy(model, docs, self.seq_len, self.microbatch, device,
                                               context)["cross_entropy"]}
        finally:
            del model
