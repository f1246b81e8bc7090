"""Memory stays flat while a large stream runs through the whole data flow.

A separate process generates NDJSON text records (random words) into a pipe, so the input never
exists in this process as a whole; ``pipeline.stream.stream_updates`` reads, validates, tokenizes
(with the bundled tokenizer), holds out, shuffles, packs and assembles it into updates, which
are dropped as soon as they are counted. RSS is sampled as it goes: after a warm-up (buffers
filled, tokenizer threads started) it may not grow by more than ``GROWTH_BOUND``.

The input is 256 MiB by default (about 30 s on two CPU cores); ``RSS_TEST_MB=1024`` raises it.
The words are whole-word tokens of the bundled tokenizer (about 10 bytes per token), which keeps
the tokenizer's share of the time low enough for that budget; real prose only costs more time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil

from pipeline.data_section import DataConfig
from pipeline.records import StreamStats
from pipeline.stream import StreamSettings, stream_updates
from pipeline.validation_split import ValidationPool
from pipeline.tokenizer import TextEncoder

from tests.helpers import ROOT

TOKENIZER = ROOT / "conf" / "tokenizer.json"
MIB = 1 << 20
INPUT_MIB = int(os.environ.get("RSS_TEST_MB", "256"))
WARMUP_MIB = 32  # RSS at this point of the input is the baseline
GROWTH_BOUND = 32 * MIB  # observed: under 1 MiB; keeping every token of 256 MiB of text would add ~100 MiB
SAMPLE_EVERY_BYTES = MIB

# Written to stdout in chunks; reports the byte count on stderr. Its memory is its own process's.
GENERATOR = textwrap.dedent(
    """
    import json, random, sys
    total, seed, tokenizer = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    vocab = json.load(open(tokenizer, encoding="utf-8"))["model"]["vocab"]
    # "Ġword": a whole word with its leading space, in byte-level BPE notation
    words = sorted(t[1:] for t in vocab if t.startswith("\\u0120") and t[1:].isascii() and t[1:].isalpha() and len(t) > 6)
    assert len(words) > 500, len(words)
    docs = [json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(20, 800)))}).encode() + b"\\n"
            for _ in range(2048)]
    out, written = sys.stdout.buffer, 0
    while written < total:
        chunk = b"".join(rng.choices(docs, k=64))
        out.write(chunk)
        written += len(chunk)
    out.flush()
    print(written, file=sys.stderr)
    """
)


def rss() -> int:
    return psutil.Process().memory_info().rss


class SampledStream:
    """The pipe, passed through: samples RSS every ``SAMPLE_EVERY_BYTES`` of input read.

    Sampling by input position rather than by update also catches a flow that holds records
    back and emits nothing until the end.
    """

    def __init__(self, raw) -> None:
        self.raw = raw
        self.position = 0
        self.next_sample = 0
        self.samples: list[tuple[int, int]] = []  # (bytes read so far, RSS)

    def _count(self, data: bytes) -> bytes:
        self.position += len(data)
        if self.position >= self.next_sample:
            self.samples.append((self.position, rss()))
            self.next_sample = self.position + SAMPLE_EVERY_BYTES
        return data

    def readline(self, size: int = -1) -> bytes:
        return self._count(self.raw.readline(size))

    def read(self, size: int = -1) -> bytes:
        return self._count(self.raw.read(size))

    def read1(self, size: int = -1) -> bytes:
        return self._count(self.raw.read1(size))

    def __iter__(self):
        return iter(self.readline, b"")

    def __getattr__(self, name):
        return getattr(self.raw, name)


def test_rss_stays_flat_while_streaming_a_large_input():
    encoder = TextEncoder(TOKENIZER, num_threads=2)
    data = DataConfig(
        val_fraction=0.01, val_max_tokens=1 << 16,  # the held-out pool fills early, then must stop growing
        shuffle_buffer_docs=2000, shuffle_buffer_tokens=1 << 20,
    )
    settings = StreamSettings(data=data, seq_len=256, vocab_size=encoder.vocab_size, eos_id=encoder.eos_id,
                              seed=0, microbatch=4, accumulation=8)
    stats, pool = StreamStats(), ValidationPool(data.val_max_tokens)

    generator = subprocess.Popen(
        [sys.executable, "-c", GENERATOR, str(INPUT_MIB * MIB), "0", str(TOKENIZER)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    stream = SampledStream(generator.stdout)
    start_rss, start = rss(), time.monotonic()
    updates = 0
    try:
        for per_rank in stream_updates(stream, settings, encoder.encode_batch_arrays, stats, pool):
            assert len(per_rank) == 1 and len(per_rank[0]) == settings.accumulation
            updates += 1
            del per_rank
    finally:
        generator.stdout.close()
        generator.wait(timeout=60)
    elapsed = time.monotonic() - start
    end_rss = rss()
    samples = [*stream.samples, (stream.position, end_rss)]
    written = int(generator.stderr.read().decode().split()[-1])

    assert generator.returncode == 0
    assert stats.end_of_input and stats.bytes_read == stream.position == written >= INPUT_MIB * MIB, \
        "the input was not read to the end"
    assert stats.rejected == {} and stats.accepted == stats.records
    assert updates == stats.updates > 1000
    assert pool.tokens <= data.val_max_tokens

    warm = [r for read, r in samples if read >= WARMUP_MIB * MIB]
    assert len(warm) >= (INPUT_MIB - WARMUP_MIB) * MIB // SAMPLE_EVERY_BYTES // 2, "too few samples after the warm-up"
    baseline, peak = warm[0], max(warm)
    print(
        f"\nstreamed {written / MIB:.0f} MiB ({stats.document_tokens / 1e6:.1f}M tokens, {stats.documents} documents, "
        f"{updates} updates) in {elapsed:.1f} s; RSS start {start_rss / MIB:.0f} MiB, baseline after "
        f"{WARMUP_MIB} MiB {baseline / MIB:.0f} MiB, peak {max(r for _, r in samples) / MIB:.0f} MiB, "
        f"end {end_rss / MIB:.0f} MiB ({len(samples)} samples); growth after warm-up {(peak - baseline) / MIB:.1f} MiB"
    )
    assert peak - baseline < GROWTH_BOUND, (
        f"RSS grew by {(peak - baseline) / MIB:.0f} MiB over {(written - WARMUP_MIB * MIB) / MIB:.0f} MiB of input "
        f"after the warm-up (bound {GROWTH_BOUND / MIB:.0f} MiB): something holds on to the stream"
    )
