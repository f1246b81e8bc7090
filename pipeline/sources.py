"""Where records come from: stdin (the dataset under RunFab), or the bundled sample when a person means it."""

from __future__ import annotations

import fcntl
import logging
import os
import select
import sys
import time
from pathlib import Path
from typing import BinaryIO

from pipeline.records import UnusableInputError

log = logging.getLogger(__name__)


PIPE_BYTES = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size: the most an unprivileged process may ask for


class DescriptorReader:
    """``readline`` straight from a file descriptor with ``os.read``.

    Python's buffered ``sys.stdin`` holds a lock while a read waits; if training ends while the
    reader thread still waits on an open, silent stdin, interpreter shutdown cannot take that
    lock and aborts the process (exit 134) after a successful run. ``os.read`` holds no lock.

    A pipe (RunFab's worker streams the dataset into stdin) is widened to ``PIPE_BYTES`` and read in
    chunks as large: while the reader thread waits for room in the feeder's queue, the writer can fill
    the pipe, and the reader then takes a microbatch's records in a read or two, not sixteen or more.
    What that buys is fewer reads; throughput measured the same as with 64 KiB reads (docs/PERFORMANCE.md).
    """

    def __init__(self, fd: int, chunk_bytes: int = PIPE_BYTES) -> None:
        self.fd, self.chunk_bytes = fd, chunk_bytes
        self.pipe_bytes = widen_pipe(fd)  # None: not a pipe, or not Linux
        self._buffer, self._start, self._eof = b"", 0, False
        self._waited = 0.0  # seconds waited by the reads since bytes were last ready at once (or the last idle)

    def _fill(self, idle_seconds: float | None = None) -> bool | None:
        """Read one more chunk; False at end of input; None (only with ``idle_seconds``) once the input is idle.

        Idle means the reads since bytes were last ready at once have waited ``idle_seconds`` in
        all, and this one finds nothing: a trickle of records (each read waits a little) is idle
        as surely as a silent pipe, while a stream read at full speed, whose bytes are there when
        asked for, never is.
        """
        if self._eof:
            return False
        if idle_seconds is not None:
            if select.select([self.fd], [], [], 0)[0]:
                self._waited = 0.0
            else:
                started = time.monotonic()
                ready = select.select([self.fd], [], [], max(idle_seconds - self._waited, 0.0))[0]
                self._waited += time.monotonic() - started
                if not ready:
                    self._waited = 0.0
                    return None
        chunk = os.read(self.fd, self.chunk_bytes)
        if not chunk:
            self._eof = True
            return False
        self._buffer = self._buffer[self._start :] + chunk
        self._start = 0
        return True

    def peek(self, size: int = 1) -> bytes:
        while len(self._buffer) - self._start < size and self._fill():
            pass
        return self._buffer[self._start : self._start + size]

    def readline(self, limit: int = -1) -> bytes:
        return self.readline_or_idle(limit, None)

    def readline_or_idle(self, limit: int, idle_seconds: float | None) -> bytes | None:
        """``readline``, or None when the input is idle (see ``_fill``) before the line is complete;
        the bytes already read stay buffered for the next call."""
        searched = self._start
        while True:
            newline = self._buffer.find(b"\n", searched)
            available = len(self._buffer) - self._start
            if newline >= 0 and (limit < 0 or newline - self._start < limit):
                end = newline + 1
            elif 0 <= limit <= available:
                end = self._start + limit
            elif not (filled := self._fill(idle_seconds)):
                if filled is None:
                    return None
                end = len(self._buffer)
            else:
                searched = available  # the bytes already searched now start the rebased buffer
                continue
            line = self._buffer[self._start : end]
            self._start = end
            return line


def widen_pipe(fd: int, size: int = PIPE_BYTES) -> int | None:
    """Ask for a ``size``-byte buffer on the pipe ``fd``, or for the system's limit where that is lower;
    the pipe's buffer size after, or None where ``fd`` is not a pipe or the system cannot say."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return None
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except PermissionError:  # above /proc/sys/fs/pipe-max-size
        try:
            limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
            return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, min(size, limit))
        except (OSError, ValueError):
            return None
    except OSError:  # not a pipe: a file, a terminal, a socket
        return None


ASK_FOR_SAMPLE = "pass --data.source sample (under RunFab's train(), which takes no options: data.source: sample in the bundle's config)"


def open_input(sample_path: Path | None, stdin: BinaryIO | None = None, source: str = "auto") -> tuple[BinaryIO, str]:
    """Where records come from: ``data.source``.

    ``auto`` reads stdin, except from an interactive terminal, where a person means the bundled
    sample. Under RunFab stdin is the dataset, so an empty or closed stdin is an error, never a
    silent run on the sample; ``sample`` asks for the sample explicitly.
    """
    if source == "litdata":  # only `python train.py` trains from prepared rows (runtime/shard_run.py)
        raise UnusableInputError(
            "data.source is litdata, but this run reads stdin (RunFab's hooks train from stdin only). Train from "
            "prepared rows with `python train.py --data.source litdata --data.path DIR`, or set data.source auto."
        )
    if source == "sample":
        return _open_sample(sample_path, "data.source is sample")
    if stdin is None:
        if sys.stdin is None or _closed(0):
            raise UnusableInputError(
                "stdin is closed, so there is no input. Pipe NDJSON records into stdin, or train on the bundled "
                f"sample: {ASK_FOR_SAMPLE}."
            )
        stdin = DescriptorReader(0)
        interactive = os.isatty(0)
    else:
        interactive = stdin.isatty()
    if interactive and source == "auto":
        return _open_sample(sample_path, "stdin is a terminal")
    if not stdin.peek(1)[:1]:
        raise UnusableInputError(
            "stdin is empty: the input ended before its first record. Under RunFab stdin is the dataset; "
            f"check the dataset attached to the job. To train on the bundled sample: {ASK_FOR_SAMPLE}."
        )
    return stdin, "stdin"


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def _open_sample(sample_path: Path | None, why: str) -> tuple[BinaryIO, str]:
    if sample_path is None or not sample_path.is_file():
        raise FileNotFoundError(
            f"no input: {why}, and the bundled sample {sample_path} does not exist. "
            "Pipe NDJSON records into stdin or set data.sample_path to a file of the bundle."
        )
    log.info("training on the bundled sample %s (%s)", sample_path, why)
    return sample_path.open("rb"), str(sample_path)
