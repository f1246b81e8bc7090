"""pipeline/sources.py: stdin or the bundled sample, and the descriptor reader under stdin."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.records import UnusableInputError
from pipeline.sources import DescriptorReader, PIPE_BYTES, open_input, widen_pipe
from tests.pipeline_helpers import ndjson


class FakeStdin(io.BufferedReader):
    def __init__(self, raw, tty: bool = False) -> None:
        super().__init__(raw)
        self.tty = tty

    def isatty(self):
        return self.tty


def test_input_is_stdin_and_the_bundled_sample_only_when_a_person_means_it(tmp_path):
    sample = tmp_path / "sample.jsonl"
    sample.write_bytes(ndjson({"text": "bundled"}))
    stream, source = open_input(sample, FakeStdin(io.BytesIO(b'{"text": "piped"}\n')))
    assert source == "stdin" and stream.readline() == b'{"text": "piped"}\n'
    hook_user = r"train\(\), which takes no options: data.source: sample in the bundle's config"
    with pytest.raises(UnusableInputError, match=r"stdin is empty.*--data.source sample.*" + hook_user):
        open_input(sample, FakeStdin(io.BytesIO(b"")))  # under RunFab an empty stdin is an empty dataset
    stream, source = open_input(sample, FakeStdin(io.BytesIO(b""), tty=True))  # a person at a terminal
    assert source == str(sample) and stream.readline() == b'{"text": "bundled"}\n'
    stream, source = open_input(sample, FakeStdin(io.BytesIO(b'{"text": "piped"}\n')), "sample")  # asked for
    assert source == str(sample)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        open_input(tmp_path / "missing.jsonl", FakeStdin(io.BytesIO(b""), tty=True))


def test_the_descriptor_reader_reads_lines_as_a_buffered_reader_does():
    rng = np.random.default_rng(5)
    lines = [b"x" * int(n) + b"\n" for n in rng.integers(0, 3000, 400)] + [b"y" * 70_000 + b"\n", b"no newline"]
    data = b"".join(lines)
    read_end, write_end = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(write_end, data), os.close(write_end)))
    writer.start()
    ours, reference = DescriptorReader(read_end, chunk_bytes=1000), io.BufferedReader(io.BytesIO(data))
    assert ours.peek(1) == reference.peek(1)[:1]
    for limit in [-1, 7, 2048, 1 << 20] * 200:
        line = ours.readline(limit)
        assert line == reference.readline(limit)
        if not line:
            break
    writer.join()
    os.close(read_end)


def test_the_descriptor_reader_widens_a_pipe_and_takes_what_waits_there_in_one_read(monkeypatch, tmp_path):
    """While the reader thread waits for room in the feeder's queue, the writer runs ahead: the widened pipe holds
    a megabyte of records (the kernel's default, 64 KiB), and the reader takes them in one read, then the end of
    input in another, where 64 KiB reads would take seventeen. A file is no pipe and is left as it is."""
    read_end, write_end = os.pipe()
    ours = DescriptorReader(read_end)
    assert ours.pipe_bytes == fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ) == PIPE_BYTES
    record = b'{"input_ids": [' + b"1, " * 300 + b"2]}\n"
    data = record * (PIPE_BYTES // len(record))
    os.write(write_end, data)  # all of it at once: on a 64 KiB pipe this write would wait for a reader
    os.close(write_end)
    reads = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, size: reads.append(size) or real_read(fd, size))
    assert b"".join(iter(ours.readline, b"")) == data and len(reads) == 2
    os.close(read_end)
    file = tmp_path / "records.jsonl"
    file.write_bytes(record)
    with file.open("rb") as f:
        assert DescriptorReader(f.fileno()).pipe_bytes is None


def test_a_pipe_wider_than_the_system_allows_an_unprivileged_user_gets_the_systems_limit(monkeypatch):
    """Above /proc/sys/fs/pipe-max-size the kernel refuses an unprivileged process outright (EPERM); the
    reader then asks for the limit instead of keeping the 64 KiB default."""
    limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    real_fcntl = fcntl.fcntl

    def unprivileged(fd, cmd, arg=0):
        if cmd == fcntl.F_SETPIPE_SZ and arg > limit:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", unprivileged)
    read_end, write_end = os.pipe()
    try:
        assert widen_pipe(read_end, 4 * limit) == limit == real_fcntl(read_end, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_the_descriptor_reader_calls_a_silent_pipe_and_a_trickle_idle_and_a_full_one_never():
    read_end, write_end = os.pipe()
    ours = DescriptorReader(read_end)
    os.write(write_end, b'{"text": "par')
    start = time.monotonic()
    assert ours.readline_or_idle(-1, 0.3) is None and time.monotonic() - start >= 0.3
    os.write(write_end, b'tial"}\n')
    assert ours.readline_or_idle(-1, 0.3) == b'{"text": "partial"}\n'  # the part read before the idle is kept

    def trickle():
        for i in range(12):
            time.sleep(0.1)
            os.write(write_end, b"line %d\n" % i)
        os.close(write_end)

    writer = threading.Thread(target=trickle)
    writer.start()
    got = [ours.readline_or_idle(-1, 0.35) for _ in range(40)]
    writer.join()
    lines = [line for line in got if line]
    assert lines == [b"line %d\n" % i for i in range(12)]
    assert None in got[: got.index(b"line 11\n")]  # no gap of 0.35 s, but the waits add up to one
    os.close(read_end)

    read_end, write_end = os.pipe()
    os.write(write_end, b"x\n" * 1000)
    os.close(write_end)
    ours = DescriptorReader(read_end, chunk_bytes=64)
    assert [ours.readline_or_idle(-1, 0.01) for _ in range(1001)] == [b"x\n"] * 1000 + [b""]
    os.close(read_end)
