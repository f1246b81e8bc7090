"""A plain reference implementation of GPT-2's byte-level BPE, for tests only.

Built from OpenAI's two original files (``encoder.json`` and ``vocab.bpe``, shipped gzip-compressed
in ``tests/fixtures/gpt2``), never from the bundle's tokenizer.json, so that comparing the bundle's
encoders with it checks the bundled file too. It follows GPT-2's published algorithm step by step
and optimizes nothing but a per-word cache:

1. split the text with GPT-2's pre-tokenization regex (the ``regex`` module, as GPT-2 used);
2. turn each piece's UTF-8 bytes into GPT-2's printable stand-in characters;
3. repeatedly merge the adjacent pair with the lowest rank in ``vocab.bpe`` (every occurrence of
   that pair, left to right) until no adjacent pair has a rank;
4. look each resulting symbol up in ``encoder.json``.

``<|endoftext|>`` in text gets no special treatment: GPT-2's encoder never produced id 50256 from
text, so it is encoded as the characters it is made of.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import regex

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpt2"
ENCODER_JSON = FIXTURES / "encoder.json.gz"
VOCAB_BPE = FIXTURES / "vocab.bpe.gz"

SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def printable_stand_ins() -> dict[int, str]:
    """Byte -> character: bytes that print as themselves in Latin-1 (other than space) keep their
    character; the other 68 bytes get U+0100, U+0101, ... in byte order."""
    keep = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    table = {b: chr(b) for b in keep}
    for offset, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(0x100 + offset)
    return table


def read_fixture(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes())


class ReferenceGPT2:
    def __init__(self, encoder_json: bytes, vocab_bpe: bytes) -> None:
        self.encoder: dict[str, int] = json.loads(encoder_json.decode("utf-8"))
        lines = vocab_bpe.decode("utf-8").split("\n")
        assert lines[0].startswith("#version")
        merges = [tuple(line.split(" ")) for line in lines[1:] if line]
        self.ranks: dict[tuple[str, str], int] = {pair: rank for rank, pair in enumerate(merges)}
        self.stand_in = printable_stand_ins()
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_fixtures(cls) -> ReferenceGPT2:
        return cls(read_fixture(ENCODER_JSON), read_fixture(VOCAB_BPE))

    def merge_word(self, word: str) -> list[str]:
        symbols = list(word)
        while len(symbols) > 1:
            pairs = {(a, b) for a, b in zip(symbols, symbols[1:])}
            best = min(pairs, key=lambda pair: self.ranks.get(pair, len(self.ranks)))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in SPLIT.findall(text):
            cached = self._cache.get(piece)
            if cached is None:
                word = "".join(self.stand_in[b] for b in piece.encode("utf-8"))
                cached = [self.encoder[symbol] for symbol in self.merge_word(word)]
                if len(piece) < 100:
                    self._cache[piece] = cached
            ids.extend(cached)
        return ids
