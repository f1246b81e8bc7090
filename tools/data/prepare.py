"""``python -m tools prepare --input 'PATTERN.jsonl' --output DIR``: tokenize NDJSON records once into
packed rows stored as LitData chunks, for ``python train.py --data.source litdata --data.path DIR``.

The records go through the stdin path's own stages (pipeline/stages.py: the same record rules, the
same tokenizer, the bounded seeded shuffle, the same packer) and each packed row becomes one LitData
item (pipeline/shards.py says what an item holds and why rows are packed here). ``litdata.optimize``
runs the work in parallel worker processes: every input file is cut into byte ranges of
``--range-mib`` (a record belongs to the range holding its first byte), each range is one work item,
and the partial row left at the end of a range is dropped and counted, as the stdin path drops the
one at the end of its input. DIR is a local folder or an object-store URL LitData writes to
(``s3://bucket/prefix``, ``gs://...``).

The settings come from the same configuration as training (``--config``, default conf/config.yaml, and
``--section.key VALUE`` overrides): ``model.max_seq_len`` (the row length), ``model.vocab_size``,
``data.tokenizer``, ``data.max_record_bytes``, the tokenizer batch and shuffle buffer bounds, ``seed``.
Training checks the row length and the tokenizer against ``runfab-shards.json``, written last.

stderr carries LitData's progress bar and the summary (records, documents, tokens, rows, rejects by
reason); stdout carries the same summary as one JSON object. Exit 0 when rows were written, 2 for a
usage or input problem (nothing usable, nothing matched, an output that already holds rows).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import multiprocessing
import os
import re
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

DEFAULT_RANGE_MIB = 64
CHUNK_BYTES = "64MB"  # LitData's chunk size: large reads from object stores, few files
CHUNK_NAME = re.compile(r"chunk-\d+-\d+(\.zstd)?\.bin")  # what LitData writes (and removes when it writes again)


@dataclass(frozen=True)
class PrepareSettings:
    """What each worker process needs: picklable, no objects."""

    tokenizer: str
    seq_len: int
    vocab_size: int
    seed: int
    max_record_bytes: int
    tokenize_batch_docs: int
    tokenize_batch_bytes: int
    shuffle_buffer_docs: int
    shuffle_buffer_tokens: int
    stats_dir: str
    val_fraction: float = 0.0  # of documents held out (by content hash) for the validation split
    val_max_tokens: int = 0


class RangeReader:
    """The lines of ``file`` that start in [start, end), with the ``readline(limit)`` the record reader uses.

    A line belongs to the range that holds its first byte: a range starting inside a line skips the
    rest of it, and a line that starts before ``end`` is read to its end, however long."""

    def __init__(self, file, start: int, end: int) -> None:
        self.file, self.end = file, end
        self.digest = hashlib.sha256()  # of the lines this range holds: the ranges' digests fingerprint the input
        if start > 0:
            file.seek(start - 1)
            while (part := file.readline(1 << 20)) and not part.endswith(b"\n"):  # bounded, however long the line
                pass
        self._line_start = True

    def readline(self, limit: int = -1) -> bytes:
        if self._line_start and self.file.tell() >= self.end:
            return b""
        line = self.file.readline(limit)
        self._line_start = line.endswith(b"\n")
        self.digest.update(line)
        return line


def byte_ranges(paths: list[str], range_bytes: int) -> list[tuple[str, int, int, int]]:
    """(path, start, end, index) work items covering every byte of every file once."""
    pieces = []
    for path in paths:
        size = os.path.getsize(path)
        pieces += [(path, start, min(start + range_bytes, size)) for start in range(0, size, range_bytes)]
    return [(path, start, end, index) for index, (path, start, end) in enumerate(pieces)]


_ENCODERS: dict = {}


def _encoder(path: str):
    """One tokenizer per worker process, single-threaded: the parallelism is the processes."""
    if path not in _ENCODERS:
        from pipeline.tokenizer import TextEncoder

        _ENCODERS[path] = TextEncoder(path, num_threads=1)
    return _ENCODERS[path]


def range_seed(seed: int, index: int) -> int:
    """The shuffle seed of one range: fixed by the run's seed and the range, whichever worker takes it."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little")


def prepare_range(piece: tuple[str, int, int, int], settings: PrepareSettings):
    """LitData's work function: the packed rows of one byte range, as items; its counts go to a file."""
    from pipeline.shards import row_item
    from callbacks.fixed_validation import write_documents
    from pipeline.stages import (StreamStats, UnusableInputError, ValidationPool, encode_documents, pack_rows,
                                 read_records, shuffle_documents, split_validation)

    path, start, end, index = piece
    s = settings
    encoder = _encoder(s.tokenizer)
    stats = StreamStats(source=f"{path}[{start}:{end}]")

    def documents(stream):
        try:  # a range without a usable record is counted, not an error: the whole corpus is judged at the end
            yield from read_records(stream, stats, s.vocab_size, s.max_record_bytes, give_up_after=sys.maxsize)
        except UnusableInputError:
            return

    pool = ValidationPool(s.val_max_tokens)
    with open(path, "rb") as file:
        reader = RangeReader(file, start, end)
        docs = documents(reader)
        tokens = encode_documents(docs, encoder.encode_batch_arrays, encoder.eos_id, stats, s.tokenize_batch_docs,
                                  s.tokenize_batch_bytes)
        shuffled = shuffle_documents(split_validation(tokens, pool, s.val_fraction, stats), s.shuffle_buffer_docs,
                                     s.shuffle_buffer_tokens, range_seed(s.seed, index))
        for row in pack_rows(shuffled, s.seq_len, stats):
            yield row_item(row)
    write_documents(pool.snapshot(), Path(s.stats_dir, f"{index}.validation.jsonl"))
    counts = {"input_sha256": reader.digest.hexdigest(), "held_out_documents": stats.held_out_documents,
              "held_out_tokens": stats.held_out_tokens,
              "records": stats.records, "accepted": stats.accepted, "rejected": dict(stats.rejected),
              "bytes_read": stats.bytes_read, "documents": stats.documents, "document_tokens": stats.document_tokens,
              "rows": stats.rows, "tail_tokens_dropped": stats.tail_tokens_dropped}
    Path(s.stats_dir, f"{index}.json").write_text(json.dumps(counts))


def summarize(stats_dir: Path, ranges: int) -> dict:
    """The counts of every range, added up."""
    total: Counter = Counter()
    rejected: Counter = Counter()
    for file in stats_dir.glob("*.json"):
        counts = json.loads(file.read_text())
        rejected.update(counts.pop("rejected"))
        counts.pop("input_sha256", None)
        total.update(counts)
    names = ("records", "accepted", "bytes_read", "documents", "document_tokens", "rows", "tail_tokens_dropped",
             "held_out_documents", "held_out_tokens")
    return {"ranges": ranges, **{name: total[name] for name in names}, "rejected": dict(sorted(rejected.items()))}


BYTES_PER_TOKEN = 4  # of NDJSON text, about: to hold out about as many documents as the split keeps


def held_out_fraction(val_fraction: float, val_max_tokens: int, input_bytes: int) -> float:
    """The share of documents the byte ranges hold out: data.val_fraction, or less when that would hold
    out far more than the split keeps (data.val_max_tokens), since what a range held out and the split
    has no room for is neither trained on nor validated."""
    if not val_fraction or not val_max_tokens:
        return 0.0
    return min(val_fraction, 2 * BYTES_PER_TOKEN * val_max_tokens / max(input_bytes, 1))


def write_validation_split(stats_dir: Path, ranges: int, output: str, max_tokens: int, eos_id: int) -> dict:
    """The held-out documents of every range, in range order, up to ``max_tokens`` (as the stdin path's
    pool takes them), written as ``validation.jsonl`` beside the rows; its digest and size."""
    from callbacks.fingerprints import validation_digest
    from pipeline import shards

    kept, documents, tokens = [], [], 0
    for index in range(ranges):
        file = stats_dir / f"{index}.validation.jsonl"
        for line in file.read_text().splitlines() if file.is_file() else ():
            ids = np.append(np.asarray(json.loads(line)["input_ids"], dtype=np.int32), np.int32(eos_id))
            if tokens + len(ids) <= max_tokens:
                kept.append(line)
                documents.append(ids)
                tokens += len(ids)
    shards.write_text(output, shards.VALIDATION_FILE, "".join(f"{line}\n" for line in kept))
    return {"file": shards.VALIDATION_FILE, **validation_digest(documents)}


def fingerprint(meta: dict, input_digests: list[str], range_bytes: int) -> str:
    """One digest of what decides the prepared rows and the split: the inputs' content, range by range
    (not their paths), the tokenizer, the row length, the settings and the validation split."""
    decisive = {"format": meta["format"], "seq_len": meta["seq_len"], "tokenizer_sha256": meta["tokenizer_sha256"],
                "vocab_size": meta["vocab_size"], "eos_id": meta["eos_id"],
                # the tokenizer's path is left out: its sha256 counts
                "settings": {k: v for k, v in meta["settings"].items() if k != "tokenizer"},
                "range_bytes": range_bytes, "inputs_sha256": input_digests,
                "validation_sha256": meta["validation"]["sha256"]}
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()


def input_digests(stats_dir: Path, ranges: int) -> list[str]:
    return [json.loads((stats_dir / f"{index}.json").read_text())["input_sha256"] for index in range(ranges)]


def summary_line(summary: dict, seq_len: int) -> str:
    rejected = ", ".join(f"{k}={v}" for k, v in summary["rejected"].items()) or "none"
    return (f"prepared: {summary['records']} records, {summary['accepted']} accepted, rejected: {rejected}; "
            f"{summary['documents']} documents, {summary['document_tokens']} tokens; {summary['rows']} rows of "
            f"{seq_len} tokens from {summary['ranges']} byte ranges; dropped at range ends: "
            f"{summary['tail_tokens_dropped']} tokens; held out for validation: {summary['held_out_documents']} "
            f"documents ({summary['held_out_tokens']} tokens)")


@contextlib.contextmanager
def stdout_to_stderr():
    """LitData prints its messages on stdout, in this process and in its workers: they go to stderr,
    so stdout carries the summary alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m tools prepare",
        description="Tokenize NDJSON records into packed rows stored as LitData chunks, for "
                    "`python train.py --data.source litdata --data.path DIR`. Configuration keys as train.py: "
                    "--config FILE and --section.key VALUE (model.max_seq_len, data.tokenizer, ...).")
    parser.add_argument("--input", action="append", required=True, metavar="PATTERN",
                        help="NDJSON file or glob pattern (quoted); repeat for several")
    parser.add_argument("--output", required=True, metavar="DIR", help="local folder or object-store URL (s3://, gs://)")
    parser.add_argument("--config", default=None, help="YAML config (default: $RUNFAB_CONFIG or conf/config.yaml)")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes (default: the cores this process may use)")
    parser.add_argument("--range-mib", type=float, default=DEFAULT_RANGE_MIB,
                        help=f"bytes of input per work item, in MiB (default {DEFAULT_RANGE_MIB})")
    parser.add_argument("--overwrite", action="store_true", help="replace rows already prepared in DIR")
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for i in range(0, len(rest), 2):
        key = rest[i]
        if not key.startswith("--") or "." not in key or i + 1 >= len(rest):
            parser.error(f"expected --section.key VALUE pairs after the options, got {' '.join(rest[i:i + 2])!r}")
        overrides.append(f"{key[2:]}={rest[i + 1]}")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    from config import ConfigError, bundle_path, load_config
    from callbacks.run_record import sha256_file
    from pipeline import shards
    from runtime.training_run import load_encoder

    def refuse(message: str) -> int:
        print(f"python -m tools prepare: {message}", file=sys.stderr)
        return 2

    try:
        cfg = load_config(args.config, overrides)
        encoder = load_encoder(cfg)
        litdata = shards.import_litdata()
    except (ConfigError, shards.ShardsError) as error:
        return refuse(str(error))
    paths = sorted({os.path.abspath(path) for pattern in args.input for path in glob.glob(os.path.expanduser(pattern))
                    if os.path.isfile(path)})
    if not paths:
        return refuse(f"no file matches {', '.join(args.input)}; quote a glob pattern so the shell leaves it to "
                      "this command")
    if args.workers is not None and args.workers < 1 or args.range_mib <= 0:
        return refuse("--workers must be at least 1 and --range-mib above 0")
    output = args.output if shards.is_url(args.output) else str(Path(args.output).expanduser().resolve())
    if not shards.is_url(output) and Path(output).is_file():
        return refuse(f"--output {output} is a file; give a folder (it is created) or an object-store URL")
    done = [name for name in ("index.json", shards.SHARDS_META) if not shards.is_url(output) and (Path(output) / name).exists()]
    if done and not args.overwrite:
        return refuse(f"{output} already holds prepared rows ({', '.join(done)}); give a new --output, or "
                      "--overwrite to replace them")
    foreign = [] if shards.is_url(output) or not Path(output).is_dir() else sorted(
        p.name for p in Path(output).glob("*.bin") if not CHUNK_NAME.fullmatch(p.name))
    if foreign:  # LitData empties the folder of *.bin files before writing: never someone else's
        return refuse(f"{output} holds .bin files that are not prepared rows ({', '.join(foreign[:3])}); LitData would "
                      "delete them: give an empty or new --output")
    if done:
        (Path(output) / shards.SHARDS_META).unlink(missing_ok=True)  # no stale record beside new rows, if this fails
    ranges = byte_ranges(paths, max(1, int(args.range_mib * 2**20)))
    if not ranges:
        return refuse(f"the input files are empty: {', '.join(paths)}")
    workers = min(args.workers or len(os.sched_getaffinity(0)), len(ranges))
    tokenizer = bundle_path(cfg.data.tokenizer)
    with tempfile.TemporaryDirectory(prefix="prepare-stats-") as stats_dir:
        settings = PrepareSettings(
            tokenizer=str(tokenizer), seq_len=cfg.model.max_seq_len, vocab_size=cfg.model.vocab_size, seed=cfg.seed,
            max_record_bytes=cfg.data.max_record_bytes, tokenize_batch_docs=cfg.data.tokenize_batch_docs,
            tokenize_batch_bytes=cfg.data.tokenize_batch_bytes, shuffle_buffer_docs=cfg.data.shuffle_buffer_docs,
            shuffle_buffer_tokens=cfg.data.shuffle_buffer_tokens, stats_dir=stats_dir,
            val_fraction=held_out_fraction(cfg.data.val_fraction, cfg.data.val_max_tokens,
                                           sum(os.path.getsize(p) for p in paths)),
            val_max_tokens=cfg.data.val_max_tokens)
        print(f"python -m tools prepare: {len(paths)} file(s), {len(ranges)} byte range(s), {workers} worker "
              f"process(es), rows of {cfg.model.max_seq_len} tokens -> {output}", file=sys.stderr)
        start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        try:
            with stdout_to_stderr():
                litdata.optimize(fn=_bound(settings), inputs=ranges, output_dir=output, num_workers=workers,
                                 chunk_bytes=CHUNK_BYTES, mode="overwrite" if args.overwrite else None,
                                 keep_data_ordered=True, reorder_files=False, start_method=start_method)
        except RuntimeError as error:  # LitData's own refusals (an output it will not write over) and worker failures
            return refuse(" ".join(str(error).split()))
        summary = summarize(Path(stats_dir), len(ranges))
        if summary["rows"]:
            validation = write_validation_split(Path(stats_dir), len(ranges), output, cfg.data.val_max_tokens,
                                                encoder.eos_id)
            digests = input_digests(Path(stats_dir), len(ranges))
    print(summary_line(summary, cfg.model.max_seq_len), file=sys.stderr)
    if not summary["rows"]:
        from pipeline.stages import EXPECTED_RECORD

        return refuse(f"no complete row of {cfg.model.max_seq_len} tokens: {summary['documents']} usable documents "
                      f"({summary['document_tokens']} tokens) in {summary['records']} records; expected "
                      f"{EXPECTED_RECORD}")
    meta = {"format": shards.FORMAT, "seq_len": cfg.model.max_seq_len, "tokenizer": cfg.data.tokenizer,
            "tokenizer_sha256": sha256_file(tokenizer), "vocab_size": encoder.vocab_size, "eos_id": encoder.eos_id,
            "seed": cfg.seed, "inputs": paths, "settings": {k: v for k, v in asdict(settings).items() if k != "stats_dir"},
            "summary": summary, "validation": validation}
    meta["fingerprint"] = fingerprint(meta, digests, max(1, int(args.range_mib * 2**20)))
    shards.write_meta(output, meta)
    print(json.dumps(summary), flush=True)
    return 0


def _bound(settings: PrepareSettings):
    """prepare_range with the settings bound: a module-level callable LitData's workers can pickle."""
    import functools

    return functools.partial(prepare_range, settings=settings)


if __name__ == "__main__":
    sys.exit(main())
