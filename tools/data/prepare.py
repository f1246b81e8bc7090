"""``python -m tools prepare --input 'PATTERN.jsonl' --output DIR``: tokenize NDJSON records once into
packed rows stored as LitData chunks, for ``python train.py --data.source litdata --data.path DIR``.

The records go through the stdin path's own stages (pipeline/records.py, pipeline/packing.py: the
same record rules, the same tokenizer, the bounded seeded shuffle, the same packer) and each packed
row becomes one LitData item (pipeline/shards.py says what an item holds and why rows are packed
here). ``litdata.optimize`` runs the work in parallel worker processes: every input file is cut into
byte ranges of ``--range-mib`` (a record belongs to the range holding its first byte), each range is
one work item, and the partial row left at the end of a range is dropped and counted, as the stdin
path drops the one at the end of its input. DIR is a local folder or an object-store URL LitData writes to
(``s3://bucket/prefix``, ``gs://...``).

The settings come from the same configuration as training (``--config``, default conf/config.yaml, and
``--section.key VALUE`` overrides): ``model.max_seq_len`` (the row length), ``model.vocab_size``,
``data.tokenizer``, ``data.max_record_bytes``, the tokenizer batch and shuffle buffer bounds, ``seed``.
Training checks the row length, the tokenizer and the largest token id against ``runfab-shards.json``,
written last.

A local DIR is written only when it is new or empty, or when a preparation wrote it (it holds
``PREPARED_MARK`` and nothing but what a preparation writes): LitData empties a folder of its
``*.bin`` and ``*index.json`` files before it writes, whoever made them. ``--overwrite`` replaces the
rows of such a folder; a folder of someone else's is refused either way, as are the bundle, system
folders and the home folder. A preparation that fails or is stopped removes what it wrote.

stderr carries LitData's progress bar and the summary (records, documents, tokens, rows, rejects by
reason); stdout carries the same summary as one JSON object. Exit 0 when rows were written, 2 for a
usage or input problem (nothing usable, nothing matched, an output that is not prepare's to write),
128 + the signal's number when SIGTERM or SIGINT stopped it.
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
import signal
import sys
import tempfile
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from runfab import created_files
from runfab.lifetime import STOP_SIGNALS, exit_with_parent, on_stop_signals
from runfab.limits import MIB

DEFAULT_RANGE_MIB = 64
CHUNK_BYTES = "64MB"  # LitData's chunk size: large reads from object stores, few files
# What LitData writes into a local output folder: its chunks, its index and the index files it merges into it.
LITDATA_NAME = re.compile(r"chunk-\d+-\d+(\.zstd)?\.bin|(\d+[.-])?index\.json(\.tmp)?")
PREPARED_MARK = ".prepare-output"
PREPARED_MARK_TEXT = ("`python -m tools prepare` wrote this folder. Another preparation writes into it only with "
                      "--overwrite, and then removes only what a preparation writes (LitData's chunks and index, "
                      "runfab-shards.json); a folder without this file is never written into unless it is empty.\n")


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
    from pipeline.validation_split import write_documents
    from pipeline.packing import pack_rows, shuffle_documents
    from pipeline.records import StreamStats, UnusableInputError, encode_documents, read_records
    from pipeline.validation_split import ValidationPool, split_validation

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
        largest = -1
        for row in pack_rows(shuffled, s.seq_len, stats):
            largest = max(largest, int(row.tokens.max()))
            yield row_item(row)
    write_documents(pool.snapshot(), Path(s.stats_dir, f"{index}.validation.jsonl"))
    counts = {"input_sha256": reader.digest.hexdigest(), "held_out_documents": stats.held_out_documents,
              "held_out_tokens": stats.held_out_tokens,
              "records": stats.records, "accepted": stats.accepted, "rejected": dict(stats.rejected),
              "bytes_read": stats.bytes_read, "documents": stats.documents, "document_tokens": stats.document_tokens,
              "rows": stats.rows, "tail_tokens_dropped": stats.tail_tokens_dropped, "max_token_id": largest}
    created_files.write_text(Path(s.stats_dir, f"{index}.json"), json.dumps(counts))


def summarize(stats_dir: Path, ranges: int) -> dict:
    """The counts of every range, added up; the largest token id any row holds (-1 without rows)."""
    total: Counter = Counter()
    rejected: Counter = Counter()
    largest = -1
    for file in stats_dir.glob("*.json"):
        counts = json.loads(file.read_text())
        rejected.update(counts.pop("rejected"))
        largest = max(largest, counts.pop("max_token_id"))
        counts.pop("input_sha256", None)
        total.update(counts)
    names = ("records", "accepted", "bytes_read", "documents", "document_tokens", "rows", "tail_tokens_dropped",
             "held_out_documents", "held_out_tokens")
    return {"ranges": ranges, **{name: total[name] for name in names}, "rejected": dict(sorted(rejected.items())),
            "max_token_id": largest}


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
    from pipeline.fingerprints import validation_digest
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
            f"documents ({summary['held_out_tokens']} tokens); largest token id {summary['max_token_id']}")


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


def listing(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")


class PreparedFolder:
    """The local output folder of one preparation: whether it may write there, and removing what it wrote."""

    def __init__(self, path: Path, own_names: tuple[str, ...]) -> None:
        """``own_names``: the files a preparation writes beside LitData's (its record first)."""
        self.path, self.own_names, self.meta_name = path, own_names, own_names[0]
        self.made_folder = self.made_mark = False

    def is_written_name(self, name: str) -> bool:
        """Whether ``name`` is a file a preparation writes (and so may remove), rather than someone else's."""
        path = self.path / name
        return ((name in self.own_names or LITDATA_NAME.fullmatch(name) is not None) and not path.is_symlink()
                and path.is_file())

    def problem(self, overwrite: bool) -> str | None:
        """Why this preparation may not write here, or None."""
        from runtime.output_folder import unsafe_folder

        folder = self.path
        if (what := unsafe_folder(folder)) is not None:
            return f"--output {folder} is {what}; give a folder of its own (it is created)"
        if not os.path.lexists(folder):
            return None
        if not folder.is_dir():
            return f"--output {folder} is a file; give a folder (it is created) or an object-store URL"
        names = sorted(os.listdir(folder))
        if not names:
            return None
        mark = folder / PREPARED_MARK
        if mark.is_symlink() or not mark.is_file():
            return (f"--output {folder} holds {listing(names)}, and no preparation wrote it (it has no "
                    f"{PREPARED_MARK}): prepare writes only into a new or empty folder, or one it wrote, since LitData "
                    "deletes *.bin and *index.json files where it writes; give another --output")
        foreign = [name for name in names if name != PREPARED_MARK and not self.is_written_name(name)]
        if foreign:
            return (f"--output {folder} holds {listing(foreign)}, which no preparation wrote; neither a preparation "
                    "nor --overwrite removes them: move them away, or give another --output")
        done = [name for name in ("index.json", self.meta_name) if name in names]
        if done and not overwrite:
            return (f"{folder} already holds prepared rows ({', '.join(done)}); give a new --output, or "
                    "--overwrite to replace them")
        return None

    def claim(self) -> None:
        """Create the folder if needed and mark it as a preparation's, remembering what was made here."""
        if not self.path.is_dir():
            self.path.mkdir(parents=True)
            self.made_folder = True
        if not (self.path / PREPARED_MARK).is_file():
            with created_files.open_created(self.path / PREPARED_MARK, "x") as mark:
                self.made_mark = True
                mark.write(PREPARED_MARK_TEXT)
        (self.path / self.meta_name).unlink(missing_ok=True)  # no stale record beside rows that fail to replace it

    def remove_written(self) -> None:
        """Remove what a preparation writes here, then the mark and the folder if this one made them."""
        if not self.path.is_dir():
            return
        for name in os.listdir(self.path):
            if self.is_written_name(name):
                (self.path / name).unlink(missing_ok=True)
        if self.made_mark:
            (self.path / PREPARED_MARK).unlink(missing_ok=True)
        if self.made_folder:
            with contextlib.suppress(OSError):  # someone put a file there meanwhile: it stays, and so does the folder
                self.path.rmdir()


class Stopped(Exception):
    """SIGTERM or SIGINT reached this process while it prepared."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stops_raise_stopped():
    """The first SIGTERM or SIGINT raises Stopped; later ones are ignored while it is handled."""
    seen: list[int] = []

    def stop(signum, frame) -> None:
        if not seen:
            seen.append(signum)
            raise Stopped(signum)

    restore = on_stop_signals(stop)
    try:
        yield
    finally:
        restore()


def run_optimize(**optimize_args) -> str | None:
    """``litdata.optimize(**optimize_args)`` in a child process that leads a process group of its own;
    LitData's error message when it refused or a worker failed, None when it succeeded.

    LitData's workers are processes this one cannot stop cleanly while optimize runs here: LitData's
    SIGINT handler ends its process with status 0, and after a SIGTERM a worker blocked on a pipe can
    outlive it. In a group of their own, out of reach of a terminal's Ctrl-C or a signal to this
    process's group, they are ended together with SIGKILL when a stop (or any exception) reaches
    this process, which holds no LitData state and so can remove what they wrote and report."""
    start = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    receiver, sender = multiprocessing.get_context(start).Pipe(duplex=False)
    child = multiprocessing.get_context(start).Process(target=_optimize_in_group, args=(sender, optimize_args),
                                                       name="prepare-optimize")
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a stop waits until the child is known, and killable
        try:
            child.start()
            with contextlib.suppress(OSError):  # the child makes its group too; whichever comes first
                os.setpgid(child.pid, child.pid)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        sender.close()
        child.join()
    except BaseException:
        if child.pid is not None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                child.kill()
            child.join()
        raise
    try:
        message = receiver.recv() if receiver.poll() else None
    except EOFError:  # it closed the pipe without a message: it succeeded, or it died
        message = None
    if message is None and child.exitcode != 0:
        message = f"LitData's run ended with status {child.exitcode}; its error is above"
    return message


def _optimize_in_group(report, optimize_args: dict) -> None:
    """The child of run_optimize: optimize, with LitData's caches in this preparation's own folder."""
    for sig in STOP_SIGNALS:  # the parent's handler raises Stopped: a stop is the parent's to handle
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the parent while it forked
    exit_with_parent()
    scratch = Path(optimize_args.pop("scratch"))
    # LitData empties its cache folders (default /tmp/chunks, /tmp/data) when it starts: never another's.
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(scratch / "chunks")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(scratch / "data")
    status = 0
    try:
        from pipeline import shards

        with stdout_to_stderr():
            shards.import_litdata().optimize(**optimize_args)
    except RuntimeError as error:  # LitData's own refusals (an output it will not write over) and worker failures
        report.send(" ".join(str(error).split()))
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # a forked child: none of the parent's exit handlers


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
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the rows a preparation wrote in DIR (a folder holding anything else is refused)")
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
    with stops_raise_stopped():
        try:
            return prepare(args, overrides)
        except Stopped as stop:  # before anything was written (prepare handles a stop after that)
            print(f"python -m tools prepare: stopped by {stop} before it wrote anything", file=sys.stderr)
            return 128 + stop.signum


def prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    """The preparation ``main`` runs; a stop raises Stopped."""
    from config import ConfigError, bundle_path, load_config
    from pipeline.fingerprints import sha256_file
    from pipeline import shards
    from runtime.training_run import load_encoder

    def refuse(message: str) -> int:
        print(f"python -m tools prepare: {message}", file=sys.stderr)
        return 2

    try:
        cfg = load_config(args.config, overrides)
        encoder = load_encoder(cfg)
        shards.import_litdata()  # its one-line refusal when missing, before anything is written
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
    own_names = (shards.SHARDS_META, shards.VALIDATION_FILE)
    folder = None if shards.is_url(output) else PreparedFolder(Path(output), own_names)
    if folder is not None and (problem := folder.problem(args.overwrite)):
        return refuse(problem)
    ranges = byte_ranges(paths, max(1, int(args.range_mib * MIB)))
    if not ranges:
        return refuse(f"the input files are empty: {', '.join(paths)}")
    workers = min(args.workers or len(os.sched_getaffinity(0)), len(ranges))
    tokenizer = bundle_path(cfg.data.tokenizer)
    with tempfile.TemporaryDirectory(prefix="prepare-") as scratch:
        try:
            if folder is not None:
                folder.claim()
            stats_dir = Path(scratch, "stats")
            stats_dir.mkdir()
            settings = PrepareSettings(
                tokenizer=str(tokenizer), seq_len=cfg.model.max_seq_len, vocab_size=cfg.model.vocab_size,
                seed=cfg.seed, max_record_bytes=cfg.data.max_record_bytes,
                tokenize_batch_docs=cfg.data.tokenize_batch_docs, tokenize_batch_bytes=cfg.data.tokenize_batch_bytes,
                shuffle_buffer_docs=cfg.data.shuffle_buffer_docs, shuffle_buffer_tokens=cfg.data.shuffle_buffer_tokens,
                stats_dir=str(stats_dir),
                val_fraction=held_out_fraction(cfg.data.val_fraction, cfg.data.val_max_tokens,
                                               sum(os.path.getsize(p) for p in paths)),
                val_max_tokens=cfg.data.val_max_tokens)
            print(f"python -m tools prepare: {len(paths)} file(s), {len(ranges)} byte range(s), {workers} worker "
                  f"process(es), rows of {cfg.model.max_seq_len} tokens -> {output}", file=sys.stderr)
            start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
            failure = run_optimize(fn=_bound(settings), inputs=ranges, output_dir=output, num_workers=workers,
                                   chunk_bytes=CHUNK_BYTES, mode="overwrite" if args.overwrite else None,
                                   keep_data_ordered=True, reorder_files=False, start_method=start_method,
                                   scratch=scratch)
            if failure is not None:
                raise PrepareFailed(failure)
            summary = summarize(stats_dir, len(ranges))
            print(summary_line(summary, cfg.model.max_seq_len), file=sys.stderr)
            if not summary["rows"]:
                from pipeline.records import EXPECTED_RECORD

                raise PrepareFailed(f"no complete row of {cfg.model.max_seq_len} tokens: {summary['documents']} "
                                    f"usable documents ({summary['document_tokens']} tokens) in {summary['records']} "
                                    f"records; expected {EXPECTED_RECORD}")
            validation = write_validation_split(stats_dir, len(ranges), output, cfg.data.val_max_tokens,
                                                encoder.eos_id)
            meta = {"format": shards.FORMAT, "seq_len": cfg.model.max_seq_len, "tokenizer": cfg.data.tokenizer,
                    "tokenizer_sha256": sha256_file(tokenizer), "vocab_size": encoder.vocab_size,
                    "eos_id": encoder.eos_id, "max_token_id": summary["max_token_id"], "seed": cfg.seed,
                    "inputs": paths, "settings": {k: v for k, v in asdict(settings).items() if k != "stats_dir"},
                    "summary": summary, "validation": validation}
            meta["fingerprint"] = fingerprint(meta, input_digests(stats_dir, len(ranges)),
                                              max(1, int(args.range_mib * MIB)))
            shards.write_meta(output, meta)
        except PrepareFailed as failed:
            if folder is not None:
                folder.remove_written()
            return refuse(f"{failed}; nothing was left in {output}" if folder is not None else str(failed))
        except Stopped as stop:
            if folder is not None:
                folder.remove_written()
            where = (f"what it had written to {output} was removed" + (" (with --overwrite, the earlier rows too)"
                                                                        if args.overwrite else "")
                     if folder is not None else f"the chunks it had uploaded to {output} may remain; prepare again "
                                                "with --overwrite")
            # On a line of its own: the killed workers may have left LitData's progress bar mid-line.
            print(f"\npython -m tools prepare: stopped by {stop}: its worker processes were ended and {where}",
                  file=sys.stderr)
            return 128 + stop.signum
        except BaseException:
            if folder is not None:
                folder.remove_written()
            raise
    print(json.dumps(summary), flush=True)
    return 0


class PrepareFailed(Exception):
    """A preparation that cannot produce rows from this input; the message says why."""


def _bound(settings: PrepareSettings):
    """prepare_range with the settings bound: a module-level callable LitData's workers can pickle."""
    import functools

    return functools.partial(prepare_range, settings=settings)


if __name__ == "__main__":
    sys.exit(main())
