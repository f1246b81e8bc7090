"""Training from prepared shards: rows packed once by ``python -m tools prepare``, stored as LitData
chunks, and streamed by LitData on every rank of Lightning's DDP (one process, the GPUs of one node,
or several nodes).

What is stored: one LitData item per packed row, built by the stdin path's own stages
(``read_records -> encode_documents -> shuffle_documents -> pack_rows``): the row's ``tokens``
(int32, ``model.max_seq_len`` of them) and ``starts``, the offsets where a document or its
continuation begins. Positions, targets and document offsets follow from these (``item_row``,
then ``collate_rows``), so training sees exactly the rows the stdin path would pack. A small file
beside LitData's index (``SHARDS_META``) records the row length, the tokenizer and the largest token
id the rows hold; training refuses rows of another length or tokenizer, or with an id beyond its
vocabulary (``check_meta``), and checks every row's length again.

Why rows are packed when preparing rather than when training: a row is then LitData's unit, and
LitData already gives every rank the same number of rows (``drop_last``) and resumes a rank's stream
exactly from the count of rows it yielded (the StreamingDataLoader state that Lightning keeps in its
checkpoint). Packing while training would put the packer's partial row and shuffle buffer into that
state, and ranks whose documents pack into fewer rows would need a collective every update to learn
whether all of them still have one. The price is that ``model.max_seq_len`` is fixed by the preparation.

One update on each rank: the loader yields the rank's whole share of the update as one batch
(microbatch x accumulation rows, ``GroupCollate``), which ``ShardUpdates`` hands to Lightning as
its microbatches. The exact loss normalisation needs the update's target-token count over all
ranks: ``ShardUpdates`` asks the ranks' per-update agreement for it (``settle``; the runtime's
all-reduce, runtime/update_agreement.py), and hands it with the update's rows digest to every
microbatch. This module reads and checks rows; it never talks to the other ranks itself.

LitData is optional (pyproject extra ``cluster``): it is imported inside the functions that use
it, so the RunFab bundle imports this module without it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from pipeline.packing import Row, collate_rows
from runfab import created_files
from runfab.lifetime import exit_with_parent

log = logging.getLogger(__name__)

FORMAT = "runfab-packed-rows/1"  # what an item holds; a later change of layout gets a new name
SHARDS_META = "runfab-shards.json"  # beside LitData's index.json: row length, tokenizer, what the preparation found
VALIDATION_FILE = "validation.jsonl"  # beside them: the held-out documents, as records of token ids
CLUSTER_INSTALL = ("`pip install --no-deps litdata==0.2.76` and `pip install boto3 requests` (the pyproject extra "
                   "`cluster`; docs/several-nodes.md)")


class ShardsError(ValueError):
    """Prepared rows that this run cannot train from; the message says what to change."""


def import_litdata():
    """LitData, or a one-line error that says how to install it without touching torch."""
    try:
        import litdata
    except ImportError as error:
        raise ShardsError(f"data.source litdata and `python -m tools prepare` need LitData, which is not importable "
                          f"({error}); install it with {CLUSTER_INSTALL}") from None
    return litdata


def is_url(path: str) -> bool:
    return "://" in path


# ----------------------------------------------------------------------------- one row, one item


def row_item(row: Row) -> dict[str, np.ndarray]:
    """What LitData stores for a row: its tokens and where its documents start."""
    return {"tokens": np.ascontiguousarray(row.tokens, dtype=np.int32),
            "starts": np.flatnonzero(row.positions == 0).astype(np.int32)}


def item_row(item: dict, seq_len: int) -> Row:
    """The row back: positions restart at 0 at every stored start."""
    tokens = np.asarray(item["tokens"], dtype=np.int32)
    if len(tokens) != seq_len:
        raise ShardsError(f"a prepared row has {len(tokens)} tokens but model.max_seq_len is {seq_len}; prepare the "
                          f"corpus again with --model.max_seq_len {seq_len}, or train with the row length it was "
                          f"prepared for")
    starts = np.asarray(item["starts"], dtype=np.int64)
    segment_start = np.zeros(seq_len, dtype=np.int32)
    segment_start[starts] = starts
    np.maximum.accumulate(segment_start, out=segment_start)
    return Row(tokens, np.arange(seq_len, dtype=np.int32) - segment_start)


# ----------------------------------------------------------------------------- what the preparation records


def write_meta(output: str, meta: dict) -> None:
    """``SHARDS_META`` into the prepared folder, or uploaded beside the index at an object-store URL."""
    write_text(output, SHARDS_META, json.dumps(meta, indent=2, sort_keys=True) + "\n")


def write_text(output: str, name: str, text: str) -> None:
    """A file ``name`` into the prepared folder, or uploaded beside the index at an object-store URL."""
    if not is_url(output):
        created_files.write_text(Path(output) / name, text)
        return
    from litdata.streaming.fs_provider import _get_fs_provider

    with tempfile.TemporaryDirectory() as folder:
        local = Path(folder) / name
        local.write_text(text)
        _get_fs_provider(output).upload_file(str(local), f"{output.rstrip('/')}/{name}")


def read_meta(path: str) -> dict:
    """``SHARDS_META`` of a prepared folder or URL; a ShardsError when it is not one."""
    not_prepared = (f"data.path {path} holds no {SHARDS_META}: it was not written by `python -m tools prepare` "
                    f"(or that run did not finish); prepare the corpus with `python -m tools prepare --input "
                    f"'FILES.jsonl' --output {path}`")
    try:
        if not is_url(path):
            return json.loads((Path(path) / SHARDS_META).read_text())
        import_litdata()
        from litdata.streaming.fs_provider import _get_fs_provider

        with tempfile.TemporaryDirectory() as folder:
            local = Path(folder) / SHARDS_META
            _get_fs_provider(path).download_file(f"{path.rstrip('/')}/{SHARDS_META}", str(local))
            return json.loads(local.read_text())
    except FileNotFoundError:
        raise ShardsError(not_prepared) from None
    except (OSError, ValueError) as error:
        if isinstance(error, ShardsError):
            raise
        raise ShardsError(f"{not_prepared} ({type(error).__name__}: {error})") from None


def read_validation(path: str, meta: dict, encode_batch: Callable, eos_id: int, vocab_size: int) -> list[np.ndarray]:
    """The documents of the validation split beside the rows (``VALIDATION_FILE``), read by the record
    rules and tokenizer of training; none when the preparation held none out."""
    from pipeline.records import StreamStats, file_documents

    if not (meta.get("validation") or {}).get("documents"):
        return []
    with tempfile.TemporaryDirectory() as folder:
        local = Path(path) / VALIDATION_FILE
        if is_url(path):
            from litdata.streaming.fs_provider import _get_fs_provider

            local = Path(folder) / VALIDATION_FILE
            _get_fs_provider(path).download_file(f"{path.rstrip('/')}/{VALIDATION_FILE}", str(local))
        with local.open("rb") as stream:  # every record whole: the preparation wrote them, none is too long
            return list(file_documents(stream, StreamStats(), encode_batch, eos_id, vocab_size,
                                       local.stat().st_size + 1))


def check_meta(meta: dict, path: str, seq_len: int, tokenizer_sha256: str, tokenizer_name: str,
               vocab_size: int) -> None:
    """Refuse rows this model cannot train from: another format, row length or tokenizer, or a token id
    the model's embedding has no row for (the largest id the rows hold, which the preparation recorded;
    for a preparation that did not record it, the largest its tokenizer can give)."""
    if meta.get("format") != FORMAT:
        raise ShardsError(f"{path} holds rows in format {meta.get('format')!r}, this trainer reads {FORMAT!r}; "
                          "prepare the corpus again with this version's `python -m tools prepare`")
    if meta["seq_len"] != seq_len:
        raise ShardsError(f"{path} holds rows of {meta['seq_len']} tokens but model.max_seq_len is {seq_len}; set "
                          f"--model.max_seq_len {meta['seq_len']}, or prepare the corpus again with "
                          f"--model.max_seq_len {seq_len}")
    if meta["tokenizer_sha256"] != tokenizer_sha256:
        raise ShardsError(f"{path} was tokenized with {meta['tokenizer']} (sha256 {meta['tokenizer_sha256'][:12]}), "
                          f"but data.tokenizer is {tokenizer_name} (sha256 {tokenizer_sha256[:12]}); train with the "
                          "tokenizer the corpus was prepared with, or prepare it again")
    largest = meta.get("max_token_id", meta["vocab_size"] - 1)
    if largest >= vocab_size:
        raise ShardsError(f"{path} holds token ids up to {largest} but model.vocab_size is {vocab_size}; train "
                          f"with --model.vocab_size {largest + 1} or more, or prepare the corpus again with "
                          f"--model.vocab_size {vocab_size} (its records with larger ids are then rejected)")


# LitData's index.json names how its chunks are decoded; `tools prepare` writes raw numpy arrays only. Other
# decoders include "pickle", which would run code from a data.path that may be a shared remote folder.
CHUNK_LOADER = "PyTreeLoader"
CHUNK_FORMAT = "no_header_numpy:"  # then the dtype's index
CHUNK_SPEC_TYPES = {"builtins.dict", None}  # a dict of arrays (tokens, starts)


def read_index(path: str) -> dict:
    """LitData's ``index.json`` of a prepared folder or URL."""
    if not is_url(path):
        return json.loads((Path(path) / "index.json").read_text())
    from litdata.streaming.fs_provider import _get_fs_provider

    with tempfile.TemporaryDirectory() as folder:
        local = Path(folder) / "index.json"
        _get_fs_provider(path).download_file(f"{path.rstrip('/')}/index.json", str(local))
        return json.loads(local.read_text())


def check_chunk_format(path: str) -> None:
    """Refuse chunks that `tools prepare` does not write (another item loader, a decoder other than raw
    numpy arrays, compression, encryption), before LitData decodes one."""
    try:
        config = read_index(path)["config"]
        spec = json.loads(config.get("data_spec") or "null")
        formats = config["data_format"]
        found = [f"item_loader {config.get('item_loader')!r}"] if config.get("item_loader") != CHUNK_LOADER else []
        found += [f"data_format {one!r}" for one in formats if not str(one).startswith(CHUNK_FORMAT)]
        found += [f"{key} {config[key]!r}" for key in ("compression", "encryption") if config.get(key) is not None]
        found += [f"data_spec type {one!r}" for one in spec_types(spec) if one not in CHUNK_SPEC_TYPES]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ShardsError(f"data.path {path}: LitData's index.json cannot be read ({type(error).__name__}: "
                          f"{error}); prepare the corpus again with `python -m tools prepare`") from None
    if found:
        raise ShardsError(f"data.path {path} holds chunks that `python -m tools prepare` does not write "
                          f"({', '.join(found)}; it writes {CHUNK_LOADER} items of raw numpy arrays, "
                          "uncompressed, unencrypted); they are not read: prepare the corpus again with "
                          "`python -m tools prepare`")


def spec_types(spec) -> list:
    """The ``type`` of every node of a serialized pytree spec (``[version, node]``)."""
    if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], dict)):
        raise ValueError(f"data_spec is not a serialized pytree: {spec!r}")
    found, nodes = [], [spec[1]]
    while nodes:
        node = nodes.pop()
        found.append(node.get("type"))
        nodes += node.get("children_spec") or []
    return found


# ----------------------------------------------------------------------------- training


class GroupCollate:
    """The loader's collate: a rank's rows of one update -> its microbatches and their target tokens.

    Runs in the loader's worker processes when there are any (``data.loader_workers``)."""

    def __init__(self, seq_len: int, microbatch: int) -> None:
        self.seq_len, self.microbatch = seq_len, microbatch

    def __call__(self, items: list[dict]) -> dict:
        rows = [item_row(item, self.seq_len) for item in items]
        batches = [collate_rows(rows[i : i + self.microbatch]) for i in range(0, len(rows), self.microbatch)]
        return {"microbatches": batches, "target_tokens": sum(b["target_tokens"] for b in batches),
                "rows_digest": sum(b["rows_digest"] for b in batches)}


class ShardUpdates:
    """What Lightning trains from: each rank-share of an update from the LitData loader, as
    ``accumulation`` microbatches that carry the update's target-token count and rows digest over all
    ranks, which ``settle`` returns from this rank's (the ranks' agreement: runtime/update_agreement.py).

    Sized (every rank has the same number of complete updates: LitData's ``drop_last``) and stateful:
    Lightning saves and restores the loader's position with its checkpoint. Checkpoints are written
    between updates, when the loader has yielded exactly the updates trained."""

    def __init__(self, loader, accumulation: int, settle: Callable[[int, int], tuple[int, int]]) -> None:
        self.loader, self.accumulation, self.settle = loader, accumulation, settle

    def __len__(self) -> int:
        return len(self.loader) * self.accumulation

    def __iter__(self) -> Iterator[dict]:
        for group in self.loader:
            total, digest = self.settle(group["target_tokens"], group["rows_digest"])
            for batch in group["microbatches"]:
                batch["update_target_tokens"] = total
                batch["update_digest"] = digest
                yield batch

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def open_rows(path: str, seed: int, rows_per_batch: int = 1, workers: int = 0, collate_fn=None,
              pin_memory: bool = False):
    """LitData's StreamingDataLoader over the prepared rows: this rank's share (LitData reads the rank
    and world size from torch.distributed or the environment), shuffled with ``seed`` a chunk at a
    time, every rank the same number of batches. Its worker processes leave stops to the trainer
    (``loader_worker_start``)."""
    litdata = import_litdata()
    check_chunk_format(path)
    dataset = litdata.StreamingDataset(path, shuffle=True, drop_last=True, seed=seed)
    same_split_everywhere(dataset)
    start = functools.partial(loader_worker_start, os.getpid()) if workers else None
    return litdata.StreamingDataLoader(dataset, batch_size=rows_per_batch, num_workers=workers,
                                       collate_fn=collate_fn, pin_memory=pin_memory, worker_init_fn=start)


def loader_worker_start(trainer_pid: int, worker_id: int) -> None:
    """In each loader worker: leave stop signals to the training process, and end with it.

    torchrun stops a rank by signalling its whole process group, SLURM signals every process of a
    step, and Ctrl-C reaches the terminal's group: the loader's workers get the signal too. Killed
    by it, they would take the training process down (PyTorch fails a loader whose worker died)
    before it finished the agreed update and wrote its checkpoint. So SIGINT is ignored, and SIGTERM
    ends a worker only when the training process itself sends it (PyTorch and multiprocessing
    terminate the workers they shut down that way, and would wait for ever on one that ignored it).
    Whatever way the training process ends, the kernel's parent-death signal ends the worker too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by the thread below instead
    threading.Thread(target=_end_on_sigterm_from, args=(trainer_pid,), name="sigterm-from-trainer",
                     daemon=True).start()
    exit_with_parent(trainer_pid)


def _end_on_sigterm_from(trainer_pid: int) -> None:
    while True:
        received = signal.sigwaitinfo({signal.SIGTERM})
        if received.si_pid == trainer_pid:
            os._exit(128 + signal.SIGTERM)


def prepared_fingerprint(path: str) -> str:
    """SHA-256 over the prepared folder's ``SHARDS_META`` and LitData's ``index.json`` (a folder or an
    object-store URL): another preparation into the same place gives another value."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as folder:
        for name in (SHARDS_META, "index.json"):
            if is_url(path):
                from litdata.streaming.fs_provider import _get_fs_provider

                local = Path(folder) / name
                _get_fs_provider(path).download_file(f"{path.rstrip('/')}/{name}", str(local))
            else:
                local = Path(path) / name
            digest.update(hashlib.sha256(local.read_bytes()).digest())
    return digest.hexdigest()


def same_split_everywhere(dataset) -> None:
    """The same shuffle and split of rows on every filesystem. On a parallel filesystem (Lustre, GPFS,
    NFS...) LitData would give each reader whole chunks and cut every reader to the shortest one's
    rows, dropping up to a chunk per rank, and none at all to a rank when chunks are fewer than
    ranks; its local-disk layout splits chunks between readers at row granularity and permutes the
    chunks globally. Reading in place (memory-mapped, never copied or deleted) is kept."""
    profile = getattr(dataset, "posix_fast", None)
    if profile is not None and profile.window_shuffle:
        dataset.posix_fast = dataclasses.replace(profile, kind="posix")
