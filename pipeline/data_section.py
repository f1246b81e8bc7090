"""The ``data`` section of the run configuration: where records come from and every buffer's bound.

The stream's stages (records.py, validation_split.py, packing.py, stream.py) take their bounds from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runfab.limits import RECORD_BYTES


InputSource = Literal["auto", "stdin", "sample", "litdata"]  # data.source: see sources.open_input; litdata: pipeline/shards.py


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
    """Share of documents held out for validation, chosen by a hash of their content, among those read before
    the first update (the shuffle buffer's bounds); the set is then fixed and later documents are all trained on"""
    val_max_tokens: int = 1 << 18
    """Tokens the validation set holds at most: held-out documents past it are trained on; a data.val_path file
    holding more is refused"""
    val_path: str | None = None
    """A file of NDJSON records (as training reads them) that is the validation set, read whole; nothing is then
    held out of the input. null: hold out data.val_fraction of the input's first documents"""
    shuffle_buffer_docs: int = 10_000
    """Documents the seeded shuffle buffer holds at most"""
    shuffle_buffer_tokens: int = 1 << 23
    """Tokens the seeded shuffle buffer holds at most"""
    max_train_tokens: int | None = None
    """Token budget: training stops after this many target tokens; null: no budget"""
    prefetch_updates: int = 2
    """Complete updates read ahead of training, per rank"""

    def problems(self) -> list[str]:
        found = []
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
